"""Sweeps that survive failure: one rank out of memory, one rank failing with another error (while probing, while
timing), a hung launch, Ctrl-C and SIGTERM, a stale build lock and a failed build, every form of out-of-memory, a
cache that forgets failures when the libraries change or when asked and says when they were measured; and the
sweep's length said before its first launch."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from launching import started, wait_until

from cram.errors import UserError
from cram.plan import launch as launch_module
from cram.plan import setting as setting_module
from cram.plan import sweep as sweep_module
from cram.plan.launch import Terminated, rank_failures, run_launch, search_and_time
from cram.plan.models import model_config
from cram.plan.peak_memory import Shape
from cram.plan.probe import CandidateRun, is_out_of_memory
from cram.plan.report import markdown_table
from cram.plan.setting import Setting
from cram.plan.space import Candidate, candidate_space
from cram.plan.sweep import sweep
from cram.plan.sweep_length import LaunchCosts, LaunchLimits, format_duration, predict_step_seconds, sweep_length
from cram.train import deepspeed_ops
from cram.train.deepspeed_ops import build_offload_optimizer

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


@pytest.mark.parametrize("signal_number, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
def test_ctrl_c_or_sigterm_during_a_launch_ends_its_whole_process_tree(tmp_path, signal_number, raised):
    # Python's own Ctrl-C handler, as in a fresh `recipes/plan.py`: an earlier in-process test of the session may
    # have left another, under which SIGINT would be caught and no KeyboardInterrupt would come.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    pid_file = tmp_path / "worker.pid"
    # The signal arrives once the worker runs: to this process, as a terminal or a job scheduler sends it.
    interrupter = threading.Thread(target=lambda: (wait_for_pid(pid_file), os.kill(os.getpid(), signal_number)))
    interrupter.start()
    with pytest.raises(raised):
        run_launch([sys.executable, "-c", TREE, str(pid_file)], tmp_path / "tree.log", timeout=120)
    interrupter.join(timeout=60)
    assert not interrupter.is_alive()
    signal.signal(signal.SIGINT, previous)
    worker = int(pid_file.read_text())
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the planner's handler is the launch's only


def test_a_launch_in_which_a_process_failed_is_ended_when_it_does_not_end_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_module, "FAILURE_GRACE_SECONDS", 1.0)
    pid_file = tmp_path / "worker.pid"
    returncode = run_launch([sys.executable, "-c", TREE, str(pid_file)], tmp_path / "tree.log", timeout=120,
                            failed=pid_file.exists)  # as if the worker had written its failure and hung
    assert returncode is not None  # ended for the failure, not for the timeout
    worker = int(pid_file.read_text())
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


def test_the_first_process_to_fail_is_the_cause_not_the_one_that_lost_its_peer(tmp_path):
    result = tmp_path / "zero1.json"
    for rank, at, error in ((0, 2.0, "DistBackendError: Connection closed by peer"),
                            (1, 1.0, "RuntimeError: No space left on device (/dev/shm)")):
        result.with_suffix(f".rank{rank}.failure.json").write_text(
            json.dumps({"rank": rank, "out_of_memory": False, "at": at, "error": error}))
    assert [failure["rank"] for failure in rank_failures(result)] == [1, 0]


def wait_for_pid(pid_file: Path) -> None:
    """Wait until the launcher has written its worker's pid (the file exists a moment before it holds the pid)."""
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit(), seconds=60, interval=0.01,
               what="the worker's pid")


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


