"""Fixtures shared by the test modules, and the 2-process launches that several test modules inspect."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from launching import accelerate_launch

from cram.data import embedded_corpus_path
from cram.train import runtime
from cram.train.runtime import cpu_has_bf16_units, resolve_precision

# One thread per process, in the workers and in every process they start (recipes read CRAM_CPU_THREADS, the rest
# OMP_NUM_THREADS): `make test` runs two workers, each often beside a launch of its own, on as few as 2 cores, where
# a process that counts on every core waits for threads that are not running. Two 24-step cram runs side by side on
# 2 cores took 72 s and 144 CPU-seconds with two threads each, 42 s and 84 CPU-seconds with one; one run alone took
# the same 23 s either way (the tests' models are tiny).
os.environ.setdefault("CRAM_CPU_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_report_header() -> str:
    units = "has bf16 units" if cpu_has_bf16_units() else "has no bf16 units"
    return f"cram: this CPU {units}, so --precision auto resolves to {resolve_precision('auto', 'cpu')!r}"


@pytest.fixture(params=[False, True], ids=["cpu-without-bf16", "cpu-with-bf16"])
def cpu_bf16_units(request, monkeypatch) -> bool:
    """Both answers to "does this CPU have bf16 units?", for in-process tests whose path `--precision auto` decides:
    CI runs on whichever CPU the session had, so both must pass on any machine (torch emulates bf16 where the
    units are missing)."""
    monkeypatch.setattr(runtime, "cpu_has_bf16_units", lambda: request.param)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    return request.param

REPO = Path(__file__).resolve().parents[1]
# Guards against a hung run, not speed limits: a loaded machine may take many times a quiet one's minute.
HANG_GUARD = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `launch` every test that starts a recipe in processes of its own (all of them get `recipe_env`, directly
    or through a fixture), so `make test-fast` can leave them out.

    For `make test`'s workers (pytest-xdist, `--dist loadfile`: a module runs whole on one worker, so its shared
    launches are made once): hand out the modules with the most launches first, so the long ones do not start last
    and leave the other worker idle. The order is the same in every worker, as xdist requires."""
    launches: dict[str, int] = {}
    for item in items:
        launched = "recipe_env" in getattr(item, "fixturenames", ())
        if launched:
            item.add_marker(pytest.mark.launch)
        launches[item.module.__name__] = launches.get(item.module.__name__, 0) + launched
    items.sort(key=lambda item: -launches[item.module.__name__])  # stable: a module's tests keep their order


@pytest.fixture(scope="session")
def embedded_corpus() -> Path:
    """The embedded English corpus, in the user's cache so it is built once per machine, not once per run."""
    return embedded_corpus_path()


@pytest.fixture(scope="session")
def english_texts(embedded_corpus: Path) -> list[str]:
    """A few hundred real English documents for tests that write their own small files."""
    with open(embedded_corpus, encoding="utf-8") as file:
        return [json.loads(line)["text"] for _, line in zip(range(600), file, strict=False)]


@pytest.fixture(scope="session")
def cram_cache(tmp_path_factory, embedded_corpus: Path) -> Path:
    """One data cache for every recipe run of the session, so the embedded set is prepared once, not per module.

    It starts with a copy of the embedded corpus from the user's cache, where `embedded_corpus` built it.
    """
    cache = tmp_path_factory.mktemp("cram-cache")
    (cache / "embedded").mkdir()
    shutil.copy(embedded_corpus, cache / "embedded" / embedded_corpus.name)
    return cache


@pytest.fixture(scope="session")
def recipe_env(cram_cache: Path) -> dict[str, str]:
    """The environment recipe subprocesses run in: the session's data cache, no tokenizer thread warnings."""
    return {**os.environ, "CRAM_CACHE": str(cram_cache), "TOKENIZERS_PARALLELISM": "false"}


# The recipe command of the 2-process runs and of their 1-process reference: a step budget, fp32, and a global
# micro-step of 16 sequences (16 on one process, or 8 on each of two); a target of 64 accumulates up to 4 of them.
DISTRIBUTED_RUN = ["--preset", "tiny", "--max-steps", "4", "--target-batch-size", "64", "--precision", "fp32",
                   "--log-every", "1"]
COLLECTIVE_TIMEOUT_MINUTES = 0.25
PREPARATION_SECONDS = 25  # longer than the collective timeout


@dataclass(frozen=True)
class TwoProcessLaunch:
    """One launch of `recipes/cram.py` on 2 CPU processes, shared by every test that inspects it."""

    config: str  # accel_configs/<config>.yaml
    compiled: bool = False
    # Prepare the data afresh, slowed past a short collective timeout (tests/slow_preparation.py).
    slowed_preparation: bool = False


