"""Slurm batch scripts for any recipe and Accelerate config: write one, and submit it with --submit.

    python -m cram.slurm --config accel_configs/2node.yaml --time-limit 48:00:00 --submit \\
        recipes/pythia.py --size pythia-1b --data pile/document --output-dir runs/pythia-1b-2node

The job asks for the config's machines as nodes and one Slurm task per training process (`--ntasks-per-node`, a GPU
and `--cpus-per-task` CPUs each; whole nodes for a CPU config), and srun starts each task as its rank through
`python -m cram.slurm_rank`, with no launcher between Slurm and the ranks. The ranks meet at the first node's
address as the other nodes resolve it, on a port derived from the job id, so two jobs sharing a node do not
collide. It carries `--resume auto`: every start continues from the newest complete state in the run folder, where
the job's output goes too.

Stopping: `grace` seconds before the time limit Slurm sends every training process SIGUSR1 (`--signal=USR1@grace`),
and a preemption sends them SIGTERM: they save their state and stop, and the script requeues the job. A plain
`scancel` (Slurm's SIGTERM to the batch shell as well) stops the job for good, and so does a failure: a job that
was not stopped by a notice is never requeued, so it cannot loop. One run folder trains in one job at a time
(`--dependency=singleton` on a name of the folder's, and a lock in it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml

from cram.errors import UserError, run_cli
from cram.train.checkpoint import STATE_FILE, STOP_RECORD, WRITE_SECONDS, complete_checkpoints
from cram.train.run_options import default_num_workers

# The grace before the time limit: the slowest measured state write, twice (a shared file system is slower on a
# busy day), plus the micro-batch in flight, which ends before the state is written, plus this margin for the
# processes to leave and the job to requeue itself.
GRACE_WRITES = 2
GRACE_MARGIN_SECONDS = 60
# With no state of the run written yet, the grace rests on this bound of one state write, which the job states in
# its script; each later start sizes the notice again from the writes measured by then.
UNMEASURED_WRITE_BOUND_SECONDS = 300
# The time limit's notice: a signal of its own, which nothing but Slurm's notice sends (a plain scancel sends SIGTERM).
NOTICE_SIGNAL = "USR1"
# Requeues in a row after starts that saved no newer state (a notice during the start-up, say), before the job ends.
NO_PROGRESS_REQUEUES = 2
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
        source = (f"a stated bound, as {run_dir} has no state written yet; each later start of the job sizes the "
                  "notice again from the writes measured by then")
    return notice_seconds(write, micro_batch, source)


def measured_grace_seconds(run_dir: str | Path) -> int | None:
    """The notice sized from the run's measured state writes; None before its first state."""
    if checkpoint_write_seconds(run_dir) is None:
        return None
    return grace_seconds(run_dir)[0]


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


def job_name(run_dir: str | Path) -> str:
    """The job's name: the run folder's, with a digest of its absolute path, so that `--dependency=singleton` holds
    back a second job of this run and no job of another run that shares the folder's name."""
    absolute = str(Path(run_dir).resolve())
    folder = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(absolute).name)
    return f"cram-{folder}-{hashlib.sha256(absolute.encode()).hexdigest()[:8]}"


