"""The training steps `make gpu-report` times side by side, each a whole step (forward, backward, clipping, AdamW)
on synthetic tokens at one shape: crammed BERT eager and compiled; the original cramming code from the user's
checkout, eager and compiled as its own `impl.compile_torch` compiles it; Hugging Face's `BertForMaskedLM` eager
and compiled; cram's Pythia eager and compiled beside `GPTNeoXForCausalLM` as a Hugging Face user trains it (its own
init, eager); and, with DeepSpeed installed, the crammed-BERT step under ZeRO stage 1.

Every row counts its own model's FLOPs, so each MFU is that model's; the ratios compare tokens/s at one shape.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM, GPTNeoXForCausalLM

from cram.bench.interleaved import Candidate, Rounds, Skip
from cram.bench.original_cramming import OriginalUnavailable, build_original
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.models.pythia_model import build_pythia_model, pythia_config
from cram.plan.launch import free_port
from cram.train.deepspeed_setup import prepare_deepspeed_on_the_cpu
from cram.train.throughput import bert_flops_per_token, crammed_bert_flops_per_token, gpt_neox_flops_per_token

TOY_VOCAB = 512
HF_GPT_NEOX = "GPTNeoXForCausalLM as Hugging Face users train it"


@dataclass(frozen=True)
class Shape:
    """The shapes measured: the full ones on GPUs, a toy one on the CPU."""

    bert: CrammedBertConfig
    bert_batch: int
    pythia: str
    pythia_batch: int
    pythia_seq_len: int
    rounds: Rounds
    pythia_vocab: int | None = None  # None: the released vocabulary


def shape_for(name: str) -> Shape:
    if name == "full":  # the crammed-BERT default (the paper's 16 × 768) and pythia-160m at its 2048-token context
        return Shape(CrammedBertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), 128,
                     "pythia-160m", 8, 2048, Rounds(warmup=3, rounds=5, steps_per_round=4))
    # The toy shape: the tiny preset and pythia-14m with a 512-token vocabulary, which a CPU runs in seconds.
    return Shape(CrammedBertConfig.from_preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                               max_position_embeddings=32, vocab_size=TOY_VOCAB), 4,
                 "pythia-14m", 2, 64, Rounds(warmup=1, rounds=2, steps_per_round=1), pythia_vocab=TOY_VOCAB)


def training_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], precision: str,
                  device: torch.device) -> Callable[[], None]:
    """One whole step of `model` on `batch` under the autocast `precision` ("bf16", "fp16" or "no")."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(**batch)["loss"]  # a dict from the original code, a ModelOutput from transformers
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def mlm_batch(vocab: int, batch: int, seq_len: int, masked_fraction: float, device: torch.device) -> dict:
    """Synthetic masked-LM tokens: `masked_fraction` of the positions, at random, carry labels: the fixed count
    that crammed BERT's and the original's sparse prediction are built for."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, vocab, (batch, seq_len), generator=generator)
    labels = torch.full_like(input_ids, -100).view(-1)
    masked = torch.randperm(batch * seq_len, generator=generator)[:round(masked_fraction * batch * seq_len)]
    labels[masked] = input_ids.view(-1)[masked]
    labels = labels.view(batch, seq_len)
    return {"input_ids": input_ids.to(device), "labels": labels.to(device)}


def zero1_step(model: torch.nn.Module, batch: dict, precision: str, device: torch.device) -> Callable[[], None]:
    """The same model's step through a one-process DeepSpeed engine under ZeRO stage 1 (gloo on the CPU)."""
    import deepspeed

    if device.type == "cpu":
        prepare_deepspeed_on_the_cpu()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": batch["input_ids"].shape[0], "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)

    def step() -> None:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

    return step


@dataclass(frozen=True)
class Setting:
    """How the report runs each step: where, at which precisions, whether compiled rows compile."""

    device: torch.device
    precision: str  # crammed BERT's, the original's and BertForMaskedLM's: `--precision auto` here
    pythia_precision: str  # the released Pythia's where the device can, else `--precision auto`
    compiled: bool  # whether compiled rows compile here
    compile_choice: str  # what --compile said, for a skipped row's reason
    original: Path | None  # the original cramming code's checkout


