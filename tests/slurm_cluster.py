"""A Slurm cluster of the tests' own on this machine, from Debian's packages (`apt-get install -y slurm-wlm munge`):
munged with a fresh key, slurmctld, and two slurmd (`slurmd -N n1`, `-N n2`), with their state, sockets and logs in a
folder of their own and ports of their own, set up as academic clusters are: core-level allocation
(`select/cons_tres`, `CR_Core`) with CPU binding (`task/affinity`), two cores a node, and nodes known by their
hostnames (NodeAddr `cram-n1`, `cram-n2`). Every daemon is started through tests/launching.py and killed when the
cluster is left, after its jobs are cancelled; a watchdog kills them too if the test's process is killed first.

Each daemon runs in a mount namespace of its own (`unshare`) with an /etc/hosts of its own: the controller's, and
every other node's, resolve `cram-n1` to 127.0.0.1 and `cram-n2` to 127.0.0.2; on each node (a UTS namespace too) its
own name resolves to 127.0.1.1, as a Debian or Ubuntu machine's does. The jobs a node starts inherit that. Each node
also has a folder of its own at one path (NODE_LOCAL: a node-local cache), and beside each slurmd runs a zygote of
its node (tests/zygote.py), started in the same namespaces, that forks its jobs' Python programs through the
interpreter at one path, PYTHON (docs/testing.md: Slurm).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
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
NODES = {"n1": "127.0.0.1", "n2": "127.0.0.2"}  # the address every other host reaches each node at
NODE_NAME_ADDRESS = "127.0.1.1"  # where each node's hostname resolves on the node itself (Debian's default)
CPUS_PER_NODE = 2
NODE_LOCAL = "node-local"  # a folder of the cluster's that is each node's own
PYTHON = "python"  # the cluster folder's interpreter: on each node, its zygote's stand-in (or this interpreter)
# Slurm's own seconds for a job's processes to end after SIGTERM before SIGKILL: room for a state write on a loaded
# machine.
KILL_WAIT_SECONDS = 60
COMMAND_SECONDS = 60  # a Slurm command that takes longer has lost its controller


def hostname(node: str) -> str:
    return f"cram-{node}"


@dataclass
class SlurmCluster:
    folder: Path
    env: dict[str, str]  # SLURM_CONF: what every Slurm command, and every job, needs; and TMPDIR (below)
    controller: int = 0  # slurmctld's pid: commands run in its namespace, where the nodes' names resolve

    @property
    def python(self) -> Path:
        """The interpreter a job's programs run: each node's zygote stand-in there, or this interpreter."""
        return self.folder / PYTHON

    @property
    def node_local(self) -> Path:
        return self.folder / NODE_LOCAL

    def command(self, *arguments: str, check: bool = True) -> subprocess.CompletedProcess:
        return launching.run(["nsenter", f"--mount=/proc/{self.controller}/ns/mnt", "--", *arguments], env=self.env,
                             timeout=COMMAND_SECONDS, check=check)

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

    def warned(self, job_id: str, number: int) -> bool:
        """Whether the controller has sent job `job_id` the warning signal `number` (its `--signal`), as its log at
        the debug level says (Slurm's send_job_warn_signal)."""
        log = (self.folder / "slurmctld.log").read_text(errors="replace")
        return f"send_job_warn_signal: warning signal {number} to JobId={job_id}" in log

    def nodes_idle(self) -> bool:
        states = self.command("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
        return sorted(line for line in states if line.strip()) == [f"{name} idle" for name in NODES]


def _config(folder: Path, munge_socket: Path) -> str:
    controller, node_ports = free_port(), {name: free_port() for name in NODES}
    nodes = "\n".join(f"NodeName={name} NodeAddr={hostname(name)} Port={node_ports[name]} CPUs={CPUS_PER_NODE} "
                      f"Boards=1 SocketsPerBoard=1 CoresPerSocket={CPUS_PER_NODE} ThreadsPerCore=1 State=UNKNOWN"
                      for name in NODES)
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
SlurmctldDebug=debug
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait={KILL_WAIT_SECONDS}
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _hosts(folder: Path, node: str | None) -> Path:
    """The /etc/hosts of `node` (None: the controller's): every node's name at the address the others reach it at,
    and the node's own at NODE_NAME_ADDRESS."""
    hosts = folder / f"hosts-{node or 'controller'}"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(
        f"{NODE_NAME_ADDRESS if name == node else address} {hostname(name)}\n" for name, address in NODES.items()))
    return hosts


def _node(name: str, folder: Path, conf: Path, zygotes: launching.Zygotes | None) -> list[str]:
    """slurmd for `name` in namespaces where the hostname `cram-<name>` resolves to NODE_NAME_ADDRESS, with a
    folder of the node's own at NODE_LOCAL. With `zygotes`, the node's own zygote beside it, serving until slurmd is
    gone, and the cluster's PYTHON its stand-in: a job's programs fork from it inside the node's namespaces, where one
    forked outside them would have the machine's hostname and /etc/hosts."""
    own = folder / f"{NODE_LOCAL}-{name}"
    own.mkdir()
    script = (f"mount --bind {_hosts(folder, name)} /etc/hosts && hostname {hostname(name)} && "
              f"mount --bind {own} {folder / NODE_LOCAL} && ")
    if zygotes is None:
        return ["unshare", "--mount", "--uts", "sh", "-c", script + f"exec slurmd -D -N {name} -f {conf}"]
    # "$@": the zygote's command, watching $$, which is slurmd's once the shell has exec'd it.
    script += (f"mount --bind {zygotes.folder / 'python'} {folder / PYTHON} && "
               f'{{ "$@" $$ < /dev/null > {zygotes.folder / "first.log"} 2>&1 & }} && '
               f"exec slurmd -D -N {name} -f {conf}")
    return ["unshare", "--mount", "--uts", "sh", "-c", script, "sh", *map(str, zygotes.zygote_command("first"))]


def watchdog(folder: Path, conf: Path, watched: int) -> list[str]:
    """A shell that, once the process `watched` is gone (a test worker killed by SIGKILL runs no cleanup), kills every
    process of the cluster: each daemon (the folder in its command line) and each job's process (the cluster's
    SLURM_CONF in its environment), twice, for what the first round's victims started meanwhile."""
    script = (f"while kill -0 {watched} 2>/dev/null; do sleep 1; done; for round in 1 2; do "
              "for process in /proc/[0-9]*; do pid=${process#/proc/}; [ \"$pid\" = $$ ] && continue; "
              f"if grep -qaF '{folder}' $process/cmdline 2>/dev/null || "
              f"grep -qaF 'SLURM_CONF={conf}' $process/environ 2>/dev/null; then kill -9 $pid 2>/dev/null; fi; "
              "done; sleep 1; done")
    return ["sh", "-c", script]


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
    (folder / NODE_LOCAL).mkdir()
    # Where no zygote serves a node, its programs start fresh with this interpreter. A file, not a link: a node's
    # stand-in is mounted over it, and a mount over a link lands on what the link names.
    cluster.python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    cluster.python.chmod(0o755)
    munged = ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge_socket}",
              f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log", f"--seed-file={folder}/munged.seed"]
    with contextlib.ExitStack() as daemons:
        daemons.enter_context(launching.started(watchdog(folder, conf, os.getpid())))
        daemons.enter_context(launching.started(munged))
        launching.wait_until(munge_socket.exists, seconds=COMMAND_SECONDS, what="munged's socket")
        controller = daemons.enter_context(launching.started(
            ["unshare", "--mount", "sh", "-c", f"mount --bind {_hosts(folder, None)} /etc/hosts && "
             f"exec slurmctld -D -i -f {conf}"], env=cluster.env))
        cluster.controller = controller.pid
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
