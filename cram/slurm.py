"""Slurm batch scripts for any recipe and Accelerate config: write one, and submit it with --submit.

    python -m cram.slurm --config accel_configs/2node.yaml --time-limit 48:00:00 --submit \\
        recipes/pythia.py --size pythia-1b --data pile/document --output-dir runs/pythia-1b-2node

The job asks for the config's machines as nodes (`num_machines`) and its processes per machine as GPUs per node,
runs one `accelerate launch` per node through `srun` with the node's rank, and meets at the first node's address as
Slurm gives it (`scontrol show node`: node names need not resolve) on a port derived from the job id, so two jobs
sharing a node do not collide. It carries `--resume auto`: every start continues from the newest complete state in
the run folder, where the job's output goes too. Before the time limit, Slurm signals the batch shell `grace`
seconds early (`--signal=B:TERM@grace`); the shell passes SIGTERM to the training processes, which save their state
and stop, and the job requeues itself. A job that ends without saving a newer state (a refused argument, a crash
before any checkpoint) is not requeued, so it cannot loop.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml

from cram.errors import UserError, run_cli
from cram.train.checkpoint import STATE_FILE, WRITE_SECONDS, complete_checkpoints

# The grace before the time limit: the slowest measured state write, twice (a shared file system is slower on a
# busy day), plus the micro-batch in flight, which ends before the state is written, plus this margin for the
# processes to leave and the job to requeue itself.
GRACE_WRITES = 2
GRACE_MARGIN_SECONDS = 60
# With no state of the run written yet, the grace rests on this bound of one state write, which the job states in
# its script: write the script again after the first checkpoint to size it from the measured write.
UNMEASURED_WRITE_BOUND_SECONDS = 300
# The main process's port: PORT_BASE + the job id modulo PORT_SPAN, so jobs on one node collide only when their ids
# are a multiple of PORT_SPAN apart; above the well-known ports and below Linux's ephemeral range (32768-60999).
PORT_BASE = 12000
PORT_SPAN = 20000


@dataclass(frozen=True)
class Layout:
    """What an Accelerate config asks of the cluster."""

    nodes: int
    processes: int  # in all
    gpus: bool  # whether each process takes a GPU (False: `use_cpu`)

    @property
    def processes_per_node(self) -> int:
        return self.processes // self.nodes


def read_layout(config: str | Path) -> Layout:
    """Nodes, processes and devices from an Accelerate launch config."""
    path = Path(config)
    if not path.is_file():
        raise UserError(f"the Accelerate config {path} does not exist: give one of accel_configs/*.yaml, or your own.")
    values = yaml.safe_load(path.read_text()) or {}
    nodes, processes = int(values.get("num_machines", 1)), int(values.get("num_processes", 1))
    if nodes < 1 or processes < nodes or processes % nodes:
        raise UserError(f"{path} asks for {processes} processes on {nodes} machines, which do not split evenly: set "
                        "num_processes to a multiple of num_machines (num_processes counts every machine's).")
    return Layout(nodes, processes, gpus=not values.get("use_cpu", False))


def recipe_output_dir(arguments: list[str]) -> Path:
    """The run folder the recipe's arguments name (`--output-dir`): the job's output and states live there."""
    for index, argument in enumerate(arguments):
        if argument in ("--output-dir", "--output_dir") and index + 1 < len(arguments):
            return Path(arguments[index + 1])
        if argument.startswith(("--output-dir=", "--output_dir=")):
            return Path(argument.split("=", 1)[1])
    raise UserError("the recipe's arguments name no --output-dir: give one, e.g. --output-dir runs/pythia-1b; the "
                    "job resumes from the states there and writes its output there.")


def with_resume_auto(arguments: list[str]) -> list[str]:
    """The recipe's arguments with `--resume auto`, which every start of a requeued job needs."""
    for index, argument in enumerate(arguments):
        value = None
        if argument == "--resume" and index + 1 < len(arguments):
            value = arguments[index + 1]
        elif argument.startswith("--resume="):
            value = argument.split("=", 1)[1]
        if value is not None:
            if value != "auto":
                raise UserError(f"the recipe's arguments say --resume {value}: a requeued job must continue where it "
                                "stopped, so leave --resume out (the job passes --resume auto).")
            return list(arguments)
    return [*arguments, "--resume", "auto"]


