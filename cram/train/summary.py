"""A finished run's summary.json and its last words on the console."""

from __future__ import annotations

import json
from pathlib import Path

from cram.train.state import TrainState
from cram.train.throughput import mfu


def write_summary(
    state: TrainState, checkpoint: Path, output_dir: Path, blocks: int, flops_per_token: float, parameters: int,
    parameters_held: int, resume_from: Path | None, optimizer_state: int, load_hint: str, peak: float | None,
    compile_mode: str | None = None,
) -> None:
    """OUTPUT_DIR/summary.json, and the run's last words on the console (ending with how to load the model).

    Its throughput is the steady one the log rows measure (each session's first step, which compiles, left out),
    and its MFU is that throughput's, against `peak`: the FLOP/s of all the run's devices (None: no MFU).
    `compile_mode`: the torch.compile mode the run trained in (None: eager), beside the throughput it gave."""
    tokens_per_second = state.tokens_per_second
    summary = {
        "optimizer_steps": state.optimizer_steps,
        "sequences": state.sequences,
        "tokens": state.tokens,
        "seconds": round(state.elapsed, 3),  # to the millisecond: the stop is judged against a short micro-batch
        "tokens_per_second": round(tokens_per_second, 1) if tokens_per_second is not None else None,
        "steady_tokens": state.steady_tokens,  # the tokens and seconds it rests on
        "steady_seconds": round(state.steady_seconds, 3),
        "epochs": state.sequences // blocks,
        "first_loss": state.first_loss,
        "final_loss": state.final_loss,
        "flops_per_token": flops_per_token,
        "mfu": mfu(tokens_per_second, flops_per_token, peak) if tokens_per_second is not None else None,
        "compile_mode": compile_mode,
        "peak_memory_gib": max(row["peak_memory_gib"] for row in state.history),
        "parameters": parameters,
        "parameters_held_by_rank0": parameters_held,
        "optimizer_state_bytes_held_by_rank0": optimizer_state,
        "resumed_from": str(resume_from) if resume_from else None,
        "continued_from": state.continued_from,
        "checkpoint": str(checkpoint),
        "history": state.history,
    }
    staging = output_dir / "summary.json.tmp"
    staging.write_text(json.dumps(summary, indent=2) + "\n")
    staging.replace(output_dir / "summary.json")
    rate = f"{tokens_per_second:,.0f} tokens/s after the first step" if tokens_per_second is not None else \
        "no step after the first to time"
    print(
        f"\ntrained {state.optimizer_steps} steps, {state.tokens:,} tokens in {state.elapsed:.0f} s "
        f"({rate}, {summary['epochs']} full pass(es) over the data); "
        f"loss {state.first_loss:.3f} -> {state.final_loss:.3f}\n"
        f"checkpoint: {checkpoint}\n"
        f"load it with:\n{load_hint}"
    )
