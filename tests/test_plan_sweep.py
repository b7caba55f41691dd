"""Sweeps that survive failure: one rank out of memory, a hung launch and Ctrl-C, a stale build lock, every form of
out-of-memory, and a cache that forgets failures when the libraries change or when asked."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from cram.errors import UserError
from cram.plan import sweep as sweep_module
from cram.plan.memory import Shape
from cram.plan.models import model_config
from cram.plan.probe import CandidateRun, is_out_of_memory
from cram.plan.space import Candidate
from cram.plan.sweep import Setting, build_offload_optimizer, run_launch, search_and_time, sweep

REPO = Path(__file__).resolve().parents[1]
# A launcher that starts its worker in a session of its own, as torchrun does, then waits on it.
TREE = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write(str(worker.pid))
worker.wait()
"""


def start_tree_and_wait_for_worker(tmp_path: Path, timeout: float) -> tuple[int | None, int]:
    pid_file = tmp_path / "worker.pid"
    returncode = run_launch([sys.executable, "-c", TREE, str(pid_file)], tmp_path / "tree.log", timeout)
    return returncode, int(pid_file.read_text())


def test_a_timed_out_launch_leaves_no_process_behind(tmp_path):
    returncode, worker = start_tree_and_wait_for_worker(tmp_path, timeout=5)
    assert returncode is None
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


def test_ctrl_c_during_a_launch_ends_its_whole_process_tree(tmp_path):
    # Python's own Ctrl-C handler, as in a fresh `recipes/plan.py`: an earlier in-process test of the session may
    # have left another (the full suite once ran this test with SIGINT caught, and no KeyboardInterrupt came).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    pid_file = tmp_path / "worker.pid"
    # Ctrl-C arrives once the worker runs: SIGINT to this process, as a terminal sends it.
    interrupter = threading.Thread(target=lambda: (wait_for(pid_file.exists), os.kill(os.getpid(), signal.SIGINT)))
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        run_launch([sys.executable, "-c", TREE, str(pid_file)], tmp_path / "tree.log", timeout=120)
    interrupter.join()
    signal.signal(signal.SIGINT, previous)
    worker = int(pid_file.read_text())
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


