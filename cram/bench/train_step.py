"""Benchmark: training tokens/s of crammed BERT against `transformers.BertForMaskedLM`, side by side.

    python -m cram.bench.train_step [--layers 16] [--batch 16] [--steps 5] [--precision fp32[,bf16]] [--compile]
        [--original PATH] [--profile-ops 10]

Both models have the same depth, width, heads, vocabulary and sequence length, train on the same packed blocks
through a `DataLoader` on the same device, and each timed step is the whole step: next batch (collation and
masking included), forward, backward, clipping and the optimizer update. The baseline is what a user would write
with Hugging Face: `BertForMaskedLM` (SDPA attention), `DataCollatorForLanguageModeling` at the same 25 % masking,
and the optimizer `Trainer` builds by default (fused AdamW, no decay on biases and LayerNorms). With `--compile`,
both models also run under `torch.compile` (whole model, inductor's default mode), as `--compile auto` does on
GPUs. `--original PATH` adds the paper's own model, imported from a checkout of JonasGeiping/cramming at PATH
(its `cramming/architectures` files and `crammed-bert.yaml`; needs omegaconf and einops), trained through the
same collator and optimizer as crammed BERT. All contenders alternate step by step, so load on the machine
affects them alike; the table reports medians and ratios to the eager baseline. After the timed steps, one more
step of each contender runs under `torch.profiler`, and a table lists its top operators by self time, so a
regression shows where it comes from.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import datasets
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from cram.data import SPECIAL_TOKENS
from cram.data.collator import MaskedLMCollator
from cram.devices import cpu_has_bf16_units
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM, attention_path_for
from cram.models.crammed_bert_recipe import crammed_bert_recipe
from cram.train.optim import build_adamw

PAPER_ADAMW = crammed_bert_recipe("crammed-bert").adamw_settings  # every contender takes the paper's optimizer


def wordpiece_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer with `vocab_size` entries; only its special tokens and size matter to the collators."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{index}": index for index in range(len(SPECIAL_TOKENS), vocab_size)})
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordPiece(vocab, unk_token="[UNK]")),
        pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
    )


def packed_blocks(num_blocks: int, seq_len: int, vocab_size: int, seed: int = 0) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIAL_TOKENS), vocab_size, (num_blocks, seq_len), generator=generator, dtype=torch.int32)
    return datasets.Dataset.from_dict({"input_ids": ids.numpy()}).with_format("torch")


def trainer_default_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float], eps: float,
                              weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer `Trainer` builds for `model` with default arguments but these hyper-parameters."""
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(output_dir=output_dir, learning_rate=lr, adam_beta1=betas[0],
                                      adam_beta2=betas[1], adam_epsilon=eps, weight_decay=weight_decay,
                                      report_to=[], use_cpu=not torch.cuda.is_available())
        return Trainer(model=model, args=arguments).create_optimizer()


def original_crammed_bert(checkout: Path, layers: int, hidden: int, heads: int, vocab: int, seq_len: int,
                          ) -> torch.nn.Module:
    """The original code's `ScriptableLMForPreTraining` from a cramming checkout, configured by its
    `crammed-bert.yaml` with this bench's shape and dropout 0 (the yaml's 0.1 is for fine-tuning parity)."""
    architectures = checkout / "cramming" / "architectures"
    if not (architectures / "crammed_bert.py").is_file():
        raise SystemExit(f"--original {checkout}: no cramming/architectures/crammed_bert.py there; pass a checkout "
                         "of github.com/JonasGeiping/cramming.")
    try:
        from omegaconf import OmegaConf  # the original's config library; only this comparison needs it
    except ModuleNotFoundError:
        raise SystemExit("--original needs omegaconf and einops, which the original code imports: "
                         "pip install omegaconf einops.") from None
    # A package object for the architecture files alone: the checkout's own __init__ imports its training code.
    package = types.ModuleType("cramming_original")
    package.__path__ = [str(architectures)]
    sys.modules["cramming_original"] = package
    module = importlib.import_module("cramming_original.crammed_bert")
    arch = OmegaConf.load(checkout / "cramming" / "config" / "arch" / "crammed-bert.yaml")
    arch.sparse_prediction = 0.25  # cfg_pretrain: train.objective.mlm_probability, which the yaml interpolates
    arch.num_transformer_layers, arch.hidden_size, arch.intermed_size = layers, hidden, 4 * hidden
    arch.hidden_dropout_prob = arch.embedding.dropout_prob = arch.attention.dropout_prob = 0.0
    arch.classification_head.classifier_dropout = 0.0
    arch.embedding.max_seq_length, arch.embedding.embedding_dim = seq_len, hidden
    arch.attention.num_attention_heads = heads
    return module.construct_crammed_bert(arch, vocab)


class OriginalOutputs(torch.nn.Module):
    """The original model with its dict output read as `.loss`, like the Hugging Face models' outputs."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **batch) -> types.SimpleNamespace:
        return types.SimpleNamespace(loss=self.model(**batch)["loss"])


def top_ops(step: Callable[[], float], count: int) -> list[tuple[str, float, int]]:
    """(operator, self milliseconds, calls) of one step's `count` most expensive operators, by self time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        step()
    device_time = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    events = sorted(profiler.key_averages(), key=lambda event: getattr(event, device_time), reverse=True)
    return [(event.key, getattr(event, device_time) / 1000, event.count) for event in events[:count]]


