"""The check to run on a new GPU machine: what is installed, what `auto` picks, and training steps side by side.

    make gpu-report [ORIGINAL=PATH]   # = python -m cram.bench.gpu_report [--original PATH] [--shape full|toy]
                                      #   [--max-minutes 30]

Prints and saves (gpu_report.md, gpu_report.json): versions, devices and compute capability, the precision and
compile choices `--precision auto` / `--compile auto` make, the peak FLOP/s MFU is measured against; then whole
training steps on synthetic tokens, timed in interleaved rounds (`cram.bench.interleaved`), each with tokens/s, MFU
of its own FLOPs, peak memory and its build and warm-up time, and the ratios between them, named for what they
compare: the code (two models compiled alike), the flags (one model compiled two ways) or a lever. The rows
(`cram.bench.report_steps`): crammed BERT (the default model at micro-batch 128 × 128), the original cramming code
from the checkout PATH and `BertForMaskedLM`; pythia-160m (8 × 2048) and `GPTNeoXForCausalLM` as Hugging Face users
train it; each eager, compiled with defaults and compiled with the original's options; with DeepSpeed installed,
crammed BERT under ZeRO-1; then the levers. No data and no network. Without a GPU it runs a toy shape (the tiny
preset, pythia-14m, short sequences), which is what the test suite checks.

It says before the first row how many rows compile (and how many autotune), after each row the time it took and an
estimate of the rest (compiles left × the mean compile so far), and skips, with that reason, a row that would take
it past `--max-minutes`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

import cram
from cram.bench.interleaved import Bound, measure_interleaved
from cram.bench.report_steps import FUSED_LOSSES, HF_GPT_NEOX, LOADER_WORKERS, Setting, candidates, shape_for
from cram.models.pythia_recipe import pythia_recipe
from cram.train.compilation import COMPILE_CHOICES, resolve_compile
from cram.train.precision import enable_tf32, resolve_precision
from cram.train.throughput import peak_flops

REPORTED_PACKAGES = ("torch", "transformers", "accelerate", "datasets", "tokenizers", "deepspeed", "bitsandbytes",
                     "peft", "wandb", "lm-eval", "omegaconf", "einops")
ORIGINALS = "compiled with the original's options"
# (what, faster row, slower row): rows by their name before the shape; {pythia} is the shape's Pythia size, {mode}
# "compiled" where the report compiles, else "eager". Code: two models compiled alike; flags: one model compiled
# two ways; levers: one change beside the step the recipes run.
RATIOS = (
    ("code: crammed BERT / original, both compiled with defaults", "crammed BERT, compiled",
     "original cramming, compiled"),
    ("code: crammed BERT / original, both with the original's options", f"crammed BERT, {ORIGINALS}",
     f"original cramming, {ORIGINALS}"),
    ("code: crammed BERT / BertForMaskedLM, both compiled with defaults", "crammed BERT, compiled",
     "BertForMaskedLM, compiled"),
    ("code: crammed BERT / BertForMaskedLM, both with the original's options", f"crammed BERT, {ORIGINALS}",
     f"BertForMaskedLM, {ORIGINALS}"),
    ("code: crammed BERT / original, both eager", "crammed BERT, eager", "original cramming, eager"),
    ("code: crammed BERT / BertForMaskedLM, both eager", "crammed BERT, eager", "BertForMaskedLM, eager"),
    ("code: pythia / Hugging Face's, both compiled with defaults", "{pythia}, compiled", f"{HF_GPT_NEOX}, compiled"),
    ("code: pythia / Hugging Face's, both with the original's options", f"{{pythia}}, {ORIGINALS}",
     f"{HF_GPT_NEOX}, {ORIGINALS}"),
    ("code: pythia / Hugging Face's, both eager", "{pythia}, eager", f"{HF_GPT_NEOX}, eager"),
    ("flags: crammed BERT, the original's options / defaults", f"crammed BERT, {ORIGINALS}",
     "crammed BERT, compiled"),
    ("flags: original, its own options / defaults", f"original cramming, {ORIGINALS}", "original cramming, compiled"),
    ("flags: BertForMaskedLM, the original's options / defaults", f"BertForMaskedLM, {ORIGINALS}",
     "BertForMaskedLM, compiled"),
    ("flags: pythia, the original's options / defaults", f"{{pythia}}, {ORIGINALS}", "{pythia}, compiled"),
    ("flags: crammed BERT compiled / eager", "crammed BERT, compiled", "crammed BERT, eager"),
    ("flags: pythia compiled / eager", "{pythia}, compiled", "{pythia}, eager"),
    ("lever: crammed BERT, max-autotune / defaults", "crammed BERT, compiled max-autotune", "crammed BERT, compiled"),
    ("lever: crammed BERT, loss on the autocast dtype's logits / fp32",
     "crammed BERT, {mode}, its loss on the autocast dtype's logits", "crammed BERT, {mode}"),
    (f"lever: crammed BERT, readymade loader with {LOADER_WORKERS} worker / in-process",
     f"crammed BERT, {{mode}}, fed by the readymade loader with {LOADER_WORKERS} worker",
     "crammed BERT, {mode}, fed by the readymade loader in-process"),
    ("lever: pythia, max-autotune / defaults", "{pythia}, compiled max-autotune", "{pythia}, compiled"),
    *((f"lever: pythia, {what} / the chunked loss", f"{{pythia}}, {{mode}}, {what}", "{pythia}, {mode}")
      for what, _, _ in FUSED_LOSSES),
)


def cram_version() -> str:
    """cram's version, and the source tree this process runs it from, installed with pip or not."""
    source = Path(cram.__file__).resolve().parents[1]
    if (source / "pyproject.toml").is_file():
        return f"{cram.__version__} (from the source tree {source})"
    return cram.__version__