def checkpoint_write_seconds(run_dir: str | Path) -> float | None:
    """The slowest training-state write among the run's complete checkpoints; None if none recorded one."""
    measured = []
    for checkpoint in complete_checkpoints(Path(run_dir) / "checkpoints"):
        seconds = json.loads((checkpoint / STATE_FILE).read_text()).get(WRITE_SECONDS)
        if seconds is not None:
            measured.append(float(seconds))
    return max(measured) if measured else None


def micro_batch_seconds(run_dir: str | Path) -> float | None:
    """The slowest micro-batch the run's newest state logged (its step time where no pace was logged)."""
    checkpoints = complete_checkpoints(Path(run_dir) / "checkpoints")
    if not checkpoints:
        return None
    record = json.loads((checkpoints[-1] / STATE_FILE).read_text())["state"]
    paces = [row["seconds_per_micro_batch"] for row in record.get("history", []) if row.get("seconds_per_micro_batch")]
    if paces:
        return max(paces)
    return record["elapsed"] / record["optimizer_steps"] if record.get("optimizer_steps") else None


def grace_seconds(run_dir: str | Path, write_bound: float | None = None) -> tuple[int, str]:
    """(seconds, how they were sized): the notice before the time limit that lets every process finish its
    micro-batch, write the state and leave. From the run's measured writes where it has states; else from
    `write_bound` (or UNMEASURED_WRITE_BOUND_SECONDS), a stated bound of one write."""
    measured = checkpoint_write_seconds(run_dir)
    micro_batch = micro_batch_seconds(run_dir) or 0.0
    if measured is not None:
        write, source = measured, f"the slowest measured in {run_dir}"
    else:
        write = UNMEASURED_WRITE_BOUND_SECONDS if write_bound is None else write_bound
        source = (f"a stated bound, as {run_dir} has no state written yet: write the script again after its first "
                  "checkpoint to size the notice from the measured write")
    return notice_seconds(write, micro_batch, source)


def notice_seconds(write_seconds: float, micro_batch_seconds: float, source: str) -> tuple[int, str]:
    """(seconds, how they were sized): the notice for a state write of `write_seconds` (measured or bounded, as
    `source` says) after a micro-batch of `micro_batch_seconds`."""
    seconds = math.ceil(GRACE_WRITES * write_seconds + micro_batch_seconds + GRACE_MARGIN_SECONDS)
    return seconds, (f"{seconds} s = {GRACE_WRITES} state writes of {write_seconds:.1f} s ({source}) + "
                     f"{micro_batch_seconds:.1f} s for the micro-batch in flight + {GRACE_MARGIN_SECONDS} s to leave "
                     "and requeue")


def slurm_time(seconds: float) -> str:
    """A time limit in Slurm's D-HH:MM:SS, rounded up to the minute."""
    minutes = math.ceil(seconds / 60)
    return f"{minutes // 1440}-{minutes // 60 % 24:02d}:{minutes % 60:02d}:00"


def requeued_jobs(run_seconds: float, cluster_limit_seconds: float, grace: int,
                  start_seconds: float) -> tuple[int, int]:
    """(the time limit each job asks for, how many jobs the run takes): a run of `run_seconds` of training, each job
    paying `start_seconds` to start and resume and `grace` to save before its limit, under the longest limit the
    cluster allows. One job asks for no more than the whole run needs."""
    trains = cluster_limit_seconds - grace - start_seconds
    if trains <= 0:
        raise UserError(f"a time limit of {slurm_time(cluster_limit_seconds)} leaves no time to train after "
                        f"{start_seconds:.0f} s to start and the {grace} s notice the state write needs: give a "
                        "longer --time-limit.")
    jobs = max(1, math.ceil(run_seconds / trains))
    limit = min(cluster_limit_seconds, math.ceil(run_seconds / jobs + grace + start_seconds))
    return limit, jobs


