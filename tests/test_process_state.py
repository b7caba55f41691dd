"""Runs that share one Python process (a notebook calling a recipe's `main()` twice, the in-process tests) must
not depend on what ran before them or on the CPU: Accelerate keeps one precision per process and refuses another."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from launching import load_recipe, run_recipe_in_process

import cram  # noqa: F401  (importing the package is what quiets bitsandbytes)
from cram.data.megatron import tokenized_documents, write_megatron
from cram.data.tokenizer import train_byte_level_bpe
from cram.errors import UserError
from cram.train.accelerator import build_accelerator, shut_down, use_cpu_cores
from cram.train.deepspeed_setup import (
    skip_deepspeed_shared_memory_op,
    tell_deepspeed_the_local_processes,
    wait_for_each_all_gather,
)

REPO = Path(__file__).resolve().parents[1]


def test_an_accelerator_of_another_precision_can_follow_in_the_same_process(tmp_path, cpu_bf16_units):
    first = build_accelerator("fp32", "false", None, str(tmp_path))
    assert first.mixed_precision == "no"
    second = build_accelerator("auto", "false", None, str(tmp_path))  # no run ended in between (a refused input)
    assert second.mixed_precision == ("bf16" if cpu_bf16_units else "no")
    shut_down(second)
    assert build_accelerator("fp32", "false", None, str(tmp_path)).mixed_precision == "no"


@pytest.fixture
def tiny_pythia_data(tmp_path, english_texts) -> tuple[Path, Path]:
    tokenizer = train_byte_level_bpe(iter(english_texts[:200]), 500, lowercase=False, model_max_length=2048)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    write_megatron(tmp_path / "document", tokenized_documents(english_texts[:40], tokenizer))
    return tmp_path / "document", tmp_path / "tokenizer"


@pytest.mark.parametrize("cpu_bf16_units", [True], ids=["cpu-with-bf16"], indirect=True)
def test_a_recipe_main_runs_twice_in_one_process_at_auto_precision(
    tmp_path, monkeypatch, tiny_pythia_data, cpu_bf16_units, recipe_env
):
    """The notebook case, and the test order that fails on a CPU with bf16 units if a run inherits the last one's
    precision: an fp32 run first, then a run whose `--precision auto` resolves to bf16 (the fast test above covers
    both CPUs)."""
    for name in ("CRAM_CACHE", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(name, recipe_env[name])
    recipe = load_recipe(REPO / "recipes" / "pythia.py", "pythia_recipe_twice")
    prefix, tokenizer = tiny_pythia_data
    common = ["--size", "pythia-14m", "--vocab-size", "512", "--max-steps", "1", "--seq-len", "16",
              "--global-batch-size", "2", "--micro-batch-size", "2", "--checkpoint-every-minutes", "0",
              "--data", prefix, "--tokenizer", tokenizer]
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for name, precision in (("first", "fp32"), ("second", "auto")):
        monkeypatch.setattr(sys, "argv", ["pythia.py", *map(str, common), "--precision", precision,
                                          "--output-dir", str(tmp_path / name)])
        recipe.main()
        # A finished run gives Ctrl-C and SIGTERM back: in a notebook, Ctrl-C interrupts the next cell again.
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    resolved = json.loads((tmp_path / "second" / "final" / "cram_options.json").read_text())
    assert resolved["resolved"]["mixed_precision"] == "bf16"


def test_importing_cram_quiets_bitsandbytes_cpu_kernel_notice():
    """On CPUs with AVX512-BF16, importing bitsandbytes (transformers' Trainer imports peft, which imports it) logs
    a warning about an optional 4-bit kernel; no cram path uses 4-bit, and a refused input must print one line."""
    assert not logging.getLogger("bitsandbytes.backends.cpu.ops").isEnabledFor(logging.WARNING)


@pytest.fixture
def torch_threads():
    """Puts back this process's torch thread count after a test that sets it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_training_processes_share_the_cores_unless_cram_cpu_threads_says_how_many(monkeypatch, torch_threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("CRAM_CPU_THREADS", raising=False)
    use_cpu_cores()
    assert torch.get_num_threads() == 4  # 8 cores, 2 processes on this machine
    monkeypatch.setenv("CRAM_CPU_THREADS", "3")
    use_cpu_cores()
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_bad_cram_cpu_threads_is_one_sentence_that_names_the_fix(monkeypatch, torch_threads, value):
    monkeypatch.setenv("CRAM_CPU_THREADS", value)
    with pytest.raises(UserError) as refused:
        use_cpu_cores()
    assert str(refused.value).startswith(f"CRAM_CPU_THREADS={value} is not a positive number of threads: set it")


def test_the_recipe_refuses_a_bad_cram_cpu_threads_with_exit_2_before_writing_anything(
    monkeypatch, capsys, torch_threads, tmp_path
):
    monkeypatch.setenv("CRAM_CPU_THREADS", "two")
    status, stderr = run_recipe_in_process(monkeypatch, capsys, REPO / "recipes" / "cram.py", [
        "--preset", "tiny", "--max-steps", "1", "--output-dir", tmp_path / "run"])
    assert status == 2
    assert stderr.strip().splitlines() == [
        "error: CRAM_CPU_THREADS=two is not a positive number of threads: set it to one, e.g. 1, or unset it to "
        "share this machine's cores among the training processes."]
    assert not (tmp_path / "run").exists()


def test_deepspeed_on_the_cpu_neither_probes_for_nor_builds_its_shared_memory_all_reduce():
    # The op only DeepSpeed's inference all-reduce calls: building it with g++ makes a first DeepSpeed launch slow on
    # a small machine. `build_shm_op` is what DeepSpeed's backend calls when it starts.
    from deepspeed.comm.torch import build_shm_op

    skip_deepspeed_shared_memory_op()
    assert build_shm_op() is None


def test_deepspeed_on_the_cpu_counts_this_machines_processes_as_its_devices(monkeypatch):
    # What DeepSpeed's own launcher exports; without it DeepSpeed asks `numactl`, which 0.14.4 required.
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setenv("LOCAL_SIZE", "")  # recorded, so that the test's own value goes again afterwards
    monkeypatch.delenv("LOCAL_SIZE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    tell_deepspeed_the_local_processes()
    assert get_accelerator().device_count() == 2


@pytest.mark.parametrize("version, waits", [("0.16.0", True), ("0.19.7", True), ("0.19.8", False)])
def test_deepspeed_before_0_19_8_has_each_all_gather_done_before_it_returns(monkeypatch, version, waits):
    # Before 0.19.8, ZeRO-3's gather of several parameters waits on its last all-gather alone, which gloo does not
    # order: a ZeRO-3 run on the CPU reads garbage weights at random unless each one is waited on.
    import deepspeed
    from deepspeed import comm

    events = []

    class Work:
        def __init__(self, name: str):
            self.name = name

        def wait(self) -> None:
            events.append(("wait", self.name))

    def launcher(name: str):
        def launch(*args, async_op=False, **kwargs):
            events.append(("launch", name))
            return Work(name) if async_op else None
        return launch

    for name in ("all_gather_into_tensor", "all_gather"):
        monkeypatch.setattr(comm, name, launcher(name))
    monkeypatch.setattr(comm, "_cram_waits_for_each", False, raising=False)
    monkeypatch.setattr(deepspeed, "__version__", version)
    wait_for_each_all_gather()
    comm.all_gather_into_tensor("output", "input", async_op=True)
    comm.all_gather(["output"], "input", async_op=True)
    comm.all_gather(["output"], "input")  # a blocking call has no handle to wait on
    launched = [("launch", "all_gather_into_tensor"), ("launch", "all_gather"), ("launch", "all_gather")]
    if waits:
        assert events == [launched[0], ("wait", "all_gather_into_tensor"), launched[1], ("wait", "all_gather"),
                          launched[2]]
    else:
        assert events == launched
