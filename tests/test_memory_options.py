"""Memory options: bitsandbytes' 8-bit AdamW and activation checkpointing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from launching import run

from cram.data.collator import MaskedLMCollator
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.train.activation_checkpointing import enable_activation_checkpointing
from cram.train.optim import build_adamw

REPO = Path(__file__).resolve().parents[1]


def tiny_model() -> CrammedBertForMaskedLM:
    torch.manual_seed(0)
    config = CrammedBertConfig.from_preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return CrammedBertForMaskedLM(config)


def batch(size: int = 8) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(5, 8192, (size, 128), generator=torch.Generator().manual_seed(1))
    return MaskedLMCollator(4, 8192, [0, 1, 2, 3, 4])({"input_ids": input_ids, "serials": torch.arange(size)})


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


def test_eight_bit_adamw_trains_with_a_quarter_of_the_optimizer_state():
    model = tiny_model()
    optimizer = build_adamw(model, 1e-3, (0.9, 0.98), 1e-12, 0.01, eight_bit=True)
    import bitsandbytes  # here, not at the top: the module's other tests run in the floors' base install too

    assert isinstance(optimizer, bitsandbytes.optim.AdamW8bit)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.01, 0.0]
    inputs = batch()
    losses = []
    for _ in range(5):
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    reference = tiny_model()
    reference(**inputs).loss.backward()
    full = build_adamw(reference, 1e-3, (0.9, 0.98), 1e-12, 0.01)
    full.step()
    # Both moments in 8 bits for the large matrices: well under half the 32-bit state.
    assert state_bytes(optimizer) < 0.4 * state_bytes(full)


def test_activation_checkpointing_recomputes_layers_and_leaves_the_gradients_unchanged():
    inputs = batch(4)
    plain, checkpointed = tiny_model(), tiny_model()
    enable_activation_checkpointing(checkpointed)
    calls = []
    # A pre-hook: the recomputation stops as soon as the saved tensors are rebuilt, before the FFN returns.
    checkpointed.bert.layers[0].ffn.register_forward_pre_hook(lambda *_: calls.append(1))
    plain(**inputs).loss.backward()
    checkpointed(**inputs).loss.backward()
    assert len(calls) == 2  # once forward, once again in the backward pass
    for (name, mine), theirs in zip(checkpointed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, msg=name)


@pytest.mark.slow
def test_the_recipe_trains_with_both_memory_options(tmp_path, recipe_env):
    # Also a time-based checkpoint interval far shorter than a step: a state falls due after every step.
    command = [sys.executable, REPO / "recipes" / "cram.py", "--preset", "tiny", "--max-steps", "3",
               "--micro-batch-size", "8", "--target-batch-size", "16", "--optimizer", "adamw-8bit",
               "--activation-checkpointing", "true", "--checkpoint-every-minutes", "0.00001",
               "--output-dir", tmp_path / "run"]
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["optimizer_steps"] == 3 and summary["final_loss"] < summary["first_loss"]
    # The run's own optimizer state, against the 8 bytes per parameter of 32-bit AdamW's two moments.
    assert summary["optimizer_state_bytes_held_by_rank0"] < 0.4 * 8 * summary["parameters"]
    saved = sorted(path.name for path in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step-00000002", "step-00000003"]  # one per step, the newest 2 kept
