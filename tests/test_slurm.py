"""The job scripts `python -m cram.slurm` writes, run under a real Slurm (tests/slurm_cluster.py: slurmctld and two
slurmd on this machine, nodes n1 at 127.0.0.1 and n2 at 127.0.0.2, each node's name resolving to 127.0.1.1).

Three jobs of the crammed BERT's tiny preset on 2 nodes × 1 CPU process (DDP over gloo): one trains to the end
untouched (the reference, and the host group's interface is read off its processes); one is stopped four times
the ways a cluster stops a job, comes back each time and reaches the reference's losses; one has a bad argument.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import launching
import psutil
import pytest
from slurm_cluster import NODE_NAME_ADDRESS, NODES, SlurmCluster, slurm_cluster

from cram import slurm as cram_slurm
from cram.data import DataOptions, prepare
from cram.models.crammed_bert_recipe import crammed_bert_recipe
from cram.train.checkpoint import complete_checkpoints

pytestmark = pytest.mark.launch

# A step per checkpoint, so each start of a stopped job has a newer state to requeue on; 12 steps, so each start
# trains a few before the next stop.
STEPS = 12
RUN = ["--preset", "tiny", "--max-steps", str(STEPS), "--target-batch-size", "32", "--micro-batch-size", "8",
       "--precision", "fp32", "--log-every", "1", "--checkpoint-every", "1"]
TWO_NODES = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU  # with use_cpu: DDP over gloo, one CPU process per machine here
num_machines: 2
num_processes: 2
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: 29500
rdzv_backend: static
same_network: true
mixed_precision: 'no'
use_cpu: true
main_training_function: main
"""
JOB_SECONDS = 600


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> SlurmCluster:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@dataclass(frozen=True)
class Job:
    id: str
    run_dir: Path

    def output(self) -> str:
        path = self.run_dir / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, english_texts, recipe_env) -> Path:
    """300 documents, prepared here, in this process, into the session's data cache for the tiny preset, so every
    start of a job finds them prepared: each machine's first process prepares a set it does not find, and two
    preparations of one corpus do not give the same tokenizer, so two nodes preparing at once would train on two
    tokenizations."""
    path = tmp_path_factory.mktemp("corpus") / "documents.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in english_texts[:300]))
    config = crammed_bert_recipe("tiny").model_config()
    prepare(DataOptions(sources=[str(path)], vocab_size=config.vocab_size, seq_len=config.max_position_embeddings),
            cache_dir=recipe_env["CRAM_CACHE"], num_proc=1, progress=False)
    return path


def submit(slurm: SlurmCluster, folder: Path, recipe_env: dict[str, str], arguments: list[str]) -> Job:
    """Write the job script with cram.slurm (in this process) and submit it with sbatch, which hands the job this
    environment (the session's data cache, one CPU thread per process)."""
    config = folder / "two-nodes.yaml"
    config.write_text(TWO_NODES)
    run_dir = folder / "run"
    cram_slurm.main(["--config", str(config), "--grace-seconds", "30", "recipes/cram.py", *arguments,
                     "--output-dir", str(run_dir)])
    submitted = launching.run(["sbatch", "--parsable", run_dir / "slurm-job.sh"], cwd=launching.REPO,
                              env={**recipe_env, **slurm.env}, timeout=60, check=True)
    return Job(submitted.stdout.strip().split(";")[0], run_dir)


def wait_for_end(slurm: SlurmCluster, job: Job, or_requeued: bool = False) -> dict[str, str]:
    """scontrol's fields of `job` once it ended (or, with `or_requeued`, was requeued: a loop would not end)."""
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

    def done() -> bool:
        fields = slurm.job(job.id)
        return fields["JobState"] in ended or (or_requeued and fields["Restarts"] != "0")

    launching.wait_until(done, seconds=JOB_SECONDS, interval=0.5,
                         what=f"the end of job {job.id}:\n{job.output()[-3000:]}")
    return slurm.job(job.id)


def training_processes(run_dir: Path) -> list[psutil.Process]:
    """The recipe's processes of the run in `run_dir` (not their launchers): where a node's zygote forked one, the
    fork, not its stand-in (which has the command line)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if "recipes/cram.py" in command and str(run_dir) in command and "accelerate" not in command:
            with contextlib.suppress(psutil.Error):
                found.append(launching.program_of(process))
    return found


def uts_hostname(process: psutil.Process) -> str:
    """The hostname of `process`'s UTS namespace (`nsenter`, as the process itself would read it)."""
    return launching.run(["nsenter", f"--uts=/proc/{process.pid}/ns/uts", "hostname"], timeout=30).stdout.strip()


def listening_addresses(process: psutil.Process) -> set[str]:
    try:
        return {connection.laddr.ip for connection in process.net_connections("tcp")
                if connection.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        return set()


@dataclass(frozen=True)
class UninterruptedJob:
    job: Job
    fields: dict[str, str]  # scontrol's, once it ended
    listening: list[set[str]]  # each training process's listening addresses, once its host group was made
    hostnames: list[str]  # each training process's UTS namespace's hostname (its node's, where it runs inside it)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory, recipe_env, small_corpus) -> UninterruptedJob:
    job = submit(slurm, tmp_path_factory.mktemp("uninterrupted"), recipe_env, [*RUN, "--data", str(small_corpus)])
    listening: list[set[str]] = []
    hostnames: list[str] = []

    def host_groups_made() -> bool:
        if job.output().count("host-side group of rank") < len(NODES):
            return False
        processes = training_processes(job.run_dir)
        listening[:] = [listening_addresses(process) for process in processes]
        hostnames[:] = [uts_hostname(process) for process in processes]
        return len(listening) == len(NODES)

    launching.wait_until(host_groups_made, seconds=JOB_SECONDS, interval=0.2,
                         what=f"both nodes' host groups of job {job.id}:\n{job.output()[-3000:]}")
    return UninterruptedJob(job, wait_for_end(slurm, job), listening, hostnames)


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in json.loads((run_dir / "summary.json").read_text())["history"]]