# Each launch serves several checks (tests/test_distributed.py): equality with one process, and the launch path's
# effects: a collective timeout outlasted, inductor's code run under DDP and ZeRO-2.
# ZeRO-3 with offload has no launch here: tests/test_distributed.py checks it on the run it stops by SIGTERM and
# resumes. Nor has ZeRO-1: the Pythia recipe's ZeRO-1 launch (tests/test_pythia_recipe.py) checks it against one
# process on the same engine, and DeepSpeed runs stages 1 and 2 through one optimizer (stage_1_and_2.py).
SLOWED_PREPARATION = "ddp-slowed-preparation"
TWO_PROCESS_LAUNCHES = {
    SLOWED_PREPARATION: TwoProcessLaunch("cpu-ddp", slowed_preparation=True),
    "ddp-compiled": TwoProcessLaunch("cpu-ddp", compiled=True),
    "zero2-compiled": TwoProcessLaunch("cpu-zero2", compiled=True),
}


@dataclass(frozen=True)
class LaunchedRun:
    output_dir: Path
    seconds: float  # wall time of the launch
    inductor_cache: Path  # TORCHINDUCTOR_CACHE_DIR: inductor writes the code it generates there
    group_timeouts: Path  # rank-N.json: the process group's timeout (slowed-preparation launches only)


@pytest.fixture(scope="session")
def distributed_cache(tmp_path_factory, cram_cache) -> Path:
    """The data cache of the 2-process runs and their reference: only the corpus's text at first, so the
    slowed-preparation launch prepares the set itself, and every other run then trains on the set it prepared."""
    cache = tmp_path_factory.mktemp("distributed-cache")
    shutil.copytree(cram_cache / "embedded", cache / "embedded")
    return cache


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory, recipe_env, distributed_cache) -> Callable[[str], LaunchedRun]:
    """`two_process_run(name)` launches TWO_PROCESS_LAUNCHES[name] the first time it is asked for, then reuses it.

    The slowed-preparation launch always goes first: it must find the set unprepared."""
    launched: dict[str, LaunchedRun] = {}

    def run(name: str) -> LaunchedRun:
        if name in launched:
            return launched[name]
        launch = TWO_PROCESS_LAUNCHES[name]
        if not launch.slowed_preparation:
            run(SLOWED_PREPARATION)
        folder = tmp_path_factory.mktemp(name)
        result = LaunchedRun(folder / "run", 0.0, folder / "inductor", folder / "group-timeouts")
        result.group_timeouts.mkdir()
        env = {**recipe_env, "CRAM_CACHE": str(distributed_cache),
               "TORCHINDUCTOR_CACHE_DIR": str(result.inductor_cache)}
        script, options = REPO / "recipes" / "cram.py", ["--compile", "true" if launch.compiled else "false"]
        if launch.slowed_preparation:
            env.update(CRAM_TEST_PREPARATION_SECONDS=str(PREPARATION_SECONDS),
                       CRAM_TEST_GROUP_TIMEOUT_DIR=str(result.group_timeouts))
            script = REPO / "tests" / "slow_preparation.py"
            options += ["--collective-timeout-minutes", str(COLLECTIVE_TIMEOUT_MINUTES)]
        command = [*accelerate_launch(REPO / "accel_configs" / f"{launch.config}.yaml"),
                   script, *DISTRIBUTED_RUN, "--micro-batch-size", "8", "--output-dir", result.output_dir, *options]
        started = time.monotonic()
        completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
        assert completed.returncode == 0, f"{name}: {completed.stderr[-3000:]}"
        launched[name] = LaunchedRun(result.output_dir, time.monotonic() - started, result.inductor_cache,
                                     result.group_timeouts)
        return launched[name]

    return run


@pytest.fixture(scope="session")
def distributed_env(recipe_env, distributed_cache, two_process_run) -> dict[str, str]:
    """The environment of every other run compared with the 2-process runs: their data cache, once prepared."""
    two_process_run(SLOWED_PREPARATION)
    return {**recipe_env, "CRAM_CACHE": str(distributed_cache)}


@pytest.fixture(scope="session")
def single_process_reference(tmp_path_factory, distributed_env) -> Path:
    """The 2-process runs' reference: one process, 16 sequences per micro-batch, the same global batch."""
    output_dir = tmp_path_factory.mktemp("single")
    command = [sys.executable, REPO / "recipes" / "cram.py", *DISTRIBUTED_RUN, "--micro-batch-size", "16",
               "--output-dir", output_dir]
    completed = subprocess.run(command, env=distributed_env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir
