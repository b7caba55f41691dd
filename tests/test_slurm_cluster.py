"""The test cluster's own guard (tests/slurm_cluster.py): its processes do not outlive the test process that started
them, even one killed by SIGKILL, which runs no cleanup."""

from __future__ import annotations

import launching
import psutil
from slurm_cluster import watchdog


def test_the_watchdog_kills_the_clusters_processes_once_the_watched_process_is_gone(tmp_path):
    conf = tmp_path / "slurm.conf"
    (tmp_path / "daemon.sh").write_text("sleep 601\n")  # a daemon's command line names the cluster's folder
    with launching.started(["sleep", "3"]) as watched, \
            launching.started(["sleep", "600"], env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}) as job, \
            launching.started(["sh", tmp_path / "daemon.sh"]) as daemon, \
            launching.started(["sleep", "602"]) as bystander, \
            launching.started(watchdog(tmp_path, conf, watched.pid)):
        launching.wait_until(lambda: watched.poll() is not None, seconds=30, what="the watched process's end")
        launching.wait_until(lambda: job.poll() is not None and daemon.poll() is not None, seconds=30,
                             what="the cluster's processes killed")
        assert bystander.poll() is None and psutil.pid_exists(bystander.pid)  # nothing else
