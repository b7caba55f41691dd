"""The planner's pure parts: the candidate space and its rules, the micro-batch search against a known memory
budget, the memory model's orderings, the cost formula, the emitted configs, and bad input."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launching import load_recipe, run

from cram.errors import UserError
from cram.plan import sweep as sweep_module
from cram.plan.cost import GPUS, amortised_cost, hardware_price, parse_target, project
from cram.plan.launch import launch_probe
from cram.plan.models import count_parameters, model_config
from cram.plan.peak_memory import Shape, predicted_bytes, seed_micro_batch, state_bytes
from cram.plan.pick import recipe_command_parts, report_projection
from cram.plan.probe import probe_once
from cram.plan.search import Probe, divisors, judge_probe, largest_micro_batch
from cram.plan.setting import Setting
from cram.plan.space import Candidate, candidate_space, select_candidates
from cram.plan.sweep import sweep
from cram.plan.sweep_length import LaunchLimits
from cram.plan.timing import MemoryGauge

REPO = Path(__file__).resolve().parents[1]


def test_space_has_22_candidates_on_several_devices_and_12_on_one():
    several, one = candidate_space(4), candidate_space(1)
    assert len(several) == 22 and len(one) == 12
    assert len({candidate.name for candidate in several}) == 22
    assert not any(candidate.offload and candidate.sharding == "none" for candidate in several)
    # On one device sharding without offload is a no-op: only plain and offloaded variants remain.
    assert {candidate.name for candidate in one if not candidate.checkpointing} == {
        "ddp", "zero1-offload", "zero2-offload", "zero3-offload", "fsdp-grad-op-offload", "fsdp-full-offload"}
    # 8-bit Adam is an extra axis: it doubles the space.
    assert len(candidate_space(2, ("adamw", "adamw-8bit"))) == 44


def test_candidates_are_selected_by_name_and_unknown_names_are_refused():
    space = candidate_space(2)
    assert [c.name for c in select_candidates(space, ["zero2-offload", "zero1"])] == ["zero1", "zero2-offload"]
    with pytest.raises(UserError, match="zero1-offload-typo"):
        select_candidates(space, ["zero1-offload-typo"])


def linear_memory(fixed: int, per_sequence: int, limit: int, calls: list[int]):
    def try_size(size: int) -> Probe:
        calls.append(size)
        used = fixed + per_sequence * size
        return Probe(size, used <= limit, used, None if used <= limit else "over the limit")
    return try_size


@pytest.mark.parametrize("seed", [1, 2, 16, 64, 1000])
@pytest.mark.parametrize("limit, expected", [(1000 + 37 * 100, 37), (1000 + 100, 1), (1000 + 64 * 100, 64),
                                             (1000 + 99, 0)])
def test_search_finds_the_exact_limit_of_a_memory_budget(seed, limit, expected):
    calls: list[int] = []
    result = largest_micro_batch(linear_memory(1000, 100, limit, calls), seed=seed, ceiling=512)
    assert result.largest == expected
    if expected:
        assert expected in calls and expected + 1 in calls  # the answer fits and the next size up was refused
    assert len(calls) == len(set(calls)) and len(calls) <= 2 * 10 + 2  # doubling then bisection: logarithmic
    if expected == 0:
        assert result.failure == "over the limit"


def probe_on_a_gpu(monkeypatch, peak_gib: float, outside_gib: float, limit_gib: float = 80.0) -> Probe:
    """`probe_once`'s verdict on an 80 GiB GPU (its queries answered here) whose allocator peaked at `peak_gib`
    while `outside_gib` more were held outside it (context, communicators)."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: peak_gib * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: ((80 - peak_gib - outside_gib) * gib, 80 * gib))
    gauge = MemoryGauge(torch.device("cuda"))
    monkeypatch.setattr(gauge, "reset", lambda: None)
    monkeypatch.setattr(gauge, "peak", lambda: peak_gib * gib)
    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"), is_main_process=True,
                                  wait_for_everyone=lambda: None)
    run = SimpleNamespace(request={}, accelerator=accelerator, steps=lambda *_: None, release=lambda: None)
    return probe_once(run, gauge, 8, limit_gib * gib)


def test_a_probe_fits_only_under_the_gpus_memory_less_what_lives_outside_the_allocator(monkeypatch):
    assert probe_on_a_gpu(monkeypatch, peak_gib=78.0, outside_gib=1.5).fits
    tight = probe_on_a_gpu(monkeypatch, peak_gib=79.0, outside_gib=1.5)
    assert not tight.fits and tight.reason == ("79.00 GiB > 78.50 GiB limit (80.00 GiB less 1.50 GiB outside "
                                               "PyTorch's allocator: CUDA context, communicator buffers)")
    assert probe_on_a_gpu(monkeypatch, peak_gib=79.0, outside_gib=0.0).fits
    # A --memory-limit below what the headroom leaves is the binding one, said as before.
    assert probe_on_a_gpu(monkeypatch, peak_gib=79.0, outside_gib=1.5, limit_gib=60.0).reason == (
        "79.00 GiB > 60.00 GiB limit")
    # On the CPU the limit alone decides: there is no device memory outside it.
    assert judge_probe(8, 79 * 2**30, 80 * 2**30).fits


