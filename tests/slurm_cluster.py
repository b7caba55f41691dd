"""A Slurm cluster of the tests' own on this machine, from Debian's packages (`apt-get install -y slurm-wlm munge`):
munged with a fresh key, slurmctld, and two slurmd (`slurmd -N n1`, `-N n2`, NodeAddr 127.0.0.1 and 127.0.0.2), with
their state, sockets and logs in a folder of their own and ports of their own. Every daemon is started through
tests/launching.py and killed when the cluster is left, after its jobs are cancelled: nothing is left running.

Each slurmd runs in a mount and UTS namespace of its own (`unshare`), where the node's name resolves to 127.0.1.1,
as a Debian or Ubuntu machine's does: the jobs it starts inherit that, so a process that listened where its name
resolves would listen on loopback there. Beside each slurmd runs a zygote of its node (tests/zygote.py), started in
the same namespaces, that forks its jobs' launchers and ranks (docs/testing.md: Slurm).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import launching
import psutil
import pytest

from cram.plan.launch import free_port

INSTALL = "apt-get install -y slurm-wlm munge"
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "unshare",
            "nsenter")
NODES = {"n1": "127.0.0.1", "n2": "127.0.0.2"}
NODE_NAME_ADDRESS = "127.0.1.1"  # where each node's hostname resolves (Debian's default for the machine's name)
# Slurm's own seconds for a job's processes to end after SIGTERM before SIGKILL: room for a state write on a loaded
# machine.
KILL_WAIT_SECONDS = 60
COMMAND_SECONDS = 60  # a Slurm command that takes longer has lost its controller


@dataclass
class SlurmCluster:
    folder: Path
    env: dict[str, str]  # SLURM_CONF: what every Slurm command, and every job, needs; and TMPDIR (below)

    def command(self, *arguments: str, check: bool = True) -> subprocess.CompletedProcess:
        return launching.run(list(arguments), env=self.env, timeout=COMMAND_SECONDS, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields of a job (JobState, Restarts, ExitCode, …)."""
        line = self.command("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def start_now(self, job_id: str) -> None:
        """Start a requeued job as soon as its last start has left both nodes: Slurm holds a requeued batch job back
        about two minutes (BeginTime), and a start before a node has ended the last one's steps is refused there
        ("Job credential revoked") and fails the job."""

        def requeued_and_gone() -> bool:
            steps = [process for process in psutil.process_iter(["cmdline"])
                     if " ".join(process.info["cmdline"] or []).startswith(f"slurmstepd: [{job_id}.")]
            return self.job(job_id)["JobState"] == "PENDING" and not steps and self.nodes_idle()

        launching.wait_until(requeued_and_gone, seconds=KILL_WAIT_SECONDS + 60, interval=0.5,
                             what=f"job {job_id} back in the queue, its last start gone from the nodes")
        self.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def nodes_idle(self) -> bool:
        states = self.command("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
        return sorted(line for line in states if line.strip()) == [f"{name} idle" for name in NODES]


def _config(folder: Path, munge_socket: Path) -> str:
    controller, node_ports = free_port(), {name: free_port() for name in NODES}
    nodes = "\n".join(f"NodeName={name} NodeAddr={address} Port={node_ports[name]} CPUs=1 State=UNKNOWN"
                      for name, address in NODES.items())
    return f"""ClusterName=cramtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={controller}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait={KILL_WAIT_SECONDS}
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _node(name: str, folder: Path, conf: Path, zygotes: launching.Zygotes | None) -> list[str]:
    """slurmd for `name` in namespaces where the hostname `cram-<name>` resolves to NODE_NAME_ADDRESS. With
    `zygotes`, the node's own zygote beside it, serving until slurmd is gone, and Accelerate's `accelerate` there the
    stand-in's: a job's launcher and ranks fork from it inside the node's namespaces, where one forked outside them
    would have the machine's hostname and /etc/hosts."""
    hosts = folder / f"hosts-{name}"
    hosts.write_text(f"127.0.0.1 localhost\n{NODE_NAME_ADDRESS} cram-{name}\n")
    script = f"mount --bind {hosts} /etc/hosts && hostname cram-{name} && "
    if zygotes is None:
        return ["unshare", "--mount", "--uts", "sh", "-c", script + f"exec slurmd -D -N {name} -f {conf}"]
    # "$@": the zygote's command, watching $$, which is slurmd's once the shell has exec'd it.
    script += (f"mount --bind {zygotes.folder / 'accelerate'} {launching.ACCELERATE} && "
               f'{{ "$@" $$ < /dev/null > {zygotes.folder / "first.log"} 2>&1 & }} && '
               f"exec slurmd -D -N {name} -f {conf}")
    return ["unshare", "--mount", "--uts", "sh", "-c", script, "sh", *map(str, zygotes.zygote_command("first"))]


def _node_zygotes(folder: Path) -> launching.Zygotes | None:
    """The stand-in for a node's zygote, written in `folder` (launching.Zygotes); None where the tests start every
    program fresh."""
    if not launching.Zygotes.enabled():
        return None
    folder.mkdir()
    zygotes = launching.Zygotes()
    zygotes.write_shim(folder)
    return zygotes if zygotes.runnable() else None


@contextlib.contextmanager
def slurm_cluster(folder: Path) -> Iterator[SlurmCluster]:
    """A running cluster of two idle nodes; on leaving, its jobs cancelled and every daemon killed."""
    missing = [program for program in PROGRAMS if shutil.which(program) is None]
    if missing:
        pytest.fail(f"Slurm is not installed here ({', '.join(missing)} not found): the Slurm tests run a real "
                    f"scheduler; install it with `{INSTALL}` (as root).")
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests run slurmd and `unshare --mount`, which need root: run the suite as root, as CI "
                    "does.")
    folder.chmod(0o755)  # munged wants the folders above its socket searchable
    (folder / "state").mkdir()
    for name in NODES:
        (folder / f"spool-{name}").mkdir()
    key, munge_socket, conf = folder / "munge.key", folder / "munge.socket", folder / "slurm.conf"
    launching.run(["mungekey", "--create", f"--keyfile={key}"], check=True, timeout=COMMAND_SECONDS)
    conf.write_text(_config(folder, munge_socket))
    # TMPDIR: what Slurm gives a job that has none, which the nodes' zygotes import under as well (tempfile keeps it).
    cluster = SlurmCluster(folder, {**os.environ, "SLURM_CONF": str(conf), "TMPDIR": tempfile.gettempdir()})
    munged = ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge_socket}",
              f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log", f"--seed-file={folder}/munged.seed"]
    with contextlib.ExitStack() as daemons:
        daemons.enter_context(launching.started(munged))
        launching.wait_until(munge_socket.exists, seconds=COMMAND_SECONDS, what="munged's socket")
        daemons.enter_context(launching.started(["slurmctld", "-D", "-i", "-f", conf], env=cluster.env))
        zygotes = {name: _node_zygotes(folder / f"zygotes-{name}") for name in NODES}
        for name in NODES:
            daemons.enter_context(launching.started(_node(name, folder, conf, zygotes[name]), env=cluster.env))
        launching.wait_until(cluster.nodes_idle, seconds=COMMAND_SECONDS, interval=0.5, what="two idle Slurm nodes")
        for node_zygotes in zygotes.values():
            if node_zygotes is not None:
                node_zygotes.serve_first(cluster.env)
        try:
            yield cluster
        finally:
            cluster.command("scancel", "--full", "--signal=KILL", "--user=root", check=False)
            cluster.command("scancel", "--user=root", check=False)
            launching.wait_until(lambda: not cluster.command("squeue", "-h", check=False).stdout.strip(),
                                 seconds=KILL_WAIT_SECONDS + 60, interval=0.5, what="no job left in the queue")
