"""The output layer and cross-entropy in chunks: the plain loss and gradients, eager and compiled, fp32 and bf16;
no fp32 logits of the whole batch kept for backward; checkpoints still plain GPTNeoXForCausalLM."""

import contextlib
import json

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

from cram.models import chunked_loss
from cram.models.chunked_loss import IGNORE_INDEX, linear_cross_entropy, rows_per_chunk
from cram.models.pythia_model import build_pythia_model, pythia_config

TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=2e-2, atol=2e-2)}


def autocast_for(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def relative(tensor: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = reference.abs().max() or 1.0  # gradients span orders of magnitude: compare relative to the largest
    return tensor.float() / scale, reference.float() / scale


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_chunked_loss_and_gradients_equal_the_plain_ones(precision):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = (torch.randn(300, 16, generator=generator) * 0.3).requires_grad_()
    targets = torch.randint(0, 300, (37,), generator=generator)
    targets[[3, 10, 11]] = IGNORE_INDEX
    assert rows_per_chunk(37, 300, 1000) == 4  # ten chunks, the last of one row
    with autocast_for(precision):
        loss_sum, count = linear_cross_entropy(hidden, weight, targets, logits_per_chunk=1000)
        expected = F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE_INDEX)
    assert loss_sum.dtype == torch.float32 and count.item() == 34
    torch.testing.assert_close(loss_sum / count, expected, **TOLERANCE[precision])
    grads = torch.autograd.grad(loss_sum / count * 3.0, [hidden, weight])  # any upstream gradient scales them
    expected_grads = torch.autograd.grad(expected * 3.0, [hidden, weight])
    for grad, reference in zip(grads, expected_grads, strict=True):
        assert grad.dtype == reference.dtype == torch.float32
        torch.testing.assert_close(*relative(grad, reference), **TOLERANCE[precision])
    with torch.no_grad(), autocast_for(precision):  # no gradients computed, the same loss
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, logits_per_chunk=1000)[0], loss_sum)


def tiny_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """cram's Pythia and transformers' GPTNeoXForCausalLM with the same weights."""
    config = pythia_config("pythia-14m", num_hidden_layers=2, vocab_size=512)
    torch.manual_seed(0)
    model = build_pythia_model("pythia-14m", config, device="cpu")
    plain = transformers.GPTNeoXForCausalLM(pythia_config("pythia-14m", num_hidden_layers=2, vocab_size=512))
    plain.load_state_dict(model.state_dict())
    return model, plain


def loss_and_grads(model: torch.nn.Module, inputs: dict, precision: str) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    with autocast_for(precision):
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {name.removeprefix("_orig_mod."): param.grad.clone()
                           for name, param in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pythia_s_chunked_loss_equals_transformers_loss_and_gradients(monkeypatch, precision, compiled):
    monkeypatch.setattr(chunked_loss, "LOGITS_PER_CHUNK", 512 * 24)  # 64 rows in three chunks
    model, plain = tiny_models()
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    cases = [  # as the recipe's batches come, already shifted; labels alone; an accumulated batch's count
        {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1], "shift_labels": tokens[:, 1:].contiguous()},
        {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1]},
        {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1], "num_items_in_batch": torch.tensor(100)},
    ]
    if compiled:  # the recipe's case only: each other one would be a second compilation
        cases = cases[:1]
        torch._dynamo.reset()
        # aot_eager: AOTAutograd traces forward and backward as inductor receives them, without C++ compilation.
        model = torch.compile(model, backend="aot_eager")
    for inputs in cases:
        loss, grads = loss_and_grads(model, inputs, precision)
        expected_loss, expected_grads = loss_and_grads(plain, inputs, precision)
        torch.testing.assert_close(loss, expected_loss, **TOLERANCE[precision])
        for name, reference in expected_grads.items():
            torch.testing.assert_close(*relative(grads[name], reference),
                                       **TOLERANCE[precision], msg=name)


