"""A finished run's summary.json and its last words on the console."""

from __future__ import annotations

import json
from pathlib import Path

from cram.train.state import TrainState


def write_summary(
    state: TrainState, checkpoint: Path, output_dir: Path, blocks: int, flops_per_token: float, parameters: int,
    parameters_held: int, resume_from: Path | None, optimizer_state: int, load_hint: str,
) -> None:
    """OUTPUT_DIR/summary.json, and the run's last words on the console (ending with how to load the model)."""
    summary = {
        "optimizer_steps": state.optimizer_steps,
        "sequences": state.sequences,
        "tokens": state.tokens,
        "seconds": round(state.elapsed, 3),  # to the millisecond: the stop is judged against a short micro-batch
        "tokens_per_second": round(state.tokens_per_second, 1),
        "epochs": state.sequences // blocks,
        "first_loss": state.first_loss,
        "final_loss": state.final_loss,
        "flops_per_token": flops_per_token,
        "mfu": state.history[-1].get("mfu"),
        "peak_memory_gib": max(row["peak_memory_gib"] for row in state.history),
        "parameters": parameters,
        "parameters_held_by_rank0": parameters_held,
        "optimizer_state_bytes_held_by_rank0": optimizer_state,
        "resumed_from": str(resume_from) if resume_from else None,
        "checkpoint": str(checkpoint),
        "history": state.history,
    }
    staging = output_dir / "summary.json.tmp"
    staging.write_text(json.dumps(summary, indent=2) + "\n")
    staging.replace(output_dir / "summary.json")
    print(
        f"\ntrained {state.optimizer_steps} steps, {state.tokens:,} tokens in {state.elapsed:.0f} s "
        f"({state.tokens_per_second:,.0f} tokens/s, {summary['epochs']} full pass(es) over the data); "
        f"loss {state.first_loss:.3f} -> {state.final_loss:.3f}\n"
        f"checkpoint: {checkpoint}\n"
        f"load it with:\n{load_hint}"
    )
