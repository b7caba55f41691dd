"""Crammed BERT's attention paths: each gives the reference outputs and gradients; the masked-only loss. Pythia's
attention: SDPA's causal kernel with no mask tensor, eager and compiled, on every transformers the floors admit."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.overrides import TorchFunctionMode
from transformers import masking_utils
from transformers.utils.import_utils import is_tracing

from cram.models import crammed_bert
from cram.models.crammed_bert import (
    ATTENTION_PATHS,
    IGNORE_INDEX,
    CrammedBertConfig,
    CrammedBertForMaskedLM,
    attention_path_for,
)
from cram.models.pythia_model import build_pythia_model, pythia_config
from cram.train.activation_checkpointing import enable_activation_checkpointing


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
    model = tiny_model(None).eval()  # evaluating: `logits` has exactly the masked rows (training pads to a count)
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


def tiny_pythia(checkpointing: bool = False) -> transformers.GPTNeoXForCausalLM:
    torch.manual_seed(0)
    model = build_pythia_model("pythia-14m", pythia_config("pythia-14m", num_hidden_layers=2, vocab_size=512),
                               device="cpu")
    if checkpointing:  # as `--activation-checkpointing` and the planner's -ckpt candidates set it
        enable_activation_checkpointing(model)
    return model


def plain_pythia(checkpointing: bool = False) -> transformers.GPTNeoXForCausalLM:
    """transformers' own GPTNeoXForCausalLM, on its "sdpa" attention."""
    model = transformers.GPTNeoXForCausalLM(pythia_config("pythia-14m", num_hidden_layers=2, vocab_size=512))
    if checkpointing:
        enable_activation_checkpointing(model)
    return model


def pythia_batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(3))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1], "shift_labels": tokens[:, 1:].contiguous()}


def sdpa_call(args: tuple, kwargs: dict) -> dict:
    """The mask and causal flag of one scaled_dot_product_attention call, however its arguments were passed."""
    attn_mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    is_causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
    return {"has_mask": attn_mask is not None, "is_causal": is_causal}


# Tensor methods that read a device value on the host: on a GPU, each waits for the device (a sync).
HOST_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero"}


class SdpaCalls(TorchFunctionMode):
    """Records every eager call of F.scaled_dot_product_attention, and every read of a tensor's value by the
    host."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.host_reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append(sdpa_call(args, kwargs))
        elif getattr(func, "__name__", None) in HOST_READS:
            self.host_reads.append(func.__name__)
        return func(*args, **kwargs)


def compiled_sdpa_calls(model: torch.nn.Module, inputs: dict) -> list[dict]:
    """The SDPA calls in the graphs torch.compile traces for `model(**inputs)`, found by a backend that reads each
    FX graph and every graph nested in it (an activation checkpoint's layer is a subgraph that the top-level
    graph calls through a higher-order op), then runs it as traced."""
    calls = []

    def inspecting_backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> callable:
        for module in graph_module.modules():  # the graph itself and its subgraphs
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
                        calls.append(sdpa_call(node.args, node.kwargs))
        return graph_module.forward

    torch._dynamo.reset()
    outputs = torch.compile(model, backend=inspecting_backend)(**inputs)
    (outputs.loss if outputs.loss is not None else outputs.logits.float().mean()).backward()
    return calls


MASK_FREE_CAUSAL = {"has_mask": False, "is_causal": True}
WITH_MASK = {"has_mask": True, "is_causal": False}


def ignore_causal_mask_sdpa_5_17(padding_mask, q_length, kv_length, q_offset, kv_offset,
                                 local_attention_size=None) -> bool:
    """transformers v5.17.0's `_ignore_causal_mask_sdpa` (src/transformers/masking_utils.py), step for step: it
    never skips the mask while anything traces (`is_tracing(padding_mask)` is true under torch.compile even with
    no padding mask), where 5.24 skips it there unless it would have to read the padding mask's values."""
    if padding_mask is not None and padding_mask.shape[-1] > kv_length:
        padding_mask = padding_mask[:, torch.arange(kv_length, device=padding_mask.device) + kv_offset]
    if is_tracing(padding_mask):
        return False
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False
    if (q_length == 1 or kv_length == q_length) and (padding_mask is None or masking_utils.fast_all(padding_mask)):
        return True
    return q_offset == 0 and (padding_mask is None or (masking_utils.fast_all(padding_mask[:, :q_length])
                                                       and masking_utils.fast_all(~padding_mask[:, q_length:])))