def installed_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "cram": cram_version()}
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


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_report(shape_name: str, compile_choice: str, original: Path | None, max_minutes: float) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        enable_tf32()  # as the recipes do (and the original, impl/_default.yaml: tf32_allowed)
    shape = shape_for(shape_name)
    precision = resolve_precision("auto", device.type)
    # The released Pythia's precision where the device runs it, as recipes/pythia.py trains it.
    pythia_precision = pythia_recipe(shape.pythia).precision if device.type == "cuda" else precision
    auto_compile = resolve_compile("auto", device.type)
    compiled = resolve_compile(compile_choice, device.type)
    peak = peak_flops(device)
    setting = Setting(device, precision, pythia_precision, compiled, compile_choice, original)
    rows = candidates(shape, setting)
    compiles = sum(row.compiles for row in rows)
    autotuned = sum(row.compiles for row in rows if row.autotunes)
    plan = (f"{len(rows)} rows, {compiles} of them compiled ({autotuned} with autotuned GEMMs, which take longer); "
            f"each compile's time is measured on the first and the rest estimated from it; rows that would pass "
            f"--max-minutes {max_minutes:g} are skipped, with that reason")
    say(plan)
    started = time.monotonic()
    measurements = measure_interleaved(rows, shape.rounds, device, peak,
                                       Bound(max_minutes * 60, f"--max-minutes {max_minutes:g}"), say)
    spent = time.monotonic() - started
    by_name = {row.name.split(" (")[0]: row.tokens_per_second for row in measurements}
    ratios = {}
    for what, faster, slower in RATIOS:
        names = [name.format(pythia=shape.pythia, mode=setting.mode) for name in (faster, slower)]
        faster_rate, slower_rate = (by_name.get(name) for name in names)
        ratios[what] = faster_rate / slower_rate if faster_rate and slower_rate else None
    compile_seconds = [measured.warmup_seconds for row, measured in zip(rows, measurements, strict=True)
                       if row.compiles and measured.warmup_seconds is not None]
    return {
        "versions": installed_versions(),
        "devices": describe_devices(),
        "auto choices": {"precision": precision, "compile": auto_compile, "compile used here": compiled,
                         "Pythia's precision": pythia_precision},
        "peak": {"bf16 TFLOP/s": peak / 1e12 if peak else None,
                 "note": "from cram.train.throughput's table; none for CPUs and unlisted GPUs, so no MFU"},
        "shape": shape_name,
        "rounds": asdict(shape.rounds),
        "time": {"plan": plan, "max minutes": max_minutes, "minutes spent": spent / 60,
                 "compiles made": len(compile_seconds),
                 "mean seconds per compiled row (build and warm-up)": (
                     sum(compile_seconds) / len(compile_seconds) if compile_seconds else None),
                 "rows skipped by the bound": [row.name for row in measurements if "time bound" in row.status]},
        "measurements": [asdict(row) for row in measurements],
        "ratios": ratios,
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
    rounds = report["rounds"]
    lines += ["", f"## Measured steps ({report['shape']} shape, synthetic tokens, {rounds['warmup']} warm-up steps, "
                  f"then {rounds['rounds']} interleaved rounds of {rounds['steps_per_round']})", "",
              "| step | tokens/s | MFU | own peak memory GiB | s/step | build and warm-up s | status |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for row in report["measurements"]:
        status = f"{row['status']}; {row['note']}" if row["note"] else row["status"]
        lines.append(f"| {row['name']} | {show(row['tokens_per_second'])} | {show(row['mfu'])} | "
                     f"{show(row['peak_memory_gib'])} | {show(row['seconds_per_step'])} | "
                     f"{show(row['warmup_seconds'])} | {status} |")
    lines += ["", "## Ratios of tokens/s", "", "| ratio | × |", "|---|---:|"]
    lines += [f"| {what} | {show(value)} |" for what, value in report["ratios"].items()]
    timing = report["time"]
    lines += ["", "## Time", "", f"- plan: {timing['plan']}",
              f"- spent: {timing['minutes spent']:.1f} min of the bound's {timing['max minutes']:g}; "
              f"{timing['compiles made']} compiled row(s) built, "
              f"{show(timing['mean seconds per compiled row (build and warm-up)'])} s each on average",
              f"- rows skipped by the bound: {', '.join(timing['rows skipped by the bound']) or 'none'}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cram.bench.gpu_report", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/gpu-report"))
    parser.add_argument("--shape", choices=("full", "toy"), default=None,
                        help="full (the default on GPUs) or toy (the default on CPUs)")
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="measure the compiled steps: auto (where recipes compile), true, false")
    parser.add_argument("--original", type=Path, default=None,
                        help="a checkout of the original cramming code (JonasGeiping/cramming: the folder holding "
                             "its pretrain.py) to time beside crammed BERT; it needs omegaconf and einops")
    parser.add_argument("--max-minutes", type=float, default=30.0,
                        help="the bound on the rows' building and timing: a row that would pass it is skipped, "
                             "with that reason, and the rest of the report is written")
    args = parser.parse_args(argv)
    if args.max_minutes <= 0:
        parser.error("--max-minutes must be above 0")
    shape = args.shape or ("full" if torch.cuda.is_available() else "toy")
    report = run_report(shape, args.compile, args.original, args.max_minutes)
    markdown = render_markdown(report)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu_report.json", json.dumps(report, indent=2) + "\n"), ("gpu_report.md", markdown)):
        staging = args.output_dir / f"{name}.tmp"
        staging.write_text(text)
        staging.replace(args.output_dir / name)
    print(markdown)
    original = next(row for row in report["measurements"] if row["name"].startswith("original cramming, eager"))
    if original["status"].startswith("skipped: "):
        print(f"original cramming code not measured: {original['status'].removeprefix('skipped: ')}", file=sys.stderr)
    print(f"written: {args.output_dir / 'gpu_report.md'} and gpu_report.json", file=sys.stderr)


if __name__ == "__main__":
    main()