def test_search_stops_at_the_ceiling_and_a_seed_near_the_limit_saves_probes():
    calls: list[int] = []
    assert largest_micro_batch(linear_memory(0, 1, 10**9, calls), seed=4, ceiling=24).largest == 24
    from_one, near = [], []
    largest_micro_batch(linear_memory(1000, 100, 1000 + 300 * 100, from_one), seed=1, ceiling=4096)
    largest_micro_batch(linear_memory(1000, 100, 1000 + 300 * 100, near), seed=256, ceiling=4096)
    assert len(near) < len(from_one)
    # Over the divisors of a process's share only: 37 fits, so 32 is the answer, found without probing 33..37.
    calls = []
    assert largest_micro_batch(linear_memory(0, 1, 37, calls), seed=4, sizes=divisors(64)).largest == 32
    assert calls == [4, 8, 16, 32, 64] and divisors(12) == [1, 2, 3, 4, 6, 12]


def test_the_seed_is_a_power_of_two_at_or_below_the_predicted_limit():
    shape = Shape.of(model_config("pythia-1b", 2048), 2048, 4, on_cpu=False, activation_bytes=2)
    limit = predicted_bytes(Candidate("zero1"), shape, 12)
    assert seed_micro_batch(Candidate("zero1"), shape, limit) == 8
    on_cpu = Shape.of(model_config("pythia-1b", 2048), 2048, 4, on_cpu=True, activation_bytes=2)
    # On the CPU what offload moves stays in the one memory, with its staging buffers: it saves nothing there.
    assert state_bytes(Candidate("zero2", offload=True), on_cpu) >= state_bytes(Candidate("zero2"), on_cpu)


def test_cost_follows_the_published_amortisation_and_projection_scales_with_peak_and_count():
    count, a100 = parse_target("4xa100")
    price = hardware_price(count, a100)
    assert price == 4 * 19_000 + 7_500
    assert amortised_cost(price, 17.57) == pytest.approx(price * 17.57 / (5 * 365))
    assert hardware_price(1, next(gpu for gpu in GPUS if gpu.key == "4090")) is None  # no price in the table
    _, h100 = parse_target("8xh100")
    projection = project(0.4, 2_097_152, 6e9, 143_000, 8, h100, "4 × A100")
    assert projection.step_seconds == pytest.approx(2_097_152 * 6e9 / (0.4 * 8 * 989e12))
    assert projection.days == pytest.approx(143_000 * projection.step_seconds / 86_400)
    assert any("measured on 4 × A100" in line for line in projection.assumptions)
    for bad in ("8xh1000", "h100", "0xh100"):
        with pytest.raises(UserError, match="e.g. 8xh100"):
            parse_target(bad)


def test_pythia_table_gives_the_released_parameter_counts():
    assert count_parameters(model_config("pythia-1b", 2048)) == 1_011_781_632


@pytest.fixture(scope="module")
def plan_recipe():
    """recipes/plan.py as a module, so bad input is checked in-process (one subprocess test checks the exit)."""
    return load_recipe(REPO / "recipes" / "plan.py", "plan_recipe")


@pytest.mark.parametrize("arguments, env, message", [
    (["--model", "crammed-bert-tiny", "--global-batch-size", "33"], {"WORLD_SIZE": "2"},
     "not divisible by the 2 processes"),
    (["--model", "crammed-bert-tiny", "--target", "8xh1000"], {}, "unknown --target"),
    (["--model", "crammed-bert-tiny", "--target", "8xh100"], {}, "CPU has no peak throughput in the GPU table"),
    (["--model", "pythia-1b", "--memory-limit", "1GiB"], {}, "not even micro-batch 1 of the leanest candidate"),
    (["--model", "crammed-bert-tiny", "--memory-limit", "lots"], {}, "cannot read the memory size"),
    (["--model", "crammed-bert-tiny", "--candidates", "zero1"], {}, "unknown or invalid candidate"),
    (["--model", "pythia-14m", "--checkpoint-every-minutes", "-5"], {}, "cannot be negative"),
    (["--model", "pythia-14m", "--num-workers", "-1"], {}, "cannot be negative"),
    (["--model", "pythia-14m", "--candidate-timeout", "0"], {}, "--candidate-timeout must be positive"),
])
def test_bad_input_is_refused_before_anything_runs(plan_recipe, monkeypatch, tmp_path, arguments, env, message):
    monkeypatch.setattr(sys, "argv", ["plan.py", *arguments, "--output-dir", str(tmp_path / "out")])
    for name, value in env.items():  # a process count is a launch fact: set as the launcher would
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=message):
        plan_recipe.main()
    assert not (tmp_path / "out").exists()