@pytest.fixture(params=["as installed", "5.17"])
def transformers_masking(request, monkeypatch) -> str:
    """transformers' mask code as installed, and as in 5.17 (a GPU image's release). Between 5.17 and this stack's
    5.24 the mask code differs, on every path GPT-NeoX takes, only in `_ignore_causal_mask_sdpa` (the rest is
    renamed arguments): 5.17's builds the full causal mask whenever torch.compile traces, so without the stand-in
    the suite would not see that case. Checked against real 5.0 and 5.17 installs as well (docs/pythia.md)."""
    if request.param == "5.17":
        monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", ignore_causal_mask_sdpa_5_17)
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize(("transformers_masking", "checkpointing"), [
    ("as installed", False), ("as installed", True),
    ("5.17", False),  # checkpointed, cram's model reaches no mask code, and transformers' mask is the same in 5.17
], ids=["whole", "checkpointed", "whole-5.17"], indirect=["transformers_masking"])
def test_compiled_pythia_calls_sdpa_causal_with_no_mask_tensor(transformers_masking, checkpointing):
    model = tiny_pythia(checkpointing)
    assert compiled_sdpa_calls(model, pythia_batch()) == [MASK_FREE_CAUSAL] * model.config.num_hidden_layers
    if transformers_masking == "5.17":
        # Without labels, through transformers' model and `CAUSAL_SDPA`'s mask function: no mask either.
        logits_only = {"input_ids": pythia_batch()["input_ids"]}
        assert compiled_sdpa_calls(model, logits_only) == [MASK_FREE_CAUSAL] * model.config.num_hidden_layers
        # The stand-in does bring the mask to transformers' own model.
        assert compiled_sdpa_calls(plain_pythia(), pythia_batch())[0] == WITH_MASK


@pytest.mark.parametrize("checkpointing", [False, True], ids=["whole", "checkpointed"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_eager_pythia_calls_sdpa_causal_with_no_mask_tensor_nor_host_reads(precision, checkpointing):
    model = tiny_pythia(checkpointing)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with SdpaCalls() as recorded, autocast:
        model(**pythia_batch()).loss.backward()
    # A checkpointed layer runs again in the backward pass, where the mode may not see it.
    assert recorded.calls[:model.config.num_hidden_layers] == [MASK_FREE_CAUSAL] * model.config.num_hidden_layers
    assert all(call == MASK_FREE_CAUSAL for call in recorded.calls)
    assert recorded.host_reads == []
    if checkpointing:  # the case is there: transformers' own model reads the positions on the host
        with SdpaCalls() as recorded, autocast:
            plain_pythia(checkpointing)(**pythia_batch()).loss.backward()
        assert "__bool__" in recorded.host_reads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pythia_honours_a_padding_mask_as_transformers_does(precision):
    model = tiny_pythia()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    # A padding mask is honoured: the outputs are transformers' own, whose "sdpa" path builds the mask.
    plain = plain_pythia()
    plain.load_state_dict(model.state_dict())
    inputs = {"input_ids": pythia_batch()["input_ids"], "attention_mask": torch.ones(2, 32, dtype=torch.long)}
    inputs["attention_mask"][1, 20:] = 0
    with SdpaCalls() as recorded, autocast, torch.no_grad():
        logits = model(**inputs).logits
        expected = plain(**inputs).logits
    assert all(call["has_mask"] for call in recorded.calls)
    kept = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits[kept], expected[kept])