def sbatch_path(path: str | Path, pattern: str = "") -> str:
    """A path (then `pattern`, a file name with sbatch's `%j` and friends) as an #SBATCH option's value: the path's
    own `%` doubled, and quoted for sbatch's word splitting."""
    text = str(path).replace("%", "%%") + pattern
    if any(character in text for character in ' \t"\\'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def cpus_per_process(layout: Layout, arguments: list[str]) -> int | None:
    """The CPUs each process asks for: the training process's own thread, its data loader's workers (the recipe's
    --num-workers, else its default on a GPU) and one more for the threads beside them (pinning memory, the
    compiler's workers at the start). None for a CPU config, which takes whole nodes and shares their CPUs."""
    if not layout.gpus:
        return None
    workers = default_num_workers("cuda")
    for index, argument in enumerate(arguments):
        given = None
        if argument in ("--num-workers", "--num_workers") and index + 1 < len(arguments):
            given = arguments[index + 1]
        elif argument.startswith(("--num-workers=", "--num_workers=")):
            given = argument.split("=", 1)[1]
        if given is not None and given.isdigit():  # anything else the recipe refuses in its own sentence
            workers = int(given)
    return workers + 2


def job_script(
    recipe: str, arguments: list[str], accelerate_config: str, *, time_limit: str | None, grace: int,
    grace_reason: str = "", grace_measured: bool = True, name: str | None = None, sbatch_options: list[str] = (),
    python: str | None = None, workdir: str | Path | None = None, cpus: int | None = None, memory: str | None = None,
    setup: list[str] = (),
) -> str:
    """The batch script that runs `recipe ARGUMENTS --resume auto` under `accelerate_config` on its nodes, one Slurm
    task per training process, with the notice `grace` seconds before `time_limit` (None: the partition's default
    limit). `grace_measured`: later starts size the notice again from the run's measured state writes. `cpus`: each
    process's CPUs (default `cpus_per_process`); `memory`: sbatch --mem; `setup`: shell lines run before the
    training (a `module load`, a virtual environment activated)."""
    layout = read_layout(accelerate_config)
    arguments = with_resume_auto(arguments)
    run_dir = recipe_output_dir(arguments)
    if time_limit is not None and grace >= time_limit_seconds(time_limit):
        raise UserError(f"--time-limit {time_limit} leaves no time to train before the {grace} s notice the state "
                        "write needs: give a longer limit.")
    if cpus is not None and cpus < 1:
        raise UserError(f"--cpus-per-process {cpus} is not a positive number of CPUs: give one, e.g. 8.")
    python = python or sys.executable
    workdir = Path(workdir or Path.cwd()).resolve()
    cpus = cpus if cpus is not None else cpus_per_process(layout, arguments)
    dependency = [option for option in sbatch_options if option.startswith("--dependency=")]
    directives = [
        f"--job-name={name or job_name(run_dir)}",
        f"--nodes={layout.nodes}",
        f"--ntasks-per-node={layout.processes_per_node}",
        f"--cpus-per-task={cpus}" if cpus is not None else "--exclusive",
        *([f"--gpus-per-node={layout.processes_per_node}"] if layout.gpus else []),
        *([f"--mem={memory}"] if memory else []),
        *([f"--time={time_limit}"] if time_limit is not None else []),
        "--requeue",
        f"--signal={NOTICE_SIGNAL}@{grace}",
        # One job of a run at a time: a second submission waits for the first to end.
        ",".join([*dependency[-1:], "singleton"]) if dependency else "--dependency=singleton",
        "--open-mode=append",
        f"--output={sbatch_path(run_dir, '/slurm-%j.out')}",
        f"--chdir={sbatch_path(workdir)}",
        *[option for option in sbatch_options if not option.startswith("--dependency=")],
    ]
    # Each task runs `python -m cram.slurm_rank` as its rank: the variables `accelerate launch` would set, then the
    # recipe, with no launcher between Slurm and the rank.
    task = " ".join(shlex.quote(part) for part in [
        "-m", "cram.slurm_rank", "--config_file", accelerate_config, "--num_machines", str(layout.nodes),
        "--num_processes", str(layout.processes)])
    task += ' --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" '
    task += " ".join(shlex.quote(part) for part in [recipe, *arguments])
    notice_signals = f"{signal.SIGUSR1:d} {signal.SIGTERM:d}"  # the time limit's notice, a preemption
    task_cpus = str(cpus) if cpus is not None else f'"$(( SLURM_CPUS_ON_NODE / {layout.processes_per_node} ))"'
    grace_comment = "".join(f"\n# {line}" for line in textwrap.wrap(
        f"The notice before the time limit: {grace_reason}.", 114)) if grace_reason else ""
    setup_lines = "\n".join(setup)
    return f"""#!/bin/bash
# {recipe} under {accelerate_config} on {layout.nodes} node(s) × {layout.processes_per_node} process(es), written by
# `python -m cram.slurm`; submit it with sbatch (or write and submit it with --submit).{grace_comment}
{chr(10).join(f"#SBATCH {directive}" for directive in directives)}
set -uo pipefail

RUN={shlex.quote(str(run_dir))}
PYTHON={shlex.quote(python)}
SUBMITTED_GRACE={grace}
STATE_FILE={STATE_FILE}
STARTED_AT=$(date +%s)
say() {{ echo "job $SLURM_JOB_ID: $*"; }}
echo "job $SLURM_JOB_ID, restart ${{SLURM_RESTART_COUNT:-0}}: {layout.nodes} node(s) ($SLURM_JOB_NODELIST)," \\
  "$SLURM_NTASKS_PER_NODE process(es) per node, $SLURM_CPUS_ON_NODE CPU(s) on the first"
{f"# The site's set-up, as given (--setup).{chr(10)}{setup_lines}{chr(10)}" if setup else ""}
# One job trains a run at a time: a second job of this run folder (another name, or started by hand) stops here.
exec 9>>"$RUN/.slurm-job.lock"
if command -v flock >/dev/null && ! flock --nonblock 9; then
  say "job $(cat "$RUN/.slurm-job.owner" 2>/dev/null) is training $RUN already: cancel one of the two, or give" \\
    "this one another --output-dir"
  exit 2
fi
echo "$SLURM_JOB_ID" > "$RUN/.slurm-job.owner"

newest_state() {{ ls -d "$RUN"/checkpoints/step-*/"$STATE_FILE" 2>/dev/null | sort | tail -n 1; }}
STATE_AT_START=$(newest_state)

# The first node's address as the other nodes reach it: Slurm's NodeAddr may be a name that resolves to loopback on
# the node itself (Debian's 127.0.1.1), so a second node resolves it; and a port of this job's own.
MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
NODE_ADDR=$(scontrol show node "$MAIN_NODE" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
if [ "$SLURM_JOB_NUM_NODES" -gt 1 ]; then
  PEER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 2p)
  MAIN_ADDR=$(srun --nodes=1 --ntasks=1 --overlap --nodelist="$PEER_NODE" getent ahostsv4 "$NODE_ADDR" 9>&- |
              awk 'NR == 1 {{ print $1 }}')
  if [ -z "$MAIN_ADDR" ]; then
    say "the first node's address ${{NODE_ADDR:-(none)}} does not resolve on $PEER_NODE: ask your cluster's" \\
      "administrators to set the nodes' NodeAddr in slurm.conf to addresses every node reaches"
    exit 2
  fi
else
  MAIN_ADDR=127.0.0.1
fi
MAIN_PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))
say "main process at $MAIN_ADDR:$MAIN_PORT ($MAIN_NODE, NodeAddr $NODE_ADDR)"

# Slurm sends the notice ({NOTICE_SIGNAL}) to every training process itself, $SUBMITTED_GRACE s before the time
# limit. Where the run's measured state writes now need a longer notice, this start sends it earlier itself.
send_notice() {{
  for attempt in 1 2 3 4 5; do
    if timeout 30 scancel --signal={NOTICE_SIGNAL} "$SLURM_JOB_ID" 9>&-; then
      say "notice ({NOTICE_SIGNAL}) sent to the training processes through Slurm (attempt $attempt)"
      return 0
    fi
    sleep 10
  done
  say "the notice ({NOTICE_SIGNAL}) could not be sent through Slurm in 5 attempts: Slurm's own follows" \\
    "$SUBMITTED_GRACE s before the limit"
}}
TIMER=
if {"true" if grace_measured else "false"}; then
  GRACE=$("$PYTHON" -c 'import sys; from cram.slurm import measured_grace_seconds as g; print(g(sys.argv[1]) or "")' \\
          "$RUN" 2>/dev/null 9>&-)
  END=$(squeue --noheader --jobs="$SLURM_JOB_ID" --format=%e 2>/dev/null 9>&-)
  END=$(date -d "$END" +%s 2>/dev/null)
  if [ -n "$GRACE" ] && [ -n "$END" ] && [ "$GRACE" -gt "$SUBMITTED_GRACE" ]; then
    say "the run's measured state writes need a notice of $GRACE s: sent $GRACE s before the time limit"
    {{ sleep $(( END - GRACE - $(date +%s) > 0 ? END - GRACE - $(date +%s) : 0 )) && send_notice; }} 9>&- &
    TIMER=$!
  fi
fi

# A SIGTERM here is Slurm ending the job (`scancel`, `scontrol requeue`, the time limit reached): the training
# processes get their own, and this script does not requeue the job.
ENDED_BY_SLURM=
trap 'ENDED_BY_SLURM=1; say "SIGTERM: Slurm is ending the job, which this script does not requeue"' TERM
srun --nodes={layout.nodes} --ntasks-per-node={layout.processes_per_node} --cpus-per-task={task_cpus} \\
  --kill-on-bad-exit=1 "$PYTHON" {task} 9>&- &
SRUN=$!
until wait "$SRUN"; ! kill -0 "$SRUN" 2>/dev/null; do :; done
wait "$SRUN"
STATUS=$?
[ -n "$TIMER" ] && kill "$TIMER" 2>/dev/null
[ "$STATUS" -eq 0 ] && exit 0
if [ -n "$ENDED_BY_SLURM" ]; then
  say "stopped by Slurm (status $STATUS): not requeued; $RUN keeps the newest state"
  exit "$STATUS"
fi

# Requeued only after the notice ({NOTICE_SIGNAL}) or a preemption (SIGTERM to the training processes alone), which the
# recipe records on stopping, never after a failure; a start that saved no newer state is requeued at most
# {NO_PROGRESS_REQUEUES} times in a row.
NEWEST=$(newest_state)
STOP_FILE="$RUN/checkpoints/{STOP_RECORD}"
STOP=$(sed -n 's/.*"signal": \\([0-9]*\\).*/\\1/p' "$STOP_FILE" 2>/dev/null)
STOPPED_AT=$(sed -n 's/.*"time": \\([0-9]*\\).*/\\1/p' "$STOP_FILE" 2>/dev/null)
NO_PROGRESS="$RUN/.slurm-requeues-without-progress"
if [ "${{STOPPED_AT:-0}}" -lt "$STARTED_AT" ] || [[ " {notice_signals} " != *" $STOP "* ]]; then
  say "the recipe exited with status $STATUS and was not stopped by a notice: not requeued"
  exit "$STATUS"
elif [ "$NEWEST" != "$STATE_AT_START" ]; then
  rm -f "$NO_PROGRESS"
  reason="stopped by signal $STOP with a newer state, $(dirname "$NEWEST")"
else
  COUNT=$(( $(cat "$NO_PROGRESS" 2>/dev/null || echo 0) + 1 ))
  if [ "$COUNT" -gt {NO_PROGRESS_REQUEUES} ]; then
    say "stopped by signal $STOP before any newer state, {NO_PROGRESS_REQUEUES + 1} starts in a row: not requeued;" \
      "resubmit it once the cause is found (its output is in $RUN)"
    rm -f "$NO_PROGRESS"
    exit "$STATUS"
  fi
  echo "$COUNT" > "$NO_PROGRESS"
  reason="stopped by signal $STOP before any newer state ($COUNT of {NO_PROGRESS_REQUEUES} such requeues)"
fi
for attempt in 1 2 3 4 5; do
  if answer=$(timeout 30 scontrol requeue "$SLURM_JOB_ID" 2>&1); then
    say "$reason: requeued to go on from it"
    exit 0
  fi
  sleep 10
done
say "$reason, but Slurm refused to requeue it ($answer): resubmit the script to go on"
exit 1
"""


def queued_jobs(name: str) -> list[str]:
    """The ids of this user's jobs named `name` still queued or running; empty where squeue cannot tell."""
    try:
        completed = subprocess.run(["squeue", "--noheader", "--me", f"--name={name}", "--format=%i"],
                                   capture_output=True, text=True, check=False, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    return completed.stdout.split() if completed.returncode == 0 else []


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
                        help="the notice before the time limit; unset: sized from the run's measured state writes, "
                             "again at every start of the job")
    parser.add_argument("--checkpoint-write-seconds", type=float, default=None,
                        help="a bound of one state write, for a run with no state written yet (default "
                             f"{UNMEASURED_WRITE_BOUND_SECONDS})")
    parser.add_argument("--cpus-per-process", type=int, default=None,
                        help="CPUs for each training process (sbatch --cpus-per-task); unset: its data loader's "
                             "workers + 2 on GPUs, whole nodes (--exclusive) for a CPU config")
    parser.add_argument("--memory", default=None,
                        help="memory per node (sbatch --mem), e.g. 200G; unset: the partition's default")
    parser.add_argument("--setup", action="append", default=[], metavar="LINE",
                        help="a shell line the job runs before training, e.g. --setup 'module load cuda/12.4' or "
                             "--setup 'source ~/venv/bin/activate' (repeat it)")
    parser.add_argument("--python", default=None,
                        help="the interpreter the training processes run; unset: this one. After a --setup that "
                             "activates an environment, give `python`")
    parser.add_argument("--job-name", default=None,
                        help="the job's name; unset: cram-FOLDER-DIGEST of the run folder (one job of a run at a "
                             "time waits on it, --dependency=singleton)")
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
    name = args.job_name or job_name(run_dir)
    text = job_script(args.recipe, args.arguments, args.config, time_limit=args.time_limit, grace=grace,
                      grace_reason=reason, grace_measured=args.grace_seconds is None, name=name,
                      sbatch_options=args.sbatch, python=args.python, cpus=args.cpus_per_process,
                      memory=args.memory, setup=args.setup)
    script = Path(args.script) if args.script else run_dir / "slurm-job.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)  # Slurm opens the job's output there, and creates no folder
    staging = script.with_name(script.name + ".tmp")
    staging.write_text(text)
    staging.replace(script)
    print(f"wrote {script}; notice before the time limit: {reason}")
    if args.submit:
        waiting_on = queued_jobs(name)
        job = submit(script)
        print(f"submitted job {job}; its output: {run_dir}/slurm-{job}.out")
        if waiting_on:
            print(f"job {', '.join(waiting_on)} of this run is queued or running already: job {job} waits for it to "
                  "end (--dependency=singleton), then goes on from its newest state")


if __name__ == "__main__":
    run_cli(main)