def test_the_written_script_trains_on_two_nodes_to_the_end(uninterrupted):
    job, fields = uninterrupted.job, uninterrupted.fields
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0" and fields["Restarts"] == "0", fields
    output = job.output()
    port = cram_slurm.PORT_BASE + int(job.id) % cram_slurm.PORT_SPAN
    assert f"job {job.id}, restart 0: 2 node(s) (n[1-2]), main process at {NODES['n1']}:{port}" in output, output
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == STEPS and len(summary["history"]) == STEPS
    assert (job.run_dir / "final" / "config.json").is_file()


def test_the_host_group_listens_where_the_main_process_is_reached_not_where_the_name_resolves(
        slurm, uninterrupted):
    """On nodes whose name resolves to 127.0.1.1 (Debian's default), each node's host-side group listens on
    127.0.0.1, the address that routes to the main process at 127.0.0.1, and no process listens on 127.0.1.1."""
    resolved = slurm.command("srun", "--nodes=2", "--ntasks-per-node=1", "sh", "-c",
                             "getent hosts $(hostname)").stdout.split()
    assert resolved.count(NODE_NAME_ADDRESS) == len(NODES), resolved  # the premise: gloo by itself would take it
    output = uninterrupted.job.output()
    for rank in range(len(NODES)):
        assert f"host-side group of rank {rank} on lo ({NODES['n1']}), the interface that reaches the main " \
               f"process at {NODES['n1']}" in output.replace("on lo0", "on lo"), output
    assert len(uninterrupted.listening) == len(NODES)
    # Each rank runs in its node's namespaces (forked there by the node's zygote, or started there by slurmd).
    assert sorted(uninterrupted.hostnames) == [f"cram-{name}" for name in NODES], uninterrupted.hostnames
    for addresses in uninterrupted.listening:
        assert NODES["n1"] in addresses and NODE_NAME_ADDRESS not in addresses, uninterrupted.listening


def newest_step(run_dir: Path) -> int:
    complete = complete_checkpoints(run_dir / "checkpoints")
    return int(complete[-1].name.removeprefix("step-")) if complete else 0


def test_a_stopped_job_comes_back_each_time_and_reaches_the_uninterrupted_losses(slurm, tmp_path_factory,
                                                                               recipe_env, uninterrupted, small_corpus):
    """Stopped after a newer state each time: by `scontrol requeue` (the controller requeues it), by SIGTERM to the
    batch shell alone (what `--signal=B:TERM@grace` sends before the time limit; the shell passes it on to the job's
    steps, which is what a preemption's grace period sends them), and by `scancel --signal=TERM --full`, where srun
    answers its SIGTERM by killing the tasks, so the run goes on from the last periodic state. Each time the job
    comes back with the next SLURM_RESTART_COUNT, and the end reproduces the uninterrupted job's losses."""
    job = submit(slurm, tmp_path_factory.mktemp("stopped"), recipe_env, [*RUN, "--data", str(small_corpus)])
    stops = [
        ["scontrol", "requeue", job.id],
        ["scancel", "--batch", "--signal=TERM", job.id],
        ["scancel", "--full", "--signal=TERM", job.id],
    ]
    saved = 0
    for restart, stop in enumerate(stops):
        launching.wait_until(lambda saved=saved: newest_step(job.run_dir) > saved, seconds=JOB_SECONDS,
                             interval=0.1, what=f"a newer state of job {job.id}:\n{job.output()[-3000:]}")
        assert newest_step(job.run_dir) < STEPS, "the run ended before it could be stopped"
        assert f"restart {restart}:" in job.output()
        slurm.command(*stop)
        slurm.start_now(job.id)
        saved = newest_step(job.run_dir)
    fields = wait_for_end(slurm, job)
    output = job.output()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == str(len(stops)), (fields, output[-3000:])
    assert f"restart {len(stops)}:" in output
    # The recipe saved its state on the SIGTERM of the requeue and of the time limit's notice; the script requeued
    # the job after the notice and after --full.
    assert len(re.findall(r"stopped by signal 15 at step \d+", output)) >= 2, output[-3000:]
    assert output.count("requeued to go on from it") >= 2, output[-3000:]
    assert losses(job.run_dir) == pytest.approx(losses(uninterrupted.job.run_dir), abs=1e-5)


def test_a_bad_argument_fails_the_job_with_the_recipes_sentence_and_no_requeue(slurm, tmp_path_factory,
                                                                               recipe_env):
    job = submit(slurm, tmp_path_factory.mktemp("refused"), recipe_env, ["--preset", "tiny", "--max-steps", "0"])
    fields = wait_for_end(slurm, job, or_requeued=True)
    output = job.output()
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "0", (fields, output)
    assert output.count("error: --max-steps 0 is not a positive number of steps: give one, e.g. 1000.") == 1, output
    assert "saved no new state: not requeued" in output
    assert slurm.job(job.id)["JobState"] == "FAILED"
