"""The job scripts `python -m cram.slurm` writes, run under a real Slurm set up as academic clusters are
(tests/slurm_cluster.py: slurmctld and two slurmd on this machine, core-level allocation with CPU binding, two cores a
node, NodeAddr the nodes' hostnames, which resolve to 127.0.1.1 on each node itself and to 127.0.0.1 / 127.0.0.2
elsewhere).

The crammed BERT's tiny preset on 2 nodes × 1 CPU process (DDP over gloo), on a corpus nobody prepared beforehand:
- one job trains to the end untouched (the reference), its two nodes preparing the data at once in one shared cache;
  its ranks' CPUs, hostnames and host-group addresses are read off their processes;
- one job is stopped the three ways a cluster stops a job for it to go on (a preemption, the time limit's notice
  with a state write held past 30 s, `scontrol requeue`), comes back each time and reaches the reference's losses;
- one job on node-local caches is cancelled with a plain `scancel` and stays cancelled, while a second job of its run
  waits for it (singleton) and a third, under another name, is refused by the run's lock;
- one job has a bad argument.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import launching
import psutil
import pytest
from slurm_cluster import CPUS_PER_NODE, NODE_NAME_ADDRESS, NODES, SlurmCluster, hostname, slurm_cluster

from cram import slurm as cram_slurm
from cram.train.checkpoint import STOP_RECORD, complete_checkpoints

pytestmark = pytest.mark.launch

# A step per checkpoint, so each start of a stopped job has a newer state to requeue on; 16 steps, so each start
# trains a few before the next stop.
STEPS = 16
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
# How long the stopped job's ranks are held after the time limit's notice reached them, before they write their state:
# longer than torchrun's agent waits before it kills the ranks it passed a signal on to (30 s).
HELD_AFTER_NOTICE_SECONDS = 35
NOTICE_GRACE_SECONDS = 170  # the stopped job's notice: a time limit of 3 minutes sends it at once


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
def corpus(tmp_path_factory, english_texts) -> Path:
    """300 documents, as a file: every job finds it unprepared in its cache, so its nodes prepare it themselves."""
    path = tmp_path_factory.mktemp("corpus") / "documents.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in english_texts[:300]))
    return path


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory, recipe_env) -> dict[str, str]:
    """The jobs' environment with a data cache of their own that both nodes share (as on a cluster's shared disk)."""
    return {**recipe_env, "CRAM_CACHE": str(tmp_path_factory.mktemp("shared-cache"))}


def submit(slurm: SlurmCluster, folder: Path, env: dict[str, str], arguments: list[str],
           writer: list[str] = ("--grace-seconds", "30"), run_dir: Path | None = None) -> Job:
    """Write the job script with cram.slurm (in this process) and submit it with sbatch, which hands the job `env`
    (its data cache, one CPU thread per process). The job's programs run the cluster's PYTHON (its nodes' zygotes)."""
    config = folder / "two-nodes.yaml"
    config.write_text(TWO_NODES)
    run_dir = run_dir or folder / "run"
    script = folder / "slurm-job.sh"
    cram_slurm.main(["--config", str(config), *writer, "--python", str(slurm.python), "--script", str(script),
                     "recipes/cram.py", *arguments, "--output-dir", str(run_dir)])
    submitted = launching.run(["sbatch", "--parsable", script], cwd=launching.REPO, env={**env, **slurm.env},
                              timeout=60, check=True)
    return Job(submitted.stdout.strip().split(";")[0], run_dir)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for_end(slurm: SlurmCluster, job: Job, or_requeued: bool = False) -> dict[str, str]:
    """scontrol's fields of `job` once it ended (or, with `or_requeued`, was requeued: a loop would not end)."""

    def done() -> bool:
        fields = slurm.job(job.id)
        return fields["JobState"] in ENDED or (or_requeued and fields["Restarts"] != "0")

    launching.wait_until(done, seconds=JOB_SECONDS, interval=0.5,
                         what=f"the end of job {job.id}:\n{job.output()[-3000:]}")
    return slurm.job(job.id)


def rank_processes(slurm: SlurmCluster, run_dir: Path) -> list[psutil.Process]:
    """The processes the recipe's ranks of the run in `run_dir` run in: where a node's zygote forked one, the fork its
    stand-in names in the node's zygote folder; not the task that started it (`python -m cram.slurm_rank`)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if "recipes/cram.py" in command and str(run_dir) in command and "cram.slurm_rank" not in command:
            forks = list(slurm.folder.glob(f"zygotes-*/{process.pid}.program"))
            with contextlib.suppress(psutil.Error, OSError, ValueError):
                found.append(psutil.Process(int(forks[0].read_text())) if forks else process)
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
    listening: list[set[str]]  # each rank's listening addresses, once its host group was made
    hostnames: list[str]  # each rank's UTS namespace's hostname (its node's, where it runs inside it)
    cpus: list[list[int]]  # each rank's CPUs


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory, shared_cache, corpus) -> UninterruptedJob:
    job = submit(slurm, tmp_path_factory.mktemp("uninterrupted"), shared_cache, [*RUN, "--data", str(corpus)])
    listening: list[set[str]] = []
    hostnames: list[str] = []
    cpus: list[list[int]] = []

    def host_groups_made() -> bool:
        if job.output().count("host-side group of rank") < len(NODES):
            return False
        processes = rank_processes(slurm, job.run_dir)
        listening[:] = [listening_addresses(process) for process in processes]
        hostnames[:] = [uts_hostname(process) for process in processes]
        cpus[:] = [sorted(process.cpu_affinity()) for process in processes]
        return len(listening) == len(NODES)

    launching.wait_until(host_groups_made, seconds=JOB_SECONDS, interval=0.2,
                         what=f"both nodes' host groups of job {job.id}:\n{job.output()[-3000:]}")
    return UninterruptedJob(job, wait_for_end(slurm, job), listening, hostnames, cpus)


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in json.loads((run_dir / "summary.json").read_text())["history"]]


def test_the_written_script_trains_on_two_nodes_to_the_end_on_data_both_prepared(uninterrupted):
    job, fields = uninterrupted.job, uninterrupted.fields
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0" and fields["Restarts"] == "0", fields
    output = job.output()
    assert f"job {job.id}, restart 0: 2 node(s) (n[1-2]), 1 process(es) per node" in output, output
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == STEPS and len(summary["history"]) == STEPS
    assert (job.run_dir / "final" / "config.json").is_file()


def test_the_main_address_is_the_first_nodes_as_the_others_resolve_it_not_as_it_resolves_itself(slurm, uninterrupted):
    """NodeAddr is the first node's hostname, which resolves to 127.0.1.1 on that node and to 127.0.0.1 on the
    other: the job meets at 127.0.0.1, and each node's host-side group listens on 127.0.0.1, the address that routes
    to the main process, and no process listens on 127.0.1.1."""
    resolved = slurm.command("srun", "--nodes=2", "--ntasks-per-node=1", "sh", "-c",
                             f"echo $(hostname) $(getent hosts {hostname('n1')})").stdout.splitlines()
    assert sorted(resolved) == [f"cram-n1 {NODE_NAME_ADDRESS} cram-n1", f"cram-n2 {NODES['n1']} cram-n1"], resolved
    job = uninterrupted.job
    port = cram_slurm.PORT_BASE + int(job.id) % cram_slurm.PORT_SPAN
    output = job.output()
    assert f"job {job.id}: main process at {NODES['n1']}:{port} (n1, NodeAddr {hostname('n1')})" in output, output
    for rank in range(len(NODES)):
        assert f"host-side group of rank {rank} on lo ({NODES['n1']}), the interface that reaches the main " \
               f"process at {NODES['n1']}" in output.replace("on lo0", "on lo"), output
    assert len(uninterrupted.listening) == len(NODES)
    # Each rank runs in its node's namespaces (forked there by the node's zygote, or started there by slurmd).
    assert sorted(uninterrupted.hostnames) == [hostname(name) for name in NODES], uninterrupted.hostnames
    for addresses in uninterrupted.listening:
        assert NODES["n1"] in addresses and NODE_NAME_ADDRESS not in addresses, uninterrupted.listening


def test_each_rank_gets_the_cpus_the_job_asked_for(uninterrupted):
    """A CPU config asks for whole nodes: under core-level allocation with binding, a job that asks for nothing gets
    one core a node, to which every process and thread of the node is bound."""
    assert uninterrupted.cpus == [list(range(CPUS_PER_NODE))] * len(NODES), uninterrupted.cpus
    assert f"{CPUS_PER_NODE} CPU(s) on the first" in uninterrupted.job.output()


def newest_step(run_dir: Path) -> int:
    complete = complete_checkpoints(run_dir / "checkpoints")
    return int(complete[-1].name.removeprefix("step-")) if complete else 0


def hold_until_the_notice_arrives(slurm: SlurmCluster, job: Job) -> None:
    """Stop the job's ranks (SIGSTOP), bring its time limit close enough for Slurm to send the notice, and keep them
    stopped HELD_AFTER_NOTICE_SECONDS once the controller sent it before they go on: their state is then written
    more than 30 s after the notice. (A stopped process shows no pending signal in /proc, so the controller's log
    tells when it was sent.)"""
    ranks = rank_processes(slurm, job.run_dir)
    assert len(ranks) == len(NODES), ranks
    for rank in ranks:
        rank.send_signal(signal.SIGSTOP)
    try:
        slurm.command("scontrol", "update", f"JobId={job.id}", "TimeLimit=3")
        launching.wait_until(lambda: slurm.warned(job.id, signal.SIGUSR1), seconds=120, interval=0.5,
                             what=f"Slurm's notice to job {job.id}'s ranks:\n{job.output()[-3000:]}")
        time.sleep(HELD_AFTER_NOTICE_SECONDS)
    finally:
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.send_signal(signal.SIGCONT)


def test_a_stopped_job_comes_back_each_time_and_reaches_the_uninterrupted_losses(slurm, tmp_path_factory,
                                                                               shared_cache, uninterrupted, corpus):
    """Stopped after a newer state each time: by a preemption's SIGTERM to the job's steps (`scancel --signal=TERM`),
    which the ranks save on and the script requeues; by the time limit's notice, Slurm's own SIGUSR1 to the ranks, held
    past 30 s before the ranks write their state (a launcher's agent would have killed them by then), which the script
    requeues; and by `scontrol requeue`, which Slurm requeues itself. Each time the job comes back with the next
    SLURM_RESTART_COUNT, and the end reproduces the uninterrupted job's losses."""
    job = submit(slurm, tmp_path_factory.mktemp("stopped"), shared_cache, [*RUN, "--data", str(corpus)],
                 writer=("--grace-seconds", str(NOTICE_GRACE_SECONDS)))
    stops = {
        "preemption": lambda: slurm.command("scancel", "--signal=TERM", job.id),
        "notice": lambda: hold_until_the_notice_arrives(slurm, job),
        "requeue": lambda: slurm.command("scontrol", "requeue", job.id),
    }
    saved = 0
    for restart, (stop_name, stop) in enumerate(stops.items()):
        launching.wait_until(lambda saved=saved: newest_step(job.run_dir) > saved, seconds=JOB_SECONDS,
                             interval=0.1, what=f"a newer state of job {job.id}:\n{job.output()[-3000:]}")
        assert newest_step(job.run_dir) < STEPS, "the run ended before it could be stopped"
        assert f"restart {restart}:" in job.output()
        stop()
        launching.wait_until(lambda: slurm.job(job.id)["JobState"] == "PENDING", seconds=JOB_SECONDS, interval=0.5,
                             what=f"job {job.id} requeued after the {stop_name}:\n{job.output()[-3000:]}")
        if stop_name == "notice":
            slurm.command("scontrol", "update", f"JobId={job.id}", "TimeLimit=UNLIMITED")
            stop = json.loads((job.run_dir / "checkpoints" / STOP_RECORD).read_text())
            assert stop["signal"] == signal.SIGUSR1, stop
        slurm.start_now(job.id)
        saved = newest_step(job.run_dir)
    fields = wait_for_end(slurm, job)
    output = job.output()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == str(len(stops)), (fields, output[-3000:])
    assert f"restart {len(stops)}:" in output
    assert len(re.findall(r"stopped by signal 15 \(SIGTERM\) at step \d+", output)) == 2, output[-3000:]
    assert len(re.findall(r"stopped by signal 10 \(SIGUSR1\) at step \d+", output)) == 1, output[-3000:]
    # The script requeued it after the preemption and the notice; Slurm itself after `scontrol requeue`.
    assert output.count("requeued to go on from it") == 2, output[-3000:]
    assert output.count("SIGTERM: Slurm is ending the job") == 1, output[-3000:]
    assert losses(job.run_dir) == pytest.approx(losses(uninterrupted.job.run_dir), abs=1e-5)


def test_a_plain_scancel_stops_the_job_and_one_run_never_trains_in_two_jobs(slurm, tmp_path_factory, recipe_env,
                                                                           corpus):
    """On node-local caches, each node preparing the corpus for itself: a job of a long run is cancelled with a plain
    `scancel` once it saved a state, and ends CANCELLED, not requeued. A second submission of the run waits for it
    (`--dependency=singleton`) and then goes on from its state; a third, under a name of its own, finds the run's
    lock taken and ends with the sentence that says so."""
    folder = tmp_path_factory.mktemp("cancelled")
    local = {**recipe_env, "CRAM_CACHE": str(slurm.node_local / "cache")}
    arguments = [*RUN, "--max-steps", "100000", "--data", str(corpus)]
    one_cpu = ("--grace-seconds", "30", "--cpus-per-process", "1")  # a core a node left for the third job
    run_dir = folder / "run 50%"  # sbatch reads `%` in its file names, and splits its options at spaces
    first = submit(slurm, folder, local, arguments, writer=one_cpu, run_dir=run_dir)
    second = submit(slurm, folder, local, arguments, writer=one_cpu, run_dir=run_dir)
    launching.wait_until(lambda: newest_step(first.run_dir) > 0, seconds=JOB_SECONDS, interval=0.2,
                         what=f"a state of job {first.id}:\n{first.output()[-3000:]}")
    assert slurm.job(second.id)["JobState"] == "PENDING" and "Dependency" in slurm.job(second.id)["Reason"]
    third = submit(slurm, folder, local, arguments, writer=(*one_cpu, "--job-name", "another-name"),
                   run_dir=run_dir)
    refused = wait_for_end(slurm, third, or_requeued=True)
    assert refused["JobState"] == "FAILED" and refused["Restarts"] == "0", (refused, third.output())
    assert f"job {third.id}: job {first.id} is training {first.run_dir} already: cancel one of the two" in \
        third.output(), third.output()

    slurm.command("scancel", first.id)
    cancelled = wait_for_end(slurm, first, or_requeued=True)
    assert cancelled["JobState"] == "CANCELLED" and cancelled["Restarts"] == "0", (cancelled, first.output()[-3000:])
    launching.wait_until(lambda: "restart 0:" in second.output() and newest_step(first.run_dir) > 0 and
                         "resuming from" in second.output(), seconds=JOB_SECONDS, interval=0.2,
                         what=f"job {second.id} going on from job {first.id}'s state:\n{second.output()[-3000:]}")
    assert slurm.job(first.id)["JobState"] == "CANCELLED" and slurm.job(first.id)["Restarts"] == "0"
    assert "SIGTERM: Slurm is ending the job" in first.output() and "requeued to go on" not in first.output()
    slurm.command("scancel", second.id)
    assert wait_for_end(slurm, second, or_requeued=True)["JobState"] == "CANCELLED"
    # Each node prepared the corpus in its own cache, and the run's ranks found them the same.
    assert sorted(path.parent.name for path in slurm.folder.glob("node-local-*/cache")) == sorted(
        f"node-local-{name}" for name in NODES)


def test_a_bad_argument_fails_the_job_with_the_recipes_sentence_and_no_requeue(slurm, tmp_path_factory,
                                                                               recipe_env):
    job = submit(slurm, tmp_path_factory.mktemp("refused"), recipe_env, ["--preset", "tiny", "--max-steps", "0"])
    fields = wait_for_end(slurm, job, or_requeued=True)
    output = job.output()
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "0", (fields, output)
    assert output.count("error: --max-steps 0 is not a positive number of steps: give one, e.g. 1000.") == 1, output
    assert "was not stopped by a notice: not requeued" in output
    assert slurm.job(job.id)["JobState"] == "FAILED"

