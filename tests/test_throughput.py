"""Model FLOPs per token and MFU."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import BertConfig, BertForMaskedLM

from cram.data.collator import MaskedLMCollator
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.models.pythia_model import build_pythia_model, pythia_config
from cram.train.throughput import (
    bert_flops_per_token,
    crammed_bert_flops_per_token,
    gpt_neox_flops_per_token,
    mfu,
    peak_flops,
    peak_flops_for_name,
)


def test_flops_per_token_follow_the_models_own_matmul_weights():
    config = CrammedBertConfig()
    with torch.device("meta"):
        model = CrammedBertForMaskedLM(config)
    layer_matmul_weights = sum(
        module.weight.numel() for module in model.bert.layers.modules() if isinstance(module, torch.nn.Linear)
    )
    attention = 16 * 2 * 128 * 768
    decoder_on_masked = 0.25 * model.decoder.weight.numel()
    expected = 6 * (layer_matmul_weights + attention + decoder_on_masked)
    assert crammed_bert_flops_per_token(16, 768, 3072, 32768, 128, 0.25) == pytest.approx(expected)
    assert expected == pytest.approx(622_854_144)


def test_pythia_flops_count_its_matmul_weights_and_its_attention_in_full_or_the_causal_half():
    config = pythia_config("pythia-160m")
    with torch.device("meta"):
        model = build_pythia_model("pythia-160m", config)
    matmul_weights = sum(module.weight.numel() for module in model.modules()
                         if isinstance(module, torch.nn.Linear))  # the layers' and the output layer's
    layers, seq_len, hidden = config.num_hidden_layers, 2048, config.hidden_size
    args = (layers, hidden, config.intermediate_size, config.vocab_size, seq_len)
    assert gpt_neox_flops_per_token(*args) == 6 * matmul_weights + 12 * layers * seq_len * hidden
    # A causal kernel computes the lower triangle of the scores: half the attention term.
    assert gpt_neox_flops_per_token(*args, causal_half=True) == 6 * matmul_weights + 6 * layers * seq_len * hidden


@pytest.mark.parametrize(
    "name, tflops",
    [("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
     ("NVIDIA GeForce RTX 3090", 71), ("NVIDIA RTX A6000", 154.8), ("Tesla T4", None)],
)
def test_peak_by_device_name(name, tflops):
    assert peak_flops_for_name(name) == (tflops * 1e12 if tflops else None)


def test_mfu_on_a_known_peak_and_none_on_the_cpu():
    assert mfu(1000.0, 6e9, 312e12) == pytest.approx(6e12 / 312e12)
    assert peak_flops(torch.device("cpu")) is None
    assert mfu(1000.0, 6e9, None) is None


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_flops_per_token_equal_torchs_count_of_a_real_training_step(preset):
    # FlopCounterMode counts the matmuls and attention products that a forward and backward pass actually run,
    # sparse prediction included: an independent check of the formula the run logs FLOP/s and MFU with.
    config = CrammedBertConfig.from_preset(preset, vocab_size=2048)
    model = CrammedBertForMaskedLM(config)
    input_ids = torch.randint(5, 2048, (2, 128), generator=torch.Generator().manual_seed(0))
    batch = MaskedLMCollator(4, 2048, range(5))({"input_ids": input_ids, "serials": torch.arange(2)})
    # The math backend runs attention as matmuls the counter sees (it skips the CPU flash-attention kernel).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    formula = crammed_bert_flops_per_token(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                                           config.vocab_size, 128, config.sparse_prediction)
    assert formula == pytest.approx(counter.get_total_flops() / input_ids.numel(), rel=1e-9)


def test_bert_for_masked_lm_flops_per_token_equal_torchs_count_of_its_training_step():
    # Hugging Face's BERT decodes every position over the full vocabulary after a transform layer, and its
    # feed-forward is not gated: a count of its own, as `make device-check` gives its row's MFU.
    config = BertConfig(vocab_size=2048, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=512, max_position_embeddings=64, attn_implementation="sdpa")
    model = BertForMaskedLM(config)
    input_ids = torch.randint(5, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    formula = bert_flops_per_token(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                                   config.vocab_size, 64)
    assert formula == pytest.approx(counter.get_total_flops() / input_ids.numel(), rel=1e-9)