def endless(loader: DataLoader) -> Iterator[dict]:
    while True:
        yield from loader


def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[dict],
              precision: str) -> Callable[[], float]:
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" and not torch.cuda.is_available()
        else torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16"
        else contextlib.nullcontext()
    )
    device = next(model.parameters()).device

    def step() -> float:
        # Tensors to the device; cram's collator also gives the masked count per sequence, a plain int.
        batch = {name: value.to(device, non_blocking=True) if torch.is_tensor(value) else value
                 for name, value in next(batches).items()}
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # waits for the device, so the step is fully timed

    return step


def default_precisions(device: torch.device) -> list[str]:
    """fp32, and bf16 where the device computes in it: elsewhere torch emulates bf16 matmuls, many times slower
    than fp32, so a bf16 step would time the emulation rather than the model."""
    if device.type == "cuda" or cpu_has_bf16_units():
        return ["fp32", "bf16"]
    print("bf16 left out: this CPU has no bf16 units (AMX or AVX512-BF16), so torch would emulate it; "
          "pass --precision fp32,bf16 to time it anyway")
    return ["fp32"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model")
    parser.add_argument("--precision", default=None,
                        help="comma-separated: fp32, bf16 (autocast); default fp32, and bf16 where the device has "
                             "bf16 units (a GPU, or a CPU with AMX or AVX512-BF16)")
    parser.add_argument("--compile", action="store_true", help="add both models under torch.compile")
    parser.add_argument("--original", type=Path, help="a checkout of JonasGeiping/cramming: add its model")
    parser.add_argument("--profile-ops", type=int, default=10, help="top operators per contender to list (0: none)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        parser.error("--steps and --batch must be at least 1, --warmup at least 0")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precisions = default_precisions(device) if args.precision is None else args.precision.split(",")
    torch.manual_seed(0)
    tokenizer = wordpiece_tokenizer(args.vocab)
    blocks = packed_blocks(args.batch * (args.warmup + args.steps + 1), args.seq_len, args.vocab)

    crammed = CrammedBertForMaskedLM(CrammedBertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden, max_position_embeddings=args.seq_len,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )).to(device)
    baseline = BertForMaskedLM(BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )).to(device)
    contenders = {
        "crammed BERT": (crammed, build_adamw(crammed, *PAPER_ADAMW),
                         MaskedLMCollator.for_tokenizer(tokenizer, mask_fraction=0.25)),
        "HF BertForMaskedLM": (baseline, trainer_default_optimizer(baseline, *PAPER_ADAMW),
                               DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.25)),
    }
    if args.original is not None:
        original = OriginalOutputs(original_crammed_bert(
            args.original, args.layers, args.hidden, args.heads, args.vocab, args.seq_len)).to(device)
        contenders["original cramming"] = (original, build_adamw(original, *PAPER_ADAMW),
                                           MaskedLMCollator.for_tokenizer(tokenizer, mask_fraction=0.25))
    if args.compile:  # the same modules, parameters and optimizers, called through the compiled wrapper
        contenders.update({f"{name}, compiled": (torch.compile(model), optimizer, collator)
                           for name, (model, optimizer, collator) in list(contenders.items())})
    tokens_per_step = args.batch * args.seq_len
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{args.layers}x{args.hidden}, vocab {args.vocab}, batch {args.batch} x {args.seq_len}, "
          f"{args.steps} timed steps after {args.warmup} warm-up, alternating")
    for name, (model, _, _) in contenders.items():
        print(f"  {name}: {sum(p.numel() for p in model.parameters()):,} parameters")

    rows, profiles = [], []
    for precision in precisions:
        low_precision = precision == "bf16"
        print(f"{precision}: crammed BERT's attention path: {attention_path_for(device.type, low_precision)}")
        steps = {
            name: make_step(model, optimizer, endless(DataLoader(blocks, batch_size=args.batch, collate_fn=collator)),
                            precision)
            for name, (model, optimizer, collator) in contenders.items()
        }
        seconds: dict[str, list[float]] = {name: [] for name in steps}
        for index in range(args.warmup + args.steps):
            for name, step in steps.items():
                started = time.perf_counter()
                step()
                if index >= args.warmup:
                    seconds[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        base = medians["HF BertForMaskedLM"]
        for name, median in medians.items():
            spread = (max(seconds[name]) - min(seconds[name])) / 2
            rows.append((precision, name, median, spread, tokens_per_step / median, base / median))
        if args.profile_ops > 0:
            profiles += [(precision, name, top_ops(step, args.profile_ops)) for name, step in steps.items()]

    print("\n| precision | model | s/step (median ± half-range) | tokens/s | speed-up vs HF |")
    print("|---|---|---|---|---|")
    for precision, name, median, spread, throughput, ratio in rows:
        print(f"| {precision} | {name} | {median:.3f} ± {spread:.3f} | {throughput:,.0f} | {ratio:.2f}x |")
    if profiles:
        unit = "self device ms" if torch.cuda.is_available() else "self CPU ms"
        print(f"\nTop operators of one profiled step (torch.profiler, {unit}):")
        print(f"\n| precision | model | operator | {unit} | calls |")
        print("|---|---|---|---|---|")
        for precision, name, operators in profiles:
            for operator, milliseconds, calls in operators:
                print(f"| {precision} | {name} | {operator} | {milliseconds:,.1f} | {calls} |")


if __name__ == "__main__":
    main()