def wait_for(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the pid file is written: let its writer close it


@pytest.mark.parametrize("message, expected", [
    ("CUDA out of memory. Tried to allocate 20.00 MiB", True),
    ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", True),
    ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", True),
    ("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
     True),
    ("HIP out of memory. Tried to allocate 2.00 GiB", True),
    ("CUDA error: an illegal memory access was encountered", False),
    ("mat1 and mat2 shapes cannot be multiplied", False),
])
def test_every_form_of_out_of_memory_is_recognised(message, expected):
    assert is_out_of_memory(RuntimeError(message)) is expected
    assert is_out_of_memory(torch.OutOfMemoryError("anything"))


def test_a_stale_build_lock_is_reported_in_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()  # what a build killed part-way leaves, untouched since
    an_hour_ago = time.time() - 3600
    for path in (lock, lock.parent):
        os.utime(path, (an_hour_ago, an_hour_ago))
    stale = r"^DeepSpeed's CPU Adam build is locked by .*lock, left by a build that was interrupted"
    with pytest.raises(UserError, match=stale) as error:
        build_offload_optimizer()
    assert str(lock) in str(error.value) and str(error.value).count(". ") == 0


def test_probes_in_one_process_start_from_a_fresh_compiler_state():
    compiled = torch.compile(lambda tensor: tensor * 2, backend="eager")
    compiled(torch.ones(2))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled(torch.ones(2))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # cached while nothing resets it
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    try:
        CandidateRun.release(SimpleNamespace(accelerator=Accelerator(cpu=True)))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # leave no CPU-only state to later tests
    compiled(torch.ones(2))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


@pytest.fixture
def measured(monkeypatch) -> list[str]:
    """The candidates a sweep launches: the launch itself is replaced, as what is checked is the cache."""
    launched: list[str] = []

    def launch(request, accelerate_file, request_file, timeout):
        launched.append(request["candidate"]["sharding"])
        return {"status": "infeasible", "reason": "the launch exited with status 1: killed"}

    monkeypatch.setattr(sweep_module, "search_and_time", launch)
    return launched


def small_sweep(tmp_path: Path, **options) -> list[dict]:
    config = model_config("crammed-bert-tiny", 128)
    shape = Shape.of(config, 128, 2, on_cpu=True, activation_bytes=4)
    setting = Setting("crammed-bert-tiny", 128, 16, 2, True, "CPU", None, 1, 2)
    return sweep([Candidate("zero1")], setting, shape, 2**34, tmp_path, "CrammedBertLayer", timeout=60,
                 say=lambda _: None, **options)


def test_a_failure_is_cached_until_the_libraries_change_or_retry_failed_asks(tmp_path, monkeypatch, measured):
    assert small_sweep(tmp_path)[0]["source"] == "measured" and measured == ["zero1"]
    assert small_sweep(tmp_path)[0]["source"] == "cache" and measured == ["zero1"]
    assert small_sweep(tmp_path, retry_failed=True)[0]["source"] == "measured" and measured == ["zero1"] * 2
    versions = sweep_module.library_versions()
    monkeypatch.setattr(sweep_module, "library_versions", lambda: {**versions, "deepspeed": "9.9.9"})
    assert small_sweep(tmp_path)[0]["source"] == "measured" and measured == ["zero1"] * 3


def test_fsdp_with_eight_bit_adam_is_ruled_out():
    config = model_config("crammed-bert-tiny", 128)
    shape = Shape.of(config, 128, 2, on_cpu=False, activation_bytes=2)
    setting = Setting("crammed-bert-tiny", 128, 16, 2, False, "GPU", None, 1, 2)
    (row,) = sweep([Candidate("fsdp-full", optimizer="adamw-8bit")], setting, shape, 2**34, Path("unused"),
                   "CrammedBertLayer", timeout=60, say=lambda _: None)
    assert row["source"] == "rules" and "bitsandbytes#1633" in row["reason"]


@pytest.mark.slow
def test_one_rank_out_of_memory_means_that_size_does_not_fit_and_the_sizes_that_fit_are_kept(
        tmp_path, monkeypatch, recipe_env):
    # Two CPU processes with DDP; process 1 alone fails at micro-batch 8 while process 0 enters DDP's all-reduce.
    # Without the parent driving the search, this hangs until the collective timeout (10 minutes), past the
    # candidate timeout given here, and the whole candidate would be recorded as infeasible.
    monkeypatch.setenv("CRAM_CACHE", recipe_env["CRAM_CACHE"])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result_file = tmp_path / "ddp.json"
    request = {"mode": "search", "model": "crammed-bert-tiny", "candidate": Candidate().to_dict(), "seq_len": 128,
               "global_batch_size": 16, "memory_limit_bytes": 4 * 2**30, "seed_micro_batch": 4, "warmup_steps": 1,
               "timed_steps": 2, "precision": "auto", "compile": "false", "cache_dir": recipe_env["CRAM_CACHE"],
               "result": str(result_file)}
    result = search_and_time(request, REPO / "accel_configs" / "cpu-ddp.yaml", tmp_path / "request.json",
                             timeout=300, module="tests.plan_rank_oom")
    assert result["status"] == "ok", result
    probes = {probe["micro_batch"]: probe for probe in result["probes"]}
    assert probes[4]["fits"] and not probes[8]["fits"], probes
    assert "the launch failed at this micro-batch" in probes[8]["reason"]
    assert result["micro_batch"] == 4 and result["accumulation"] == 2
    assert json.loads(result_file.read_text())["micro_batch"] == 4
    leftovers = [process for process in psutil.process_iter(["cmdline"])
                 if str(tmp_path / "request.json") in " ".join(process.info["cmdline"] or [])]
    assert not leftovers


def test_the_cache_key_holds_without_deepspeed_installed(monkeypatch):
    """The base install has no DeepSpeed: the planner still keys its cache (the floors job found this crash)."""
    real_version = importlib.metadata.version

    def version(package: str) -> str:
        if package == "deepspeed":
            raise importlib.metadata.PackageNotFoundError(package)
        return real_version(package)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert sweep_module.library_versions()["deepspeed"] == "absent"
    setting = Setting("crammed-bert-tiny", 128, 16, 2, True, "CPU", None, 1, 2)
    assert setting.key().startswith("crammed-bert-tiny-")


def test_without_deepspeed_the_zero_candidates_are_ruled_out_with_the_extra_to_install(monkeypatch, measured):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "deepspeed" else real_find_spec(name, *args))
    config = model_config("crammed-bert-tiny", 128)
    shape = Shape.of(config, 128, 2, on_cpu=True, activation_bytes=4)
    setting = Setting("crammed-bert-tiny", 128, 16, 2, True, "CPU", None, 1, 2)
    rows = sweep([Candidate("zero2", offload=True), Candidate("zero1")], setting, shape, 2**34, Path("unused"),
                 "CrammedBertLayer", timeout=60, say=lambda _: None)
    assert [row["source"] for row in rows] == ["rules", "rules"] and measured == []
    assert all("cram[deepspeed]" in row["reason"] for row in rows)
