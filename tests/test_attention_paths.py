"""Crammed BERT's attention paths: each gives the reference outputs and gradients; the masked-only loss."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from cram.models import crammed_bert
from cram.models.crammed_bert import (
    ATTENTION_PATHS,
    IGNORE_INDEX,
    CrammedBertConfig,
    CrammedBertForMaskedLM,
    attention_path_for,
)


def tiny_model(path: str | None) -> CrammedBertForMaskedLM:
    torch.manual_seed(0)
    config = CrammedBertConfig.from_preset(
        "tiny", vocab_size=512, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    model = CrammedBertForMaskedLM(config)
    model.set_attention_path(path)
    return model


def batch(with_padding: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 512, (3, 32), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if with_padding:
        attention_mask[1, 20:] = 0
        attention_mask[2, 9:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def logits_and_grads(model: CrammedBertForMaskedLM, inputs: dict, precision: str) -> tuple[torch.Tensor, dict]:
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with autocast:
        logits = model(**inputs).logits
    keep = inputs["attention_mask"].bool()
    logits[keep].float().pow(2).mean().backward()  # padded positions' outputs are not defined by either path
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return logits[keep].double().detach(), grads


@pytest.mark.parametrize("with_padding", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("path", [*ATTENTION_PATHS, None])  # None: the path chosen for this device and precision
def test_each_attention_path_gives_the_reference_outputs_and_gradients(path, precision, with_padding):
    inputs = batch(with_padding)
    # The reference: SDPA in float64, which runs its math backend, free of rounding in the model and the kernel.
    reference_logits, reference_grads = logits_and_grads(tiny_model("sdpa").double(), inputs, "fp32")
    logits, grads = logits_and_grads(tiny_model(path), inputs, precision)
    tolerance = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(logits, reference_logits, **tolerance)
    for name, grad in grads.items():
        reference = reference_grads[name]
        scale = reference.abs().max().item() or 1.0  # gradients span orders of magnitude: compare relative to each
        torch.testing.assert_close(grad.double() / scale, reference / scale, **tolerance, msg=name)


def test_the_path_is_chosen_by_device_and_precision(monkeypatch):
    for has_units in (False, True):
        monkeypatch.setattr(crammed_bert, "CPU_HAS_BF16_UNITS", has_units)
        assert attention_path_for("cuda", low_precision=True) == "sdpa"
        assert attention_path_for("cuda", low_precision=False) == "sdpa"
        assert attention_path_for("cpu", low_precision=False) == "sdpa"
        assert attention_path_for("cpu", low_precision=True) == ("plain" if has_units else "sdpa")


def test_the_layers_run_the_chosen_path(monkeypatch):
    calls = []
    monkeypatch.setattr(crammed_bert, "plain_attention", lambda *args: calls.append("plain") or torch.zeros(
        args[0].shape))
    model = tiny_model(None)
    monkeypatch.setattr(crammed_bert, "CPU_HAS_BF16_UNITS", True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch(False))
    assert calls == ["plain"] * model.config.num_hidden_layers
    calls.clear()
    model(**batch(False))  # fp32 on this CPU: SDPA
    assert calls == []
    model.set_attention_path("plain")
    model(**batch(False))
    assert calls == ["plain"] * model.config.num_hidden_layers


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="sdpa, plain"):
        tiny_model("flash")


@pytest.mark.parametrize("num_items_in_batch", [None, 40])
def test_the_loss_over_masked_positions_equals_dense_cross_entropy_on_the_same_logits(num_items_in_batch):
    model = tiny_model(None)
    inputs = batch(False)
    labels = torch.full_like(inputs["input_ids"], IGNORE_INDEX)
    generator = torch.Generator().manual_seed(2)
    masked = torch.rand(labels.shape, generator=generator) < 0.25
    labels[masked] = inputs["input_ids"][masked]
    output = model(**inputs, labels=labels, num_items_in_batch=num_items_in_batch)
    dense_logits = model(**inputs).logits  # every position, no labels
    dense = F.cross_entropy(dense_logits.reshape(-1, dense_logits.shape[-1]), labels.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    expected = dense / (masked.sum() if num_items_in_batch is None else num_items_in_batch)
    torch.testing.assert_close(output.loss, expected)
    torch.testing.assert_close(output.logits, dense_logits[masked])  # the masked rows, in order
