"""The sweep: rule candidates out by the published rules and the memory model, say how long the rest will take, and
launch one probe per survivor, its result cached per model, hardware and candidate (an interrupted sweep continues)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from cram.errors import UserError
from cram.plan.emit import write_atomically, write_pair
from cram.plan.launch import search_and_time
from cram.plan.peak_memory import Shape, prune_reason, seed_micro_batch
from cram.plan.report import failure_note, source_note
from cram.plan.setting import Setting, probe_request
from cram.plan.space import Candidate
from cram.plan.sweep_length import LaunchLimits, sweep_length
from cram.train.deepspeed_ops import build_offload_optimizer


def ruled_out_reason(candidate: Candidate, setting: Setting) -> str | None:
    """Why the published rules or the installed libraries rule a candidate out before any launch, or None."""
    if candidate.is_fsdp and setting.use_cpu:
        return ("FSDP needs GPUs: on the CPU Accelerate falls back to MULTI_CPU data parallel, with no sharding to "
                "measure")
    if candidate.is_deepspeed and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed: pip install \"cram[deepspeed]\" to measure the ZeRO candidates"
    if candidate.optimizer == "adamw-8bit" and candidate.offload and candidate.is_deepspeed:
        return ("DeepSpeed replaces an 8-bit optimizer with its 32-bit CPU Adam when it offloads the optimizer (see "
                "check_optimizer_for_deepspeed)")
    if candidate.optimizer == "adamw-8bit" and candidate.is_fsdp:
        return "bitsandbytes' 8-bit Adam does not step FSDP2's sharded DTensor parameters (bitsandbytes#1633)"
    return None


def sweep(candidates: list[Candidate], setting: Setting, shape: Shape, limit_bytes: float, work_dir: Path,
          layer_class: str, limits: LaunchLimits, say=print, host_limit_bytes: float | None = None,
          retry_failed: bool = False, paired_rounds: int = 0, verify_steps: int = 0,
          dry_run: bool = False) -> list[dict]:
    """One row per candidate: measured, from the cache, or ruled out by rule or by the memory model. Before the
    first launch it says how long the sweep will take and how long each launch may run (`sweep_length`); with
    `dry_run` it stops there, the rows it would measure left without a status."""
    cache = work_dir / "cache" / setting.key()
    rows: list[dict] = []
    to_measure: list[tuple[Candidate, dict]] = []
    for candidate in candidates:
        row = {"candidate": candidate.name, **candidate.to_dict()}
        cached = cache / f"{candidate.name}.json"
        if (reason := ruled_out_reason(candidate, setting)) is not None:
            row.update(status="infeasible", source="rules", reason=reason)
        elif (reason := prune_reason(candidate, shape, limit_bytes, host_limit_bytes)) is not None:
            row.update(status="infeasible", source="memory model", reason=reason)
        elif cached.exists() and not (retry_failed and json.loads(cached.read_text())["status"] != "ok"):
            row.update(json.loads(cached.read_text()), source="cache")
        else:
            to_measure.append((candidate, row))
        rows.append(row)
    ruled_out = sum(row.get("source") in ("rules", "memory model") for row in rows)
    say(sweep_length([candidate for candidate, _ in to_measure], len(rows) - ruled_out - len(to_measure), ruled_out,
                     setting, limits, paired_rounds, verify_steps, shape.mixed_precision))
    for row in rows:
        if row.get("source") == "cache":
            say(f"    {row['candidate']}: {describe_row(row)}")
    if dry_run:
        return rows
    offload_failure: str | None = None
    offload_ready = False
    for index, (candidate, row) in enumerate(to_measure, 1):
        cached = cache / f"{candidate.name}.json"
        say(f"[{index}/{len(to_measure)}] measuring {candidate.name} ...")
        cached.unlink(missing_ok=True)  # a failed result being measured again (--retry-failed)
        if candidate.is_deepspeed and candidate.offload and not offload_ready and offload_failure is None:
            try:
                build_offload_optimizer()
                offload_ready = True
            except UserError:
                raise
            except Exception as error:  # noqa: BLE001 - a node without the op's toolchain: the offload rows fail
                offload_failure = (f"DeepSpeed's CPU Adam op, which offloading the optimizer needs, did not build: "
                                   f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}")
        if candidate.is_deepspeed and candidate.offload and offload_failure is not None:
            row.update(status="error", source="build", reason=offload_failure)
            say(f"    {candidate.name}: {describe_row(row)}")
            continue
        accelerate_file = write_pair(candidate, cache / "pairs", setting.num_processes, setting.use_cpu,
                                     layer_class, shape.hidden, shape.zero_init)
        request = probe_request(
            setting, candidate, cached, mode="search", memory_limit_bytes=setting.memory_limit_bytes,
            seed_micro_batch=seed_micro_batch(candidate, shape, limit_bytes), timed_steps=setting.timed_steps,
            max_timed_steps=setting.max_timed_steps, spread_bound=setting.spread_bound)
        result = search_and_time(request, accelerate_file, cache / f"{candidate.name}.request.json",
                                 limits.search_limit(candidate, setting))
        result["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        write_atomically(cached, json.dumps(result, indent=2) + "\n")
        row.update(result, source="measured")
        say(f"    {candidate.name}: {describe_row(row)}")
    return rows


def describe_row(row: dict) -> str:
    if row["status"] != "ok":
        return failure_note(row)
    time = row["step_time"]
    outside = row.get("outside_allocator_bytes") or 0.0
    return (f"micro-batch {row['micro_batch']} × {row['accumulation']} accumulation, "
            f"{time['median']:.3f} s/step ± {time['spread']:.1%}, one save {row['save_seconds']:.2f} s"
            + (f", {outside / 2**30:.2f} GiB of the device outside PyTorch's allocator left free" if outside else "")
            + f" ({source_note(row)})")