def test_a_dry_run_says_the_sweep_and_each_launchs_limit_and_launches_nothing(plan_recipe, monkeypatch, tmp_path,
                                                                               capsys):
    monkeypatch.setattr(sys, "argv", ["plan.py", "--model", "crammed-bert-tiny", "--global-batch-size", "8",
                                      "--candidates", "ddp,zero2-offload", "--dry-run",
                                      "--output-dir", str(tmp_path / "out")])
    monkeypatch.setattr(sweep_module, "search_and_time", lambda *_: pytest.fail("a dry run launched a candidate"))
    plan_recipe.main()
    said = capsys.readouterr().out
    assert "sweep: 2 candidate(s) to launch" in said and "s per build" in said and "s per save" in said
    assert "a candidate's launch may take" in said and "(3 × its predicted time" in said
    assert not (tmp_path / "out").exists()


@pytest.mark.launch
def test_an_unknown_model_gets_one_sentence_and_exit_status_2(tmp_path):
    command = [sys.executable, REPO / "recipes" / "plan.py", "--model", "pythia-7b", "--output-dir", tmp_path / "out"]
    completed = run(command, timeout=300)
    assert completed.returncode == 2
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr[-2000:]
    assert lines[0].startswith("error: argument --model: invalid choice: 'pythia-7b'"), lines[0]
    assert not (tmp_path / "out").exists()


def test_candidates_that_cannot_run_are_rows_with_reasons_not_crashes(tmp_path):
    config = model_config("crammed-bert-tiny", 128)
    shape = Shape.of(config, 128, 2, on_cpu=True, activation_bytes=4)
    setting = Setting("crammed-bert-tiny", 128, 16, 2, True, "CPU", 2**20, 1, 2)
    rows = sweep([Candidate("zero1"), Candidate("fsdp-full"), Candidate("zero2", True, False, "adamw-8bit")],
                 setting, shape, 2**20, tmp_path, "CrammedBertLayer", LaunchLimits.fixed(60),
                 say=lambda _: None)
    assert [row["status"] for row in rows] == ["infeasible"] * 3
    assert rows[0]["source"] == "memory model" and "GiB at micro-batch 1 > 0.00 GiB limit" in rows[0]["reason"]
    assert rows[1]["source"] == "rules" and "FSDP needs GPUs" in rows[1]["reason"]
    assert rows[2]["source"] == "rules" and "8-bit" in rows[2]["reason"]


def test_a_launch_that_fails_is_a_failed_row_with_its_last_error_not_out_of_memory(tmp_path, forked_candidates):
    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: NOT_A_TYPE\nnum_processes: 1\n")
    request = {"result": str(tmp_path / "result.json")}
    row = launch_probe(broken, request, tmp_path / "request.json", timeout=300)
    assert row["status"] == "error" and row["reason"].startswith("the launch exited with status")
    assert "NOT_A_TYPE" in row["reason"] or "Error" in row["reason"], row


def test_a_projection_is_labelled_and_prints_its_assumptions(capsys):
    # A winner as measured on 4 A100s (device facts this machine cannot produce): 2.1 M tokens per 10 s step.
    winner = {"mfu": 0.35, "tokens_per_second": 2_097_152 / 10.0, "step_time": {"median": 10.0},
              "flops_per_token": 6.5e9}
    projection = report_projection("8xh100", winner, 143_000, "NVIDIA A100-SXM4-80GB")
    printed = capsys.readouterr().out
    assert projection["label"] == "projection" and "PROJECTION (not measured) to 8 × h100" in printed
    assert projection["step_seconds"] == pytest.approx(2_097_152 * 6.5e9 / (0.35 * 8 * 989e12))
    assert len(projection["assumptions"]) == 4 and all(line in printed for line in projection["assumptions"])
    assert "saves are left out of the projected days" in projection["assumptions"][-1]
    assert projection["cost_usd"] == pytest.approx((8 * 30_000 + 10_500) * projection["days"] / (5 * 365))


def test_the_printed_command_uses_each_recipes_own_flags():
    from cram.plan.emit import recipe_flags

    zero1_ckpt = Candidate("zero1", checkpointing=True)
    assert recipe_flags(zero1_ckpt, 16, 1024, causal=True) == [
        "--micro-batch-size 16", "--global-batch-size 1024", "--activation-checkpointing"]
    assert recipe_flags(Candidate(optimizer="adamw-8bit"), 32, 8192, causal=False) == [
        "--micro-batch-size 32", "--target-batch-size 8192", "--optimizer adamw-8bit"]
    assert recipe_command_parts("pythia-1b") == ("recipes/pythia.py", ["--size pythia-1b", "--data DATA"])
    assert recipe_command_parts("crammed-bert") == ("recipes/cram.py", ["--preset crammed-bert"])
