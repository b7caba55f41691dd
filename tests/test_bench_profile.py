"""`make bench`'s profile table and its `--original` check."""

import re

import pytest
import torch

from cram.bench import train_step
from cram.bench.train_step import original_crammed_bert, top_ops


def test_top_ops_lists_a_steps_most_expensive_operators_first():
    weight = torch.randn(256, 256, requires_grad=True)

    def step() -> float:
        loss = (torch.randn(64, 256) @ weight).relu().sum()
        loss.backward()
        return loss.item()

    operators = top_ops(step, 3)
    assert len(operators) == 3
    names = [name for name, _, _ in operators]
    assert "aten::mm" in names  # the forward and backward matmuls dominate this step
    times = [milliseconds for _, milliseconds, _ in operators]
    assert times == sorted(times, reverse=True) and all(calls >= 1 for _, _, calls in operators)


def test_original_needs_a_cramming_checkout(tmp_path):
    with pytest.raises(SystemExit, match="checkout of github.com/JonasGeiping/cramming"):
        original_crammed_bert(tmp_path, layers=1, hidden=64, heads=2, vocab=128, seq_len=16)


@pytest.mark.parametrize("has_units", [True, False])
def test_the_bench_times_bf16_on_the_cpu_only_where_it_has_bf16_units(monkeypatch, capsys, has_units):
    monkeypatch.setattr(train_step, "cpu_has_bf16_units", lambda: has_units)
    precisions = train_step.default_precisions(torch.device("cpu"))
    assert precisions == (["fp32", "bf16"] if has_units else ["fp32"])
    assert ("bf16 left out" in capsys.readouterr().out) is not has_units


def test_the_bench_runs_whole_steps_of_both_models_at_a_small_shape(capsys):
    # cram's collator gives each batch its masked count as a plain int beside the tensors: the step moves the tensors
    # to the device and hands the count on, so crammed BERT predicts the masked positions only.
    train_step.main(["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "256", "--seq-len", "16",
                     "--batch", "2", "--warmup", "1", "--steps", "1", "--precision", "fp32", "--profile-ops", "1"])
    table = capsys.readouterr().out
    for model in ("crammed BERT", "HF BertForMaskedLM"):
        assert re.search(rf"^\| fp32 \| {model} \| [\d.]+ ± [\d.]+ \| [\d,]+ \| [\d.]+x \|$", table, re.M), table
    assert "Top operators of one profiled step" in table
