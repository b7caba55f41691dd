"""`python -m cram.slurm_rank`, in this process: the environment a Slurm task gives the recipe it runs as a rank
(tests/test_slurm.py runs it under a real Slurm, as the job scripts start it)."""

from __future__ import annotations

import os
import socket

import pytest
from launching import REPO

from cram import slurm_rank
from cram.errors import UserError

PLACE = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1", "SLURM_NNODES": "2"}


def test_a_task_becomes_the_rank_torchrun_would_have_started_in_its_place():
    environment = slurm_rank.rank_environment({"PATH": "/bin"}, slurm_rank.slurm_place(PLACE), "10.0.0.1", 12345)
    assert {name: environment[name] for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                 "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "12345"}
    assert environment["OMP_NUM_THREADS"] == "1" and environment["PATH"] == "/bin"  # as torchrun, two to a node
    mine = slurm_rank.rank_environment({"OMP_NUM_THREADS": "6"}, slurm_rank.slurm_place(PLACE), "10.0.0.1", 1)
    assert mine["OMP_NUM_THREADS"] == "6"


def test_outside_a_slurm_task_and_on_uneven_nodes_it_refuses_in_one_sentence():
    with pytest.raises(UserError, match=r"^SLURM_PROCID, SLURM_LOCALID, .* not set: .*\(the job scripts .*\)\.$"):
        slurm_rank.slurm_place({"SLURM_NTASKS": "2"})
    uneven = slurm_rank.slurm_place({**PLACE, "SLURM_NTASKS": "3"})
    with pytest.raises(UserError, match=r"^srun started 3 tasks on 2 nodes, which do not split evenly: .*\.$"):
        slurm_rank.rank_environment({}, uneven, "10.0.0.1", 1)


@pytest.mark.parametrize(("config", "expected"), [
    ("cpu-zero1.yaml", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero1.json",
                        "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file,zero3_init_flag"}),
    ("4gpu-fsdp.yaml", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}),
    ("cpu-ddp.yaml", {"ACCELERATE_MIXED_PRECISION": "no"}),
])
def test_the_launch_configs_settings_reach_the_rank_as_accelerate_launch_sets_them(monkeypatch, config, expected):
    monkeypatch.chdir(REPO)
    environment, script, arguments, address, port = slurm_rank.launch_environment(
        ["--config_file", f"accel_configs/{config}", "--num_machines", "2", "--machine_rank", "0",
         "--main_process_ip", "10.0.0.1", "--main_process_port", "12345", "recipes/cram.py", "--preset", "tiny"])
    assert {name: environment.get(name) for name in expected} == expected
    assert (script, arguments, address, port) == ("recipes/cram.py", ["--preset", "tiny"], "10.0.0.1", 12345)


def test_a_main_port_taken_on_the_main_node_is_no_error_there(monkeypatch):
    """Several tasks of the main node compute their environment as the main rank binds the port: Accelerate's
    launchers would refuse a port in use on the main machine, which under one task per rank is the main rank's own."""
    monkeypatch.chdir(REPO)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for config in ("cpu-ddp.yaml", "cpu-zero1.yaml"):
            environment = slurm_rank.launch_environment(
                ["--config_file", f"accel_configs/{config}", "--num_machines", "2", "--num_processes", "2",
                 "--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                 "recipes/cram.py"])[0]
            assert "ACCELERATE_MIXED_PRECISION" in environment


def test_a_task_bound_to_cpus_of_its_own_trains_on_all_of_them():
    cpus = len(os.sched_getaffinity(0))
    assert slurm_rank.bound_cpus({"SLURM_CPUS_PER_TASK": str(cpus)}) == cpus
    assert slurm_rank.bound_cpus({"SLURM_CPUS_PER_TASK": str(cpus + 1)}) is None  # not bound: shared with the node
    assert slurm_rank.bound_cpus({}) is None
