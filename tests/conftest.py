"""Fixtures shared by the test modules (their processes start through tests/launching.py), and the `launch` mark."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import launching
import pytest
import torch
import torch._inductor.config
from hub_standin import reserve_session_endpoint

import cram.train.precision
from cram.data import embedded_corpus_path
from cram.devices import cpu_has_bf16_units
from cram.train.precision import resolve_precision

# One thread per process, in the workers and in every process they start (recipes read CRAM_CPU_THREADS, the rest
# OMP_NUM_THREADS): `make test` runs two workers, each often beside a launch of its own, on as few as 2 cores, where
# a process that counts on every core waits for threads that are not running, and the tests' models are too small
# to gain from more than one (docs/benchmarks.md: The test suite).
os.environ.setdefault("CRAM_CPU_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# So too for inductor's kernel compiles: at its default for 2 cores, each compiling process starts a pool of compile
# workers (a fresh interpreter that imports torch) to compile 2 kernels at a time; at 1 it compiles them itself, the
# same kernels, one after another.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# The workers' own config read the variable before it was set here: conftest's imports load it.
torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


def pytest_report_header() -> str:
    units = "has bf16 units" if cpu_has_bf16_units() else "has no bf16 units"
    return f"cram: this CPU {units}, so --precision auto resolves to {resolve_precision('auto', 'cpu')!r}"


@pytest.fixture(params=[False, True], ids=["cpu-without-bf16", "cpu-with-bf16"])
def cpu_bf16_units(request, monkeypatch) -> bool:
    """Both answers to "does this CPU have bf16 units?", for in-process tests whose path `--precision auto` decides:
    CI runs on whichever CPU the session had, so both must pass on any machine (torch emulates bf16 where the
    units are missing)."""
    monkeypatch.setattr(cram.train.precision, "cpu_has_bf16_units", lambda: request.param)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    return request.param


REPO = Path(__file__).resolve().parents[1]
INDUCTOR_CACHE_OWNER = "CRAM_TEST_INDUCTOR_CACHE_OWNER"  # the pid of the pytest process that made the session's cache


def pytest_configure(config: pytest.Config) -> None:
    """pytest-timeout's `timeout` (pyproject.toml, or --timeout) must leave room for each process's own guard.

    One inductor cache for the whole session, made by the first pytest process (the workers inherit it): a graph
    that one test compiled, another test or process of the same shapes loads instead of compiling again, and the
    session starts from an empty cache, never from what an earlier session left. A test that needs to know a
    process ran compiled code reads that process's own trace (launching.generated_code_per_process).

    And one Hub address for every program of each pytest process, where its tests' Hub stand-ins listen
    (tests/hub_standin.py, `reserve_session_endpoint`)."""
    given = config.getoption("timeout", None)
    launching.check_hang_guard(float(config.getini("timeout") or 0) if given is None else float(given))
    reserve_session_endpoint()
    if not hasattr(config, "workerinput"):
        os.environ[INDUCTOR_CACHE_OWNER] = str(os.getpid())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cram-test-inductor-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(INDUCTOR_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `launch` every test that gets `recipe_env` (directly or through a fixture): those start recipes in
    processes of their own, so `make test-fast` can leave them out. A test that starts another Python process carries
    the mark itself; `launching.started` refuses one that does not (`pytest_runtest_setup`).

    For `make test`'s workers (pytest-xdist, `--dist loadfile`: a module runs whole on one worker, so its shared
    launches are made once): hand out the modules with the most launches first, so the long ones do not start last
    and leave the other worker idle. The order is the same in every worker, as xdist requires."""
    launches: dict[str, int] = {}
    for item in items:
        if "recipe_env" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.launch)
        launched = item.get_closest_marker("launch") is not None
        launches[item.module.__name__] = launches.get(item.module.__name__, 0) + launched
    items.sort(key=lambda item: -launches[item.module.__name__])  # stable: a module's tests keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures are set up (a session fixture starts its processes inside the first test that
    asks for it): only a test marked `launch` may start a Python process."""
    launching.allow_launches(item.get_closest_marker("launch") is not None)


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


@pytest.fixture
def forked_candidates(monkeypatch) -> None:
    """The candidate launches the planner starts from the test's own process go through the tests' zygote, as those
    of a planner started by `launching.run` do: the launcher and its ranks forked with their imports done. (The
    tests of how the planner ends a launch's process tree start it fresh: the zygote ends a killed stand-in's
    program itself.)"""
    import cram.plan.launch

    monkeypatch.setattr(cram.plan.launch, "accelerate_program",
                        lambda: launching.ZYGOTES.console_script("accelerate", dict(os.environ)))


@pytest.fixture(scope="session")
def distributed_cache(tmp_path_factory, cram_cache) -> Path:
    """The data cache of the 2-process runs and their reference: only the corpus's text at first, so the
    slowed-preparation launch prepares the set itself, and every other run then trains on the set it prepared."""
    cache = tmp_path_factory.mktemp("distributed-cache")
    shutil.copytree(cram_cache / "embedded", cache / "embedded")
    return cache


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory, recipe_env, distributed_cache) -> Callable[[str], launching.LaunchedRun]:
    """`two_process_run(name)` launches TWO_PROCESS_LAUNCHES[name] the first time it is asked for, then reuses it.

    The slowed-preparation launch always goes first: it must find the set unprepared."""
    launched: dict[str, launching.LaunchedRun] = {}

    def run(name: str) -> launching.LaunchedRun:
        if name not in launched:
            if not launching.TWO_PROCESS_LAUNCHES[name].slowed_preparation:
                run(launching.SLOWED_PREPARATION)
            launched[name] = launching.launch_two_processes(
                name, tmp_path_factory.mktemp(name), {**recipe_env, "CRAM_CACHE": str(distributed_cache)})
        return launched[name]

    return run


@pytest.fixture(scope="session")
def distributed_env(recipe_env, distributed_cache, two_process_run) -> dict[str, str]:
    """The environment of every other run compared with the 2-process runs: their data cache, once prepared."""
    two_process_run(launching.SLOWED_PREPARATION)
    return {**recipe_env, "CRAM_CACHE": str(distributed_cache)}


@pytest.fixture(scope="session")
def single_process_reference(tmp_path_factory, distributed_env) -> Path:
    """The 2-process runs' reference: one process, 16 sequences per micro-batch, the same global batch."""
    output_dir = tmp_path_factory.mktemp("single")
    command = [sys.executable, REPO / "recipes" / "cram.py", *launching.DISTRIBUTED_RUN, "--micro-batch-size", "16",
               "--output-dir", output_dir / "run"]
    completed = launching.run(command, env={**distributed_env, "TORCH_TRACE": str(output_dir / "compile-trace")})
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir / "run"