_TIME_LIMIT = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_seconds(limit: str) -> int:
    """Seconds in a Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    found = _TIME_LIMIT.match(limit)
    if found is None:
        raise UserError(f"--time-limit {limit} is not a Slurm time limit: give e.g. 48:00:00, 2-00:00:00 or 90 "
                        "(minutes).")
    days, first, second, third = found.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + int(first) * 3600 + int(second or 0) * 60 + int(third or 0)
    if third is not None:  # HH:MM:SS
        return int(first) * 3600 + int(second) * 60 + int(third)
    if second is not None:  # MM:SS
        return int(first) * 60 + int(second)
    return int(first) * 60


def job_script(
    recipe: str, arguments: list[str], accelerate_config: str, *, time_limit: str | None, grace: int,
    grace_reason: str = "", job_name: str | None = None, sbatch_options: list[str] = (),
    accelerate: str | None = None, workdir: str | Path | None = None,
) -> str:
    """The batch script that runs `recipe ARGUMENTS --resume auto` under `accelerate_config` on its nodes, with the
    notice `grace` seconds before `time_limit` (None: the partition's default limit)."""
    layout = read_layout(accelerate_config)
    arguments = with_resume_auto(arguments)
    run_dir = recipe_output_dir(arguments)
    if time_limit is not None and grace >= time_limit_seconds(time_limit):
        raise UserError(f"--time-limit {time_limit} leaves no time to train before the {grace} s notice the state "
                        "write needs: give a longer limit.")
    accelerate = accelerate or str(Path(sys.executable).with_name("accelerate"))
    workdir = Path(workdir or Path.cwd()).resolve()
    name = job_name or Path(run_dir).name
    directives = [
        f"--job-name={name}",
        f"--nodes={layout.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={layout.processes_per_node}"] if layout.gpus else []),
        *([f"--time={time_limit}"] if time_limit is not None else []),
        "--requeue",
        f"--signal=B:TERM@{grace}",
        "--open-mode=append",
        f"--output={run_dir}/slurm-%j.out",
        f"--chdir={workdir}",
        *sbatch_options,
    ]
    # `bash -c` runs on each node, where $SLURM_NODEID is that node's rank; the rest is this shell's words.
    launch = " ".join(shlex.quote(part) for part in [
        accelerate, "--config_file", accelerate_config, "--num_machines", str(layout.nodes),
        "--num_processes", str(layout.processes)])
    launch += ' --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" '
    launch += " ".join(shlex.quote(part) for part in [recipe, *arguments])
    quoted_run = shlex.quote(str(run_dir))
    grace_comment = "".join(f"\n# {line}" for line in textwrap.wrap(
        f"The notice before the time limit: {grace_reason}.", 114)) if grace_reason else ""
    return f"""#!/bin/bash
# {recipe} under {accelerate_config} on {layout.nodes} node(s) × {layout.processes_per_node} process(es), written by
# `python -m cram.slurm`; submit it with sbatch (or write and submit it with --submit).{grace_comment}
{chr(10).join(f"#SBATCH {directive}" for directive in directives)}
set -uo pipefail

RUN={quoted_run}
newest_state() {{ ls -d "$RUN"/checkpoints/step-*/{STATE_FILE} 2>/dev/null | sort | tail -n 1; }}
STATE_AT_START=$(newest_state)
# The first node's address as Slurm has it (node names need not resolve), and a port of this job's own.
MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_ADDR=$(scontrol show node "$MAIN_NODE" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
MAIN_PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))
echo "job $SLURM_JOB_ID, restart ${{SLURM_RESTART_COUNT:-0}}: {layout.nodes} node(s) ($SLURM_JOB_NODELIST)," \\
  "main process at $MAIN_ADDR:$MAIN_PORT"

# torchrun's agent on each node passes the SIGTERM to its processes and kills them this many seconds later (30 by
# default): the notice's length, so they have the time to write the state.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace}
srun --nodes={layout.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\
  bash -c 'exec "$0" launch --machine_rank "$SLURM_NODEID" "$@"' \\
  {launch} &
SRUN=$!
# The time limit's notice reaches this shell alone (--signal=B:...). Pass SIGTERM to the training processes, not to
# srun, which answers a SIGTERM by killing its tasks: `scancel --signal` without --full signals the job's steps only.
# At most 5 s: where the job is ending already (`scontrol requeue` signals this shell too), scancel is told "Job can
# not be altered now" and retries for a minute, which would hold the job's end and its requeue as long. Never in the
# background: a scancel still retrying when the job comes back would stop its next start.
trap 'echo "job $SLURM_JOB_ID: SIGTERM, passed to the training processes"
      timeout 5 scancel --signal=TERM "$SLURM_JOB_ID"' TERM
until wait "$SRUN"; ! kill -0 "$SRUN" 2>/dev/null; do :; done
wait "$SRUN"
STATUS=$?
if [ "$STATUS" -eq 0 ]; then
  exit 0
fi
# Requeue only after progress: a newer state saved by this start (a stop on a signal, or periodic states before a
# failure). A refused argument or a crash before any state ends the job with the recipe's status, never a loop.
if [ "$(newest_state)" != "$STATE_AT_START" ]; then
  echo "job $SLURM_JOB_ID: stopped (status $STATUS) with a newer state," \\
    "$(dirname "$(newest_state)"): requeued to go on from it"
  scontrol requeue "$SLURM_JOB_ID" || echo "job $SLURM_JOB_ID: Slurm is requeuing it already"
  exit 0
fi
echo "job $SLURM_JOB_ID: the recipe exited with status $STATUS and saved no new state: not requeued"
exit "$STATUS"
"""


def submit(script: Path) -> str:
    """Submit `script` with sbatch; the job id."""
    try:
        completed = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False)
    except FileNotFoundError as error:
        raise UserError("sbatch is not on this machine's PATH: run this on the cluster's login node, or write the "
                        "script without --submit and submit it there.") from error
    if completed.returncode != 0:
        raise UserError(f"sbatch refused {script}: {completed.stderr.strip() or completed.stdout.strip()}")
    return completed.stdout.strip().split(";")[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cram.slurm", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="accel_configs/1gpu.yaml",
                        help="the Accelerate launch config: its num_machines are the nodes, its num_processes the "
                             "processes in all (one GPU each unless use_cpu)")
    parser.add_argument("--time-limit", default=None,
                        help="the job's time limit (sbatch --time), e.g. 48:00:00; unset: the partition's default. "
                             "A run longer than it continues in requeued jobs")
    parser.add_argument("--grace-seconds", type=int, default=None,
                        help="the notice before the time limit; unset: sized from the run's measured state writes")
    parser.add_argument("--checkpoint-write-seconds", type=float, default=None,
                        help="a bound of one state write, for a run with no state written yet (default "
                             f"{UNMEASURED_WRITE_BOUND_SECONDS})")
    parser.add_argument("--job-name", default=None, help="the job's name; unset: the run folder's")
    parser.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                        help="one more #SBATCH line, e.g. --sbatch=--partition=gpu or --sbatch=--account=lab "
                             "(repeat it)")
    parser.add_argument("--script", default=None,
                        help="where to write the script; unset: OUTPUT_DIR/slurm-job.sh")
    parser.add_argument("--submit", action="store_true", help="submit the script with sbatch once written")
    parser.add_argument("recipe", help="the recipe to run, e.g. recipes/pythia.py")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="the recipe's arguments, --output-dir among them")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not Path(args.recipe).is_file():
        raise UserError(f"the recipe {args.recipe} does not exist: give a script of recipes/, e.g. recipes/cram.py.")
    run_dir = recipe_output_dir(args.arguments)
    if args.grace_seconds is not None:
        grace, reason = args.grace_seconds, f"{args.grace_seconds} s, as given (--grace-seconds)"
    else:
        grace, reason = grace_seconds(run_dir, args.checkpoint_write_seconds)
    text = job_script(args.recipe, args.arguments, args.config, time_limit=args.time_limit, grace=grace,
                      grace_reason=reason, job_name=args.job_name, sbatch_options=args.sbatch)
    script = Path(args.script) if args.script else run_dir / "slurm-job.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)  # Slurm opens the job's output there, and creates no folder
    staging = script.with_name(script.name + ".tmp")
    staging.write_text(text)
    staging.replace(script)
    print(f"wrote {script}; notice before the time limit: {reason}")
    if args.submit:
        job = submit(script)
        print(f"submitted job {job}; its output: {run_dir}/slurm-{job}.out")


if __name__ == "__main__":
    run_cli(main)