def candidates(shape: Shape, setting: Setting) -> list[Candidate]:
    """Every row of the report, in its order."""
    device, bert = setting.device, shape.bert
    bert_shape = f"{shape.bert_batch} × {bert.max_position_embeddings}"
    bert_tokens = shape.bert_batch * bert.max_position_embeddings
    bert_batch = mlm_batch(bert.vocab_size, shape.bert_batch, bert.max_position_embeddings, bert.sparse_prediction,
                           device)
    crammed_flops = crammed_bert_flops_per_token(bert.num_hidden_layers, bert.hidden_size, bert.intermediate_size,
                                                 bert.vocab_size, bert.max_position_embeddings, bert.sparse_prediction)
    hf_bert_flops = bert_flops_per_token(bert.num_hidden_layers, bert.hidden_size, bert.intermediate_size,
                                         bert.vocab_size, bert.max_position_embeddings)

    def step_of(make_model: Callable[[], torch.nn.Module], compile_it: bool, batch: dict, precision: str,
                compile_options: Callable[[], dict] | None = None) -> Callable[[], Callable[[], None]]:
        def build() -> Callable[[], None]:
            if compile_it and not setting.compiled:
                raise Skip(f"--compile {setting.compile_choice} does not compile on this device")
            torch.manual_seed(0)
            model = make_model().to(device)
            if compile_it:
                model = torch.compile(model, **(compile_options() if compile_options else {}))
            return training_step(model, batch, precision, device)
        return build

    original: dict = {}

    def original_model() -> torch.nn.Module:
        """The original code's model at this shape (built once per row: each row trains its own)."""
        overrides = {"num_transformer_layers": bert.num_hidden_layers, "hidden_size": bert.hidden_size,
                     "intermed_size": bert.intermediate_size,
                     "attention": {"num_attention_heads": bert.num_attention_heads},
                     "embedding": {"max_seq_length": bert.max_position_embeddings}}
        try:
            built = build_original(setting.original, bert.vocab_size, overrides)
        except OriginalUnavailable as reason:
            raise Skip(str(reason)) from None
        original["compile options"] = built.compile_options
        return built.model

    def hf_bert() -> torch.nn.Module:
        return BertForMaskedLM(BertConfig(
            vocab_size=bert.vocab_size, hidden_size=bert.hidden_size, num_hidden_layers=bert.num_hidden_layers,
            num_attention_heads=bert.num_attention_heads, intermediate_size=bert.intermediate_size,
            max_position_embeddings=bert.max_position_embeddings, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))

    pythia = pythia_config(shape.pythia, max_position_embeddings=shape.pythia_seq_len,
                           **({"vocab_size": shape.pythia_vocab} if shape.pythia_vocab else {}))
    pythia_flops = gpt_neox_flops_per_token(pythia.num_hidden_layers, pythia.hidden_size, pythia.intermediate_size,
                                            pythia.vocab_size, shape.pythia_seq_len)
    tokens = torch.randint(0, pythia.vocab_size, (shape.pythia_batch, shape.pythia_seq_len),
                           generator=torch.Generator().manual_seed(0)).to(device)
    pythia_batch = {"input_ids": tokens, "labels": tokens}
    pythia_shape = f"{shape.pythia_batch} × {shape.pythia_seq_len}"
    pythia_tokens = shape.pythia_batch * shape.pythia_seq_len

    def cram_pythia() -> torch.nn.Module:
        return build_pythia_model(shape.pythia, pythia)  # as recipes/pythia.py builds it: the released init

    def zero1() -> Callable[[], None]:
        if importlib.util.find_spec("deepspeed") is None:
            raise Skip('DeepSpeed is not installed (pip install "cram[deepspeed]")')
        torch.manual_seed(0)
        return zero1_step(CrammedBertForMaskedLM(bert).to(device), bert_batch, setting.precision, device)

    precision, pythia_precision = setting.precision, setting.pythia_precision
    return [
        Candidate(f"crammed BERT, eager ({bert_shape})",
                  step_of(lambda: CrammedBertForMaskedLM(bert), False, bert_batch, precision), bert_tokens,
                  crammed_flops),
        Candidate(f"crammed BERT, compiled ({bert_shape})",
                  step_of(lambda: CrammedBertForMaskedLM(bert), True, bert_batch, precision), bert_tokens,
                  crammed_flops),
        # The same architecture at the same shape, its decoder on the same masked quarter (the original's
        # bert-o4.yaml: objective.mlm_probability), hence crammed BERT's count.
        Candidate(f"original cramming, eager ({bert_shape})",
                  step_of(original_model, False, bert_batch, precision), bert_tokens, crammed_flops),
        Candidate(f"original cramming, compiled as its impl.compile_torch ({bert_shape})",
                  step_of(original_model, True, bert_batch, precision, lambda: original["compile options"]),
                  bert_tokens, crammed_flops),
        Candidate(f"BertForMaskedLM, eager ({bert_shape})", step_of(hf_bert, False, bert_batch, precision),
                  bert_tokens, hf_bert_flops),
        Candidate(f"BertForMaskedLM, compiled ({bert_shape})", step_of(hf_bert, True, bert_batch, precision),
                  bert_tokens, hf_bert_flops),
        Candidate(f"{shape.pythia}, eager ({pythia_shape})",
                  step_of(cram_pythia, False, pythia_batch, pythia_precision), pythia_tokens, pythia_flops),
        Candidate(f"{shape.pythia}, compiled ({pythia_shape})",
                  step_of(cram_pythia, True, pythia_batch, pythia_precision), pythia_tokens, pythia_flops),
        Candidate(f"{HF_GPT_NEOX} ({pythia_shape})",
                  step_of(lambda: GPTNeoXForCausalLM(pythia), False, pythia_batch, pythia_precision),
                  pythia_tokens, pythia_flops),
        Candidate(f"crammed BERT, DeepSpeed ZeRO-1 ({bert_shape})", zero1, bert_tokens, crammed_flops),
    ]
