"""The check to run on a new GPU machine: what is installed, what `auto` picks, and short measured training steps.

    make gpu-report      # = python -m cram.bench.gpu_report [--output-dir runs/gpu-report] [--shape full|toy]

Prints and saves (gpu_report.md, gpu_report.json): versions, devices and compute capability, the precision and
compile choices `--precision auto` / `--compile auto` make, the peak FLOP/s MFU is measured against; then whole
training steps (forward, backward, clipping, AdamW) on synthetic tokens: the crammed-BERT default model at
micro-batch 128 × 128, eager and compiled, beside `transformers.BertForMaskedLM` at the same shape;
pythia-160m at micro-batch 8 × 2048; with DeepSpeed installed, the crammed-BERT step under ZeRO stage 1. Each
with tokens/s, MFU and peak memory. No data and no network. Without a GPU it runs a toy shape (the tiny preset,
pythia-14m, short sequences), which is what the test suite checks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM, GPTNeoXForCausalLM

from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.models.pythia_model import pythia_config
from cram.plan.launch import free_port
from cram.plan.timing import synchronize
from cram.train.compilation import COMPILE_CHOICES, resolve_compile
from cram.train.deepspeed_setup import prepare_deepspeed_on_the_cpu
from cram.train.precision import resolve_precision
from cram.train.throughput import crammed_bert_flops_per_token, gpt_neox_flops_per_token, mfu, peak_flops

TOY_VOCAB = 512
REPORTED_PACKAGES = ("torch", "transformers", "accelerate", "datasets", "tokenizers", "deepspeed", "bitsandbytes",
                     "peft", "wandb", "lm-eval", "cram")


@dataclass(frozen=True)
class Shape:
    """The shapes measured: the full ones on GPUs, a toy one on the CPU."""

    bert: CrammedBertConfig
    bert_batch: int
    pythia: str
    pythia_batch: int
    pythia_seq_len: int
    warmup: int
    steps: int
    pythia_vocab: int | None = None  # None: the released vocabulary


def shape_for(name: str) -> Shape:
    if name == "full":  # the crammed-BERT default (the paper's 16 × 768) and pythia-160m at its 2048-token context
        return Shape(CrammedBertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), 128,
                     "pythia-160m", 8, 2048, warmup=3, steps=10)
    # The toy shape: the tiny preset and pythia-14m with a 512-token vocabulary, which a CPU runs in seconds.
    return Shape(CrammedBertConfig.from_preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                               max_position_embeddings=32, vocab_size=TOY_VOCAB), 4,
                 "pythia-14m", 2, 64, warmup=1, steps=2, pythia_vocab=TOY_VOCAB)


@dataclass
class Measurement:
    name: str
    status: str  # "measured", or why it was skipped
    tokens_per_second: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None
    seconds_per_step: float | None = None


def installed_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in REPORTED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    versions["CUDA (torch built with)"] = torch.version.cuda or "none: a CPU build"
    return versions


def describe_devices() -> list[dict[str, object]]:
    if not torch.cuda.is_available():
        return [{"device": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}]
    devices = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        devices.append({"device": f"cuda:{index}", "name": properties.name,
                        "compute capability": f"{properties.major}.{properties.minor}",
                        "memory GiB": round(properties.total_memory / 2**30, 1)})
    return devices


def timed_steps(step: Callable[[], None], warmup: int, steps: int, device: torch.device) -> float:
    """Median seconds of `steps` whole steps after `warmup` untimed ones (compilation happens there)."""
    for _ in range(warmup):
        step()
    seconds = []
    for _ in range(steps):
        synchronize(device)
        started = time.perf_counter()
        step()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def training_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], precision: str,
                  device: torch.device) -> Callable[[], None]:
    """One whole step of `model` on `batch` under the autocast `precision` ("bf16", "fp16" or "no")."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def mlm_batch(vocab: int, batch: int, seq_len: int, masked_fraction: float, device: torch.device) -> dict:
    """Synthetic masked-LM tokens: a fixed fraction of positions carry labels, as the collator's masking gives."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, vocab, (batch, seq_len), generator=generator)
    labels = torch.full_like(input_ids, -100)
    masked = torch.rand(batch, seq_len, generator=generator) < masked_fraction
    labels[masked] = input_ids[masked]
    return {"input_ids": input_ids.to(device), "labels": labels.to(device)}


def measure(name: str, build: Callable[[], Callable[[], None]], tokens_per_step: int, flops_per_token: float,
            shape: Shape, device: torch.device, peak: float | None) -> Measurement:
    reset_peak_memory(device)
    try:
        seconds = timed_steps(build(), shape.warmup, shape.steps, device)
    except torch.OutOfMemoryError:
        return Measurement(name, "skipped: out of memory at this shape")
    tokens_per_second = tokens_per_step / seconds
    return Measurement(name, "measured", tokens_per_second, mfu(tokens_per_second, flops_per_token, peak),
                       peak_memory_gib(device), seconds)


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


def run_report(shape_name: str, compile_choice: str) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = shape_for(shape_name)
    precision = resolve_precision("auto", device.type)
    auto_compile = resolve_compile("auto", device.type)
    compiled = resolve_compile(compile_choice, device.type)
    peak = peak_flops(device)
    bert = shape.bert
    bert_flops = crammed_bert_flops_per_token(bert.num_hidden_layers, bert.hidden_size, bert.intermediate_size,
                                              bert.vocab_size, bert.max_position_embeddings, bert.sparse_prediction)
    bert_tokens = shape.bert_batch * bert.max_position_embeddings
    bert_batch = mlm_batch(bert.vocab_size, shape.bert_batch, bert.max_position_embeddings, bert.sparse_prediction,
                           device)
    # The HF baseline's FLOPs differ (a full-width feed-forward, the decoder on every position); the same count for
    # all keeps the tokens/s ratio as the comparison, and MFU as the crammed model's work per token.

    def crammed(compile_it: bool) -> Callable[[], Callable[[], None]]:
        def build() -> Callable[[], None]:
            torch.manual_seed(0)
            model = CrammedBertForMaskedLM(bert).to(device)
            return training_step(torch.compile(model) if compile_it else model, bert_batch, precision, device)
        return build

    def hf_bert() -> Callable[[], None]:
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(
            vocab_size=bert.vocab_size, hidden_size=bert.hidden_size, num_hidden_layers=bert.num_hidden_layers,
            num_attention_heads=bert.num_attention_heads, intermediate_size=bert.intermediate_size,
            max_position_embeddings=bert.max_position_embeddings, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="sdpa")).to(device)
        return training_step(model, bert_batch, precision, device)

    pythia = pythia_config(shape.pythia, max_position_embeddings=shape.pythia_seq_len,
                           **({"vocab_size": shape.pythia_vocab} if shape.pythia_vocab else {}))
    pythia_flops = gpt_neox_flops_per_token(pythia.num_hidden_layers, pythia.hidden_size, pythia.intermediate_size,
                                            pythia.vocab_size, shape.pythia_seq_len)

    def pythia_step() -> Callable[[], None]:
        torch.manual_seed(0)
        model = GPTNeoXForCausalLM(pythia).to(device)
        tokens = torch.randint(0, pythia.vocab_size, (shape.pythia_batch, shape.pythia_seq_len),
                               generator=torch.Generator().manual_seed(0)).to(device)
        return training_step(model, {"input_ids": tokens, "labels": tokens}, precision, device)

    def zero1() -> Callable[[], None]:
        torch.manual_seed(0)
        return zero1_step(CrammedBertForMaskedLM(bert).to(device), bert_batch, precision, device)

    bert_shape = f"{shape.bert_batch} × {bert.max_position_embeddings}"
    measurements = [
        measure(f"crammed BERT, eager ({bert_shape})", crammed(False), bert_tokens, bert_flops, shape, device, peak),
        measure(f"crammed BERT, compiled ({bert_shape})", crammed(True), bert_tokens, bert_flops, shape, device, peak)
        if compiled else Measurement(f"crammed BERT, compiled ({bert_shape})",
                                     f"skipped: --compile {compile_choice} does not compile on this device"),
        measure(f"HF BertForMaskedLM, eager ({bert_shape})", hf_bert, bert_tokens, bert_flops, shape, device, peak),
        measure(f"{shape.pythia}, eager ({shape.pythia_batch} × {shape.pythia_seq_len})", pythia_step,
                shape.pythia_batch * shape.pythia_seq_len, pythia_flops, shape, device, peak),
    ]
    if importlib.util.find_spec("deepspeed") is not None:
        measurements.append(measure(f"crammed BERT, DeepSpeed ZeRO-1 ({bert_shape})", zero1, bert_tokens, bert_flops,
                                    shape, device, peak))
    else:
        measurements.append(Measurement(f"crammed BERT, DeepSpeed ZeRO-1 ({bert_shape})",
                                        'skipped: DeepSpeed is not installed (pip install "cram[deepspeed]")'))
    baseline = measurements[2].tokens_per_second
    return {
        "versions": installed_versions(),
        "devices": describe_devices(),
        "auto choices": {"precision": precision, "compile": auto_compile, "compile used here": compiled},
        "peak": {"bf16 TFLOP/s": peak / 1e12 if peak else None,
                 "note": "from cram.train.throughput's table; none for CPUs and unlisted GPUs, so no MFU"},
        "shape": shape_name,
        "measurements": [asdict(row) for row in measurements],
        "crammed BERT eager over HF BertForMaskedLM": (
            measurements[0].tokens_per_second / baseline if baseline and measurements[0].tokens_per_second else None),
    }


def render_markdown(report: dict) -> str:
    def show(value: object) -> str:
        if value is None:
            return "n/a"
        return f"{value:,.3g}" if isinstance(value, float) else str(value)

    lines = ["# cram GPU report", "", "## Versions", "", "| package | version |", "|---|---|"]
    lines += [f"| {package} | {version or 'not installed'} |" for package, version in report["versions"].items()]
    lines += ["", "## Devices", ""]
    lines += ["- " + ", ".join(f"{key}: {value}" for key, value in device.items()) for device in report["devices"]]
    lines += ["", "## Auto choices", ""]
    lines += [f"- {key}: {value}" for key, value in report["auto choices"].items()]
    lines += ["", "## Peak", "", f"- bf16 TFLOP/s: {show(report['peak']['bf16 TFLOP/s'])} ({report['peak']['note']})"]
    lines += ["", f"## Measured steps ({report['shape']} shape, synthetic tokens)", "",
              "| step | tokens/s | MFU | peak memory GiB | s/step | status |", "|---|---:|---:|---:|---:|---|"]
    for row in report["measurements"]:
        lines.append(f"| {row['name']} | {show(row['tokens_per_second'])} | {show(row['mfu'])} | "
                     f"{show(row['peak_memory_gib'])} | {show(row['seconds_per_step'])} | {row['status']} |")
    lines += ["", f"crammed BERT (eager) over HF BertForMaskedLM: "
                  f"{show(report['crammed BERT eager over HF BertForMaskedLM'])}×"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cram.bench.gpu_report", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/gpu-report"))
    parser.add_argument("--shape", choices=("full", "toy"), default=None,
                        help="full (the default on GPUs) or toy (the default on CPUs)")
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="measure the compiled crammed-BERT step: auto (where recipes compile), true, false")
    args = parser.parse_args(argv)
    shape = args.shape or ("full" if torch.cuda.is_available() else "toy")
    report = run_report(shape, args.compile)
    markdown = render_markdown(report)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "gpu_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.output_dir / "gpu_report.md").write_text(markdown)
    print(markdown)
    print(f"written: {args.output_dir / 'gpu_report.md'} and gpu_report.json", file=sys.stderr)


if __name__ == "__main__":
    main()