def test_a_lock_whose_build_still_compiles_is_waited_for_however_old(tmp_path, monkeypatch):
    """`make test` builds CPU Adam beside the suite at the lowest priority: its compilers may write nothing for longer
    than the stale limit. The lock is stale only once no process works in the build's folder."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(deepspeed_ops, "POLL_SECONDS", 0.05)
    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    (folder / "lock").touch()
    an_hour_ago = time.time() - 3600
    for path in (folder / "lock", folder):
        os.utime(path, (an_hour_ago, an_hour_ago))
    raised: list[BaseException] = []

    def wait_for_the_build() -> None:
        try:
            build_offload_optimizer(stale_after=1.0)
        except UserError as error:
            raised.append(error)

    with started(["sleep", "600"], cwd=folder) as compiler:  # a compiler at work in the folder
        waiting = threading.Thread(target=wait_for_the_build, daemon=True)
        waiting.start()
        wait_until(lambda: deepspeed_ops.build_running(folder), seconds=30, what="the compiler in the folder")
        waiting.join(timeout=1.0)  # twenty looks at the lock
        assert waiting.is_alive() and not raised
        compiler.kill()
    waiting.join(timeout=30)
    assert not waiting.is_alive() and "left by a build that was interrupted" in str(raised[0])


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


def small_sweep(tmp_path: Path, candidates: tuple[Candidate, ...] = (Candidate("zero1"),), say=lambda _: None,
                **options) -> list[dict]:
    config = model_config("crammed-bert-tiny", 128)
    shape = Shape.of(config, 128, 2, on_cpu=True, activation_bytes=4)
    setting = Setting("crammed-bert-tiny", 128, 16, 2, True, "CPU", None, 1, 2)
    limits = options.pop("limits", LaunchLimits.fixed(60))
    return sweep(list(candidates), setting, shape, 2**34, tmp_path, "CrammedBertLayer", limits, say=say, **options)


def test_a_failure_is_cached_until_the_libraries_change_or_retry_failed_asks(tmp_path, monkeypatch, measured):
    assert small_sweep(tmp_path)[0]["source"] == "measured" and measured == ["zero1"]
    said: list[str] = []
    (cached,) = small_sweep(tmp_path, say=said.append)
    assert cached["source"] == "cache" and measured == ["zero1"]
    # A cached failure says that it is one, from when, and how to measure it again, on screen and in the table.
    cached_failure = r"\(cached, measured \d{4}-\d\d-\d\d \d\d:\d\d UTC: add --retry-failed to measure it again\)"
    assert re.search(cached_failure, said[-1]) and re.search(cached_failure, markdown_table([cached]))
    assert small_sweep(tmp_path, retry_failed=True)[0]["source"] == "measured" and measured == ["zero1"] * 2
    versions = setting_module.library_versions()
    monkeypatch.setattr(setting_module, "library_versions", lambda: {**versions, "deepspeed": "9.9.9"})
    assert small_sweep(tmp_path)[0]["source"] == "measured" and measured == ["zero1"] * 3


def test_a_cpu_adam_op_that_does_not_build_is_one_failed_row_and_the_sweep_goes_on(tmp_path, monkeypatch, measured):
    from deepspeed.accelerator import get_accelerator

    def no_toolkit(self, *args, **kwargs):
        raise OSError("CUDA_HOME does not exist, unable to compile CUDA op(s)")

    builder = get_accelerator().get_op_builder("CPUAdamBuilder")
    monkeypatch.setattr(builder, "load", no_toolkit)
    rows = small_sweep(tmp_path, (Candidate("zero1"), Candidate("zero2", offload=True),
                                  Candidate("zero3", offload=True)))
    assert measured == ["zero1"]
    for row in rows[1:]:
        assert row["status"] == "error" and row["source"] == "build"
        assert row["reason"] == ("DeepSpeed's CPU Adam op, which offloading the optimizer needs, did not build: "
                                 "OSError: CUDA_HOME does not exist, unable to compile CUDA op(s)")
    assert "failed, not out of memory: DeepSpeed's CPU Adam op" in markdown_table(rows)


def test_the_sweep_says_its_length_before_the_first_launch(tmp_path, measured):
    said: list[str] = []
    costs = LaunchCosts(step_seconds=2.0, build_seconds=3.0, save_seconds=1.0, start_seconds=20.0)
    small_sweep(tmp_path, (Candidate("zero1"), Candidate("zero2"), Candidate("fsdp-full")), say=said.append,
                limits=LaunchLimits(costs, override_seconds=60.0), paired_rounds=3, verify_steps=10)
    assert said[0].startswith("sweep: 2 candidate(s) to launch (0 cached, 1 ruled out") and "measuring" in said[1]
    setting = Setting("crammed-bert-tiny", 128, 16, 2, True, "CPU", None, warmup_steps=1, timed_steps=2,
                      max_timed_steps=5)
    # 2 launched: each at most 2 × 3 probes (4 divisors of 8), each a build and a step, then a build, 1 warm-up and
    # 5 timed steps and a save; then the 2 leaders × 3 rounds of a build, 1 + 2 steps and a save, and a verification
    # of a build, 1 + 10 steps and a save: 9 launches, 2 × 7 + 7 = 21 builds, 24 + 18 + 11 = 53 steps, 9 saves.
    to_launch = [Candidate("zero1"), Candidate("zero2")]
    line = sweep_length(to_launch, 0, 1, setting, LaunchLimits(costs, 60.0), paired_rounds=3, verify_steps=10,
                        mixed_precision=False)
    assert "then 7 launch(es)" in line
    assert "at most 9 launches, 21 model builds, 53 optimizer steps and 9 saves" in line
    # 9 × 20 s of start-up + 21 × 3 s + 53 × 2 s + 9 × 1 s = 358 s.
    assert "about 6 min at the predicted 2 s per step, 3 s per build, 1 s per save and 20 s per launch's start-up" in (
        line)
    assert "each launch may take 60 s (--candidate-timeout)" in line
    assert line.endswith("--candidates NAME,NAME measures fewer")
    assert "revisions" not in line  # crammed BERT's budget has none
    assert "no step time can be predicted" in sweep_length([], 2, 0, setting, LaunchLimits.fixed(60), 0, 0, False)


def test_pythia_12b_on_eight_a100s_gets_each_launchs_time_limit_from_its_predicted_length(tmp_path, monkeypatch):
    config = model_config("pythia-12b", 2048)
    shape = Shape.of(config, 2048, 8, on_cpu=False, activation_bytes=2)
    setting = Setting("pythia-12b", 2048, 1024, 8, False, "NVIDIA A100-SXM4-80GB", None, warmup_steps=3,
                      timed_steps=5, max_timed_steps=20, spread_bound=0.05)
    step = predict_step_seconds(config, 1024, 2048, 8, False, setting.device)
    assert 120 < step < 300  # 2 M tokens × 6 × 12 B FLOPs at 35 % of 8 × 312 TFLOP/s: about 3 minutes
    # The build and save rates are the node's own measurements; here, fixed figures of that order.
    limits = LaunchLimits(LaunchCosts(step, build_seconds=60.0, save_seconds=170.0))
    said: list[str] = []
    rows = sweep(candidate_space(8), setting, shape, 80 * 2**30, tmp_path, "GPTNeoXLayer", limits, say=said.append,
                 paired_rounds=3, dry_run=True)
    to_launch = [Candidate(**{key: row[key] for key in ("sharding", "offload", "checkpointing", "optimizer")})
                 for row in rows if "status" not in row]
    assert len(said) == 1 and len(to_launch) >= 6  # the dry run launches nothing
    seconds = {}
    for candidate in to_launch:
        # 30 s start-up, 8 probes (8 divisors of 128) each a build and at most a full step, a build, 3 + 20 steps,
        # a save; a step a third longer where the forward pass is recomputed.
        candidate_step = step * (8 / 6 if candidate.checkpointing else 1.0)
        predicted = 30.0 + 9 * 60.0 + (8 + 23) * candidate_step + 170.0
        assert limits.search_seconds(candidate, setting) == pytest.approx(predicted)
        seconds[candidate.name] = limits.search_limit(candidate, setting)
        assert seconds[candidate.name] == pytest.approx(3 * predicted)
        assert seconds[candidate.name] > 4 * 3600  # the old fixed hour would end every one of them
    shown = f"{format_duration(min(seconds.values()))} to {format_duration(max(seconds.values()))}"
    assert f"a candidate's launch may take {shown} (3 × its predicted time" in said[0]
    assert "--candidate-timeout SECONDS sets one limit for all" in said[0]
    # The run's revisions, as the days will count them: Pythia's 154 checkpoint steps, each the model alone at its
    # share of a measured save (bf16 DeepSpeed weights beside 12 bytes of fp32 state; FSDP's fp32 weights beside
    # Adam's 8), at the predicted 170 s a save: 154 × 170 s × 2/14 = 62 min, × 4/12 = 2.4 h.
    assert ("the run's days will count its 154 revisions (the model alone, saved at pythia-12b's checkpoint steps) "
            "each at its share of the candidate's measured training-state save, the model's bytes over the state's: "
            "2/14 under DeepSpeed, 4/12 under DDP and FSDP, about 62 min to 2.4 h in all at the predicted save") in (
        said[0])
    # The sweep hands each launch its own limit; --candidate-timeout replaces them all.
    given: dict[str, float] = {}
    monkeypatch.setattr(sweep_module, "search_and_time", lambda request, accelerate_file, request_file, timeout: (
        given.update({Candidate(**request["candidate"]).name: timeout}) or {"status": "infeasible", "reason": "-"}))
    pair = [Candidate("zero3"), Candidate("zero3", offload=True, checkpointing=True)]
    sweep(pair, setting, shape, 80 * 2**30, tmp_path, "GPTNeoXLayer", limits, say=lambda _: None)
    assert given == {candidate.name: limits.search_limit(candidate, setting) for candidate in pair}
    sweep(pair, setting, shape, 80 * 2**30, tmp_path / "again", "GPTNeoXLayer", LaunchLimits(limits.costs, 7200.0),
          say=lambda _: None)
    assert set(given.values()) == {7200.0}


def test_fsdp_with_eight_bit_adam_is_ruled_out():
    config = model_config("crammed-bert-tiny", 128)
    shape = Shape.of(config, 128, 2, on_cpu=False, activation_bytes=2)
    setting = Setting("crammed-bert-tiny", 128, 16, 2, False, "GPU", None, 1, 2)
    (row,) = sweep([Candidate("fsdp-full", optimizer="adamw-8bit")], setting, shape, 2**34, Path("unused"),
                   "CrammedBertLayer", LaunchLimits.fixed(60), say=lambda _: None)
    assert row["source"] == "rules" and "bitsandbytes#1633" in row["reason"]


@pytest.mark.slow
def test_one_rank_out_of_memory_means_that_size_does_not_fit_and_the_sizes_that_fit_are_kept(
        tmp_path, monkeypatch, recipe_env, forked_candidates):
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
    assert "out of memory while probing micro-batch 8 (process 1 failed: OutOfMemoryError" in probes[8]["reason"]
    assert result["micro_batch"] == 4 and result["accumulation"] == 2
    assert json.loads(result_file.read_text())["micro_batch"] == 4
    leftovers = [process for process in psutil.process_iter(["cmdline"])
                 if str(tmp_path / "request.json") in " ".join(process.info["cmdline"] or [])]
    assert not leftovers


def fault_request(tmp_path: Path, monkeypatch, recipe_env: dict, fault: str) -> dict:
    monkeypatch.setenv("CRAM_CACHE", recipe_env["CRAM_CACHE"])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PLAN_FAULT", fault)
    return {"mode": "search", "model": "crammed-bert-tiny", "candidate": Candidate().to_dict(), "seq_len": 128,
            "global_batch_size": 16, "memory_limit_bytes": 4 * 2**30, "seed_micro_batch": 8, "warmup_steps": 1,
            "timed_steps": 3, "precision": "auto", "compile": "false", "cache_dir": recipe_env["CRAM_CACHE"],
            "result": str(tmp_path / "ddp.json")}


def counted_launches(monkeypatch) -> list[dict]:
    launched: list[dict] = []
    real_launch_probe = launch_module.launch_probe

    def launch_probe(*args, **kwargs) -> dict:
        launched.append(result := real_launch_probe(*args, **kwargs))
        return result

    monkeypatch.setattr(launch_module, "launch_probe", launch_probe)
    return launched


def no_process_of(marker: str) -> bool:
    return not [process for process in psutil.process_iter(["cmdline"])
                if marker in " ".join(process.info["cmdline"] or [])]


@pytest.mark.slow
@pytest.mark.parametrize("fault, where", [("probe", "while probing micro-batch 8"),
                                          ("timing", "while timing micro-batch 8")])
def test_a_rank_failing_with_another_error_ends_its_candidate_with_that_error_in_one_launch(
        tmp_path, monkeypatch, recipe_env, fault, where, forked_candidates):
    # Two CPU processes with DDP; process 1 alone fails with an NCCL-like error while process 0 goes on into DDP's
    # all-reduce. Read as "does not fit", the probe case would search on at smaller sizes and report the candidate
    # as not fitting; with process 0 left waiting, the timing case would end at the candidate timeout (given here
    # below the 10-minute collective timeout) with no cause.
    request = fault_request(tmp_path, monkeypatch, recipe_env, fault)
    launched = counted_launches(monkeypatch)
    result = search_and_time(request, REPO / "accel_configs" / "cpu-ddp.yaml", tmp_path / "request.json",
                             timeout=300, module="tests.plan_rank_error")
    assert result == {"status": "error", "reason": f"{where}: process 1 failed: RuntimeError: injected on process 1: "
                      "NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"}
    assert len(launched) == 1 and not (tmp_path / "ddp.json").exists()
    assert no_process_of(str(tmp_path / "request.json"))


@pytest.mark.slow
def test_sigterm_to_the_planner_mid_candidate_ends_the_candidates_processes(tmp_path, recipe_env):
    output_dir = tmp_path / "out"
    command = [sys.executable, REPO / "recipes" / "plan.py", "--model", "crammed-bert-tiny", "--memory-limit", "2GiB",
               "--global-batch-size", "8", "--candidates", "ddp", "--output-dir", output_dir]

    def candidate_processes() -> list[psutil.Process]:
        return [process for process in psutil.process_iter(["cmdline"])
                if "cram.plan.probe" in (command := " ".join(process.info["cmdline"] or []))
                and str(output_dir) in command]

    # Fresh interpreters: the test finds the candidate's processes by their command lines (a zygote's child has the
    # zygote's).
    with started(command, cwd=REPO, env=recipe_env, fresh=True) as planner:
        try:
            wait_until(lambda: len(candidate_processes()) >= 2, planner, seconds=300,
                       what="the candidate's launcher and worker")
            planner.send_signal(signal.SIGTERM)
            stopped = planner.finished(timeout=120)
            output = stopped.stdout + stopped.stderr
            assert stopped.returncode != 0 and "interrupted" in output, output[-2000:]
            wait_until(lambda: not candidate_processes(), seconds=30, what="the end of the candidate's processes")
        finally:
            for process in candidate_processes():
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()


def test_the_cache_key_holds_without_deepspeed_installed(monkeypatch):
    """The base install has no DeepSpeed: the planner still keys its cache, DeepSpeed's version as absent."""
    real_version = importlib.metadata.version

    def version(package: str) -> str:
        if package == "deepspeed":
            raise importlib.metadata.PackageNotFoundError(package)
        return real_version(package)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert setting_module.library_versions()["deepspeed"] == "absent"
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
                 "CrammedBertLayer", LaunchLimits.fixed(60), say=lambda _: None)
    assert [row["source"] for row in rows] == ["rules", "rules"] and measured == []
    assert all("cram[deepspeed]" in row["reason"] for row in rows)
