"""`--compile auto`: compile only where it helps (docs/benchmarks.md: torch.compile on the CPU), and record why in
the resolved options; `--compile MODE`: torch.compile's modes, handed to the compiler and recorded beside the run's
throughput."""

import dataclasses

import pytest
import torch

import cram.train.accelerator
from cram.errors import UserError
from cram.train.compilation import COMPILE_MODES, compile_reason, resolve_compile, resolve_compile_mode
from cram.train.run import RecipeRun
from cram.train.run_options import RunOptions


def test_auto_leaves_the_cpu_eager_and_says_why():
    assert resolve_compile("auto", "cpu") is False
    assert "CPU" in compile_reason("auto", "cpu") and "matrix products" in compile_reason("auto", "cpu")


@pytest.mark.parametrize("capability, compiled", [((6, 1), False), ((7, 0), True), ((9, 0), True)])
def test_auto_compiles_on_gpus_triton_supports(monkeypatch, capability, compiled):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    assert resolve_compile("auto", "cuda") is compiled
    assert f"{capability[0]}.{capability[1]}" in compile_reason("auto", "cuda")


@pytest.mark.parametrize("choice", ["true", "false"])
def test_an_explicit_choice_wins_and_is_named_as_the_reason(choice):
    for device_type in ("cpu", "cuda"):
        assert resolve_compile(choice, device_type) is (choice == "true")
        assert compile_reason(choice, device_type) == f"--compile {choice} asked for it"


def test_an_unknown_choice_is_refused_in_one_sentence():
    with pytest.raises(UserError, match="choose one of auto, true, false, default, reduce-overhead, max-autotune"):
        compile_reason("yes", "cpu")


@pytest.mark.parametrize("choice", COMPILE_MODES)
def test_a_mode_compiles_in_that_mode_on_any_device(choice):
    for device_type in ("cpu", "cuda"):
        assert resolve_compile_mode(choice, device_type) == choice
        assert compile_reason(choice, device_type) == f"--compile {choice} asked for it"
    assert resolve_compile_mode("true", "cpu") == "default" and resolve_compile_mode("false", "cuda") is None


@dataclasses.dataclass
class Training:
    max_steps: int = 1


def test_the_resolved_options_record_the_choice_and_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cram.train.accelerator, "launch_device_type", lambda: "cpu")
    run = RecipeRun("cram", RunOptions(output_dir=str(tmp_path), precision="fp32", compile="auto"))
    model = torch.nn.Linear(2, 2)
    session = run.start(model, torch.optim.SGD(model.parameters(), lr=0.1), Training(), facts={}, resolved={})
    resolved = session.resolved["resolved"]
    assert resolved["compile"] is False and resolved["compile_mode"] is None
    assert resolved["compile_reason"] == compile_reason("auto", "cpu")


def test_the_mode_reaches_torch_compile_and_the_resolved_options(tmp_path, monkeypatch):
    # Accelerate's prepare hands torch.compile the plugin's keywords: the mode asked for is the one compiled in.
    monkeypatch.setattr(cram.train.accelerator, "launch_device_type", lambda: "cpu")
    asked: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda model, **options: asked.append(options) or model)
    run = RecipeRun("cram", RunOptions(output_dir=str(tmp_path), precision="fp32", compile="max-autotune"))
    model = torch.nn.Linear(2, 2)
    session = run.start(model, torch.optim.SGD(model.parameters(), lr=0.1), Training(), facts={}, resolved={})
    assert [options["mode"] for options in asked] == ["max-autotune"]
    resolved = session.resolved["resolved"]
    assert resolved["compile"] is True and resolved["compile_mode"] == "max-autotune"
    assert resolved["compile_reason"] == "--compile max-autotune asked for it"
