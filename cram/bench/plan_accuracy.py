"""Benchmark: how well the planner predicts a step time, and how long its sweep takes, on the CPU.

    python -m cram.bench.plan_accuracy [--models crammed-bert-tiny,crammed-bert-small,pythia-14m] [--processes 1,2]

Three model sizes (1.4 M, 4.7 M and 14 M parameters: sizes a small CPU steps in seconds), each on one
and on two processes. For each, `recipes/plan.py` sweeps one candidate (plain data parallel on one process, ZeRO-1
on two) at a smoke shape and then, with --verify, launches the emitted winner afresh for as many timed steps:
the prediction error is (predicted − observed) ÷ observed median step time. The wall time is the planner's
whole run (launches, data, micro-batch search, timing, verification) as the user waits for it. Last, a sweep of
the whole space of pythia-14m on one process (12 candidates) from an empty cache, timed. The load average is
printed beside the figures: the step times are only as steady as the machine. Results go to stdout and
runs/bench-plan/results.json. This is where the planner's accuracy is measured; the tests do not read the clock.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cram.plan.sweep import free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCH_CONFIGS = {1: "cpu.yaml", 2: "cpu-ddp.yaml"}
CANDIDATE = {1: "ddp", 2: "zero1"}


def run_plan(model: str, processes: int, args: argparse.Namespace, output_dir: Path) -> dict:
    accelerate = Path(sys.executable).with_name("accelerate")
    launch_config = REPO / "accel_configs" / LAUNCH_CONFIGS[processes]
    command = [str(accelerate), "launch", "-q", "--config_file", str(launch_config),
               "--main_process_port", str(free_port()), str(REPO / "recipes" / "plan.py"), "--model", model,
               "--seq-len", str(args.seq_len),
               "--global-batch-size", str(args.global_batch_size), "--memory-limit", args.memory_limit,
               "--candidates", CANDIDATE[processes], "--warmup-steps", "2", "--timed-steps", str(args.steps),
               "--verify", "--verify-steps", str(args.steps), "--output-dir", str(output_dir)]
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        return {"model": model, "processes": processes, "failed": completed.stderr.strip().splitlines()[-1:]}
    plan = json.loads((output_dir / "plan.json").read_text())
    verify, winner = plan["verify"], plan["rows"][0]
    return {"model": model, "processes": processes, "candidate": winner["candidate"],
            "micro_batch": winner["micro_batch"], "accumulation": winner["accumulation"],
            "predicted_s": verify["predicted_seconds"], "predicted_spread": winner["step_time"]["spread"],
            "observed_s": verify["observed_seconds"], "observed_spread": verify["observed"]["spread"],
            "error": verify["error"], "planner_wall_s": wall}


def full_sweep(model: str, args: argparse.Namespace, output_dir: Path) -> dict:
    """The whole space on one CPU process (12 candidates), from an empty cache: the wall time a user waits."""
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "-q", "--config_file", str(REPO / "accel_configs" / LAUNCH_CONFIGS[1]),
               str(REPO / "recipes" / "plan.py"), "--model", model, "--seq-len", str(args.seq_len),
               "--global-batch-size", str(args.global_batch_size), "--memory-limit", args.memory_limit,
               "--warmup-steps", "2", "--timed-steps", str(args.steps), "--output-dir", str(output_dir)]
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        return {"model": model, "failed": completed.stderr.strip().splitlines()[-1:]}
    rows = json.loads((output_dir / "plan.json").read_text())["rows"]
    paired = [row for row in rows if row.get("paired")]
    print(f"\nfull sweep of {model} on 1 process: {len(rows)} candidates, "
          f"{sum(row['source'] == 'measured' for row in rows)} launched "
          f"({sum(row['status'] == 'ok' for row in rows)} feasible), "
          f"{sum(row['source'] in ('rules', 'memory model') for row in rows)} infeasible without a launch, "
          f"{', '.join(row['candidate'] for row in paired) or 'none'} timed again side by side "
          f"({sum(row['paired']['rounds'] for row in paired)} launches); "
          f"wall time {wall:.0f} s; picked {rows[0]['candidate']} at {rows[0]['step_time']['median']:.3f} s/step"
          f"{' (a tie)' if rows[0].get('tie') else ''}, slowest feasible "
          f"{[row for row in rows if row['status'] == 'ok'][-1]['candidate']}; load average at the end: "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    return {"model": model, "candidates": len(rows), "side_by_side": [row["candidate"] for row in paired],
            "wall_s": wall, "load_average_end": os.getloadavg()[0],
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="crammed-bert-tiny,crammed-bert-small,pythia-14m",
                        help="Comma-separated model names.")
    parser.add_argument("--processes", default="1,2", help="Comma-separated CPU process counts (1 and/or 2).")
    parser.add_argument("--seq-len", type=int, default=128, help="Tokens per sequence.")
    parser.add_argument("--global-batch-size", type=int, default=8, help="Sequences per optimizer step.")
    parser.add_argument("--memory-limit", default="4GiB", help="Memory per process the search may use.")
    parser.add_argument("--steps", type=int, default=4, help="Timed steps, in the sweep and in the verification.")
    parser.add_argument("--output-dir", default="runs/bench-plan", help="Where the planner runs and results go.")
    parser.add_argument("--sweep-model", default="pythia-14m",
                        help="Model of the full-space sweep timed at the end ('' skips it).")
    args = parser.parse_args()
    output_dir = REPO / args.output_dir
    results = []
    print(f"load average at the start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| model | processes | candidate | micro-batch × accum. | predicted (s) | observed (s) | error | "
          "planner wall time (s) |\n|---|---|---|---|---|---|---|---|", flush=True)
    for model in filter(None, args.models.split(",")):
        for processes in (int(count) for count in args.processes.split(",")):
            row = run_plan(model, processes, args, output_dir / f"{model}-{processes}p")
            results.append(row)
            if "failed" in row:
                print(f"| {model} | {processes} | failed: {row['failed']} | | | | | |", flush=True)
                continue
            print(f"| {model} | {processes} | {row['candidate']} | {row['micro_batch']} × {row['accumulation']} "
                  f"| {row['predicted_s']:.3f} ± {row['predicted_spread']:.0%} "
                  f"| {row['observed_s']:.3f} ± {row['observed_spread']:.0%} | {row['error']:+.1%} "
                  f"| {row['planner_wall_s']:.0f} |", flush=True)
    errors = [abs(row["error"]) for row in results if "error" in row]
    if errors:
        print(f"mean |error| {sum(errors) / len(errors):.1%}, worst {max(errors):.1%}; "
              f"load average at the end: {os.getloadavg()[0]:.1f}")
    sweep = full_sweep(args.sweep_model, args, output_dir / "full-sweep") if args.sweep_model else None
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps({"prediction": results, "sweep": sweep}, indent=2) + "\n")


if __name__ == "__main__":
    main()