def bytes_saved_per_logit(model: torch.nn.Module, batch: int, seq_len: int) -> int:
    """Bytes that one forward saves for backward in tensors with a vocabulary-sized dimension (parameters, which
    exist anyway, left out), counted by a saved-tensors hook on the meta device: shapes, no arithmetic."""
    vocab = model.config.vocab_size
    parameters = {id(param) for param in model.parameters()}
    saved = {}

    def record(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in parameters and vocab in tensor.shape:
            saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    tokens = torch.randint(0, vocab, (batch, seq_len + 1), device="meta")
    inputs = {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1], "shift_labels": tokens[:, 1:].contiguous()}
    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        model(**inputs)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pythia_14m_step_at_4_x_2048_keeps_no_logits_for_backward(dtype):
    config = pythia_config("pythia-14m")
    with torch.device("meta"):
        plain = transformers.GPTNeoXForCausalLM(pythia_config("pythia-14m")).to(dtype)
    model = build_pythia_model("pythia-14m", config, device="meta").to(dtype)
    fp32_logits = 4 * 2048 * config.vocab_size * 4
    assert bytes_saved_per_logit(plain, 4, 2048) >= fp32_logits  # what the plain loss keeps
    # Only the output layer's weight gradient, fp32, of vocabulary x width: about 1.6 % of the logits here.
    assert bytes_saved_per_logit(model, 4, 2048) == config.vocab_size * config.hidden_size * 4


def test_a_saved_model_is_transformers_plain_gpt_neox(tmp_path):
    model, plain = tiny_models()
    model.save_pretrained(tmp_path)
    plain.save_pretrained(tmp_path / "plain")
    # The same file: transformers' names for the weights (its own class's conventions), the same values.
    assert safetensors.torch.load_file(tmp_path / "model.safetensors").keys() \
        == safetensors.torch.load_file(tmp_path / "plain" / "model.safetensors").keys()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["GPTNeoXForCausalLM"] and "attn_implementation" not in saved
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is transformers.GPTNeoXForCausalLM and loaded.config._attn_implementation == "sdpa"
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits)


def fp16_gradients(chunked: bool, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   loss_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of hidden and weight (fp32 leaves, as under mixed precision) of the mean cross-entropy times
    `loss_scale`, with the products in fp16 under autocast: the chunked loss or the plain one."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        if chunked:
            loss_sum, count = linear_cross_entropy(hidden, weight, targets)
            loss = loss_sum / count
        else:
            loss = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    (loss * loss_scale).backward()
    return hidden.grad, weight.grad


def all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)


def test_fp16_chunked_loss_survives_an_outlier_channel_once_the_scale_backs_off():
    # 1,300 rows of one frequent target along a hidden channel of 52: the weight gradient's row for that target
    # sums past fp16's 65504 before any loss scale applies, unless its product is written in fp32.
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1300, 16, generator=generator) * 0.5
    hidden[:, 0] = 52.0
    weight = torch.randn(64, 16, generator=generator) * 0.02
    targets = torch.full((1300,), 7)
    scales = [2.0**power for power in range(16, -1, -2)]
    plain = [all_finite(*fp16_gradients(False, hidden, weight, targets, scale)) for scale in scales]
    assert plain[0] is False and plain[scales.index(2.0**8):] == [True] * 5  # the case: a GradScaler backs off
    for scale, plain_finite in zip(scales, plain, strict=True):
        assert all_finite(*fp16_gradients(True, hidden, weight, targets, scale)) or not plain_finite, scale
    # and what it gives is the plain gradient
    for got, expected in zip(fp16_gradients(True, hidden, weight, targets, 1.0),
                             fp16_gradients(False, hidden, weight, targets, 1.0), strict=True):
        torch.testing.assert_close(*relative(got, expected), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("loss_scale", [1.0, 2.0**8, 2.0**16])
def test_fp16_chunked_gradients_underflow_no_sooner_than_the_plain_loss_s(loss_scale):
    # A confident target (a logit gap of 20): the other tokens' probabilities, about 4e-9, are below fp16's
    # smallest subnormal unless a scale carries them.
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1300, 16, generator=generator)
    hidden[:, 0] = 4.0
    weight = torch.randn(64, 16, generator=generator) * 0.02
    weight[7, 0] = 5.0
    targets = torch.full((1300,), 7)
    reference = fp16_gradients(False, hidden.double(), weight.double(), targets, 1.0)  # autocast leaves fp64 be
    plain = fp16_gradients(False, hidden, weight, targets, loss_scale)
    chunked = fp16_gradients(True, hidden, weight, targets, loss_scale)
    for name, got, plain_grad, expected in zip(("hidden", "weight"), chunked, plain, reference, strict=True):
        lost = ((got == 0) & (expected != 0)).sum()
        plain_lost = ((plain_grad == 0) & (expected != 0)).sum()
        assert lost <= plain_lost, (name, lost, plain_lost)
    if loss_scale == 1.0:  # the case: the plain loss does lose them here
        assert ((plain[1] == 0) & (reference[1] != 0)).sum() > 0
