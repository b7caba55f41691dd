"""The check to run on a GPU machine, first thing: what it is, how fast, and how fast cram trains on it.

    make device-check PYTHON=python3 OUT=DIR MAX_MINUTES=8 [ORIGINAL=PATH]
    python3 -m cram.bench.device_check --output-dir DIR [--max-minutes 8] [--original PATH] [--rows 'TEXT|...']
        [--shape full|toy] [--compile auto|true|false]

It runs with the interpreter it is given, as it is: torch, transformers and Accelerate are all it needs (no pip, no
network, no data); a row that needs more (datasets, DeepSpeed, omegaconf, a fused-loss kernel) says so and the
others run. Its rows, in the order of what they tell per minute of GPU time:

1. the versions, the GPU and what `auto` picks; 2. a measured bf16 matrix-product peak beside the datasheet's;
3. crammed BERT's and Pythia's steps through the recipes' own code (`cram.bench.recipe_steps`), compiled and eager,
   then the levers (crammed BERT at 2 and 4 times the micro-batch, LayerNorm and the residual stream in bf16,
   Pythia's loss in larger chunks, the compile modes max-autotune and reduce-overhead); 4. the contenders and levers
   of `cram.bench.report_steps` (the original cramming code, Hugging Face's models, compile options, ZeRO-1, the
   loaders, fused losses); 5. one planner probe (`cram.plan.probe`, on the embedded corpus: it needs datasets).

Each row runs in a process of its own (`cram.bench.isolated`), so an out-of-memory error, a compiler error or a
crash is that row's, recorded with its error, and the next row starts on a freed device. Both files,
device_check.json and device_check.md, are written again after every row (and say which row is running), so a run
killed at any point leaves every finished row on disk. The time bound (`--max-minutes`) covers everything, builds,
autotuning, recompiles and timed steps: a row whose estimate (the longest row of its kind so far) would pass it is
skipped, with that reason, and a row still running at the bound is ended there. Each measured row says how it ran,
from dynamo's own counts (graphs, graph breaks, recompiles), so "compiled" is a measurement. On a CPU it runs a toy
shape (the tiny preset and pythia-14m), which the test suite checks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import cram
from cram.bench.isolated import Stopped, run_isolated, stop_on_signals
from cram.bench.measure import DynamoWatch, Row, candidate_row, ran_as
from cram.bench.recipe_steps import recipe_rows
from cram.bench.report_steps import (
    FUSED_LOSSES,
    HF_GPT_NEOX,
    LOADER_WORKERS,
    Setting,
    Shape,
    candidates,
    missing,
    shape_for,
)

REPORTED_PACKAGES = ("torch", "transformers", "accelerate", "datasets", "tokenizers", "deepspeed", "bitsandbytes",
                     "peft", "triton", "omegaconf", "einops", "zstandard", "liger-kernel", "cut-cross-entropy")
DEFAULT_MAX_MINUTES = 8.0  # a 10-minute command, with its start and the writing after the last row
OUTPUT_FILES = ("device_check.json", "device_check.md")
ORIGINALS = "compiled with the original's options"
RECIPE = "the recipe's step"
# (what, faster row, slower row): rows by their name before the shape; {pythia} is the shape's Pythia size, {mode}
# "compiled" where the check compiles, else "eager", {micro2} and {micro4} crammed BERT's larger micro-batches.
RATIOS = (
    ("recipe: crammed BERT compiled / eager", f"crammed BERT, {RECIPE}, compiled", f"crammed BERT, {RECIPE}, eager"),
    ("recipe: pythia compiled / eager", f"{{pythia}}, {RECIPE}, compiled", f"{{pythia}}, {RECIPE}, eager"),
    ("recipe lever: crammed BERT, micro-batch ×2 / the recipe's",
     f"crammed BERT, {RECIPE}, {{mode}}, micro-batch {{micro2}}", f"crammed BERT, {RECIPE}, {{mode}}"),
    ("recipe lever: crammed BERT, micro-batch ×4 / the recipe's",
     f"crammed BERT, {RECIPE}, {{mode}}, micro-batch {{micro4}}", f"crammed BERT, {RECIPE}, {{mode}}"),
    ("recipe lever: crammed BERT, LayerNorm and residual in the autocast dtype / fp32",
     f"crammed BERT, {RECIPE}, {{mode}}, LayerNorm and residual in the autocast dtype",
     f"crammed BERT, {RECIPE}, {{mode}}"),
    ("recipe lever: pythia, its loss at 2^28 logits a chunk / 2^26",
     f"{{pythia}}, {RECIPE}, {{mode}}, its loss at 2^28 logits a chunk", f"{{pythia}}, {RECIPE}, {{mode}}"),
    *((f"recipe: {family}, --compile {mode} / default", f"{name}, {RECIPE}, --compile {mode}",
       f"{name}, {RECIPE}, compiled")
      for mode in ("max-autotune", "reduce-overhead") for family, name in (("crammed BERT", "crammed BERT"),
                                                                         ("pythia", "{pythia}"))),
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
    """Each reported package's version, None where it is not installed or its module does not import here."""
    versions: dict[str, str | None] = {"python": platform.python_version(), "cram": cram_version()}
    for package in REPORTED_PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = None
        versions[package] = version if version and not missing(package.replace("-", "_")) else None
    return versions


# The rows' work: each runs in the row's own process, the only place the device is touched.

def environment(compile_choice: str) -> dict:
    """Versions, devices, the `auto` choices, the datasheet's peak."""
    import torch

    from cram.models.pythia_recipe import pythia_recipe
    from cram.train.compilation import resolve_compile
    from cram.train.precision import resolve_precision
    from cram.train.throughput import peak_flops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision("auto", device.type)
    if device.type == "cuda":
        devices = []
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            devices.append({"device": f"cuda:{index}", "name": properties.name,
                            "compute capability": f"{properties.major}.{properties.minor}",
                            "memory GiB": round(properties.total_memory / 2**30, 1)})
    else:
        devices = [{"device": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}]
    peak = peak_flops(device)
    return {
        "versions": {**installed_versions(), "CUDA (torch built with)": torch.version.cuda or "none: a CPU build"},
        "devices": devices,
        "device type": device.type,
        "auto choices": {"precision": precision, "compile": resolve_compile("auto", device.type),
                         "compile used here": resolve_compile(compile_choice, device.type),
                         # The released Pythia's precision where the device runs it, as recipes/pythia.py trains it.
                         "Pythia's precision": pythia_recipe("pythia-160m").precision if device.type == "cuda"
                         else precision},
        "datasheet bf16 TFLOP/s": peak / 1e12 if peak else None,
    }


def matmul_peak(size: int | None, products: int = 10) -> dict:
    """bf16 matrix products of `size` (None: 8192 on a GPU, 256 on a CPU): the TFLOP/s this device gives a large one
    (the mean of `products` after three warm-ups), the ceiling MFU is also measured against."""
    import torch

    from cram.plan.timing import synchronize

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = size or (8192 if device.type == "cuda" else 256)
    generator = torch.Generator(device=device).manual_seed(0)
    first, second = (torch.randn(size, size, dtype=torch.bfloat16, device=device, generator=generator)
                     for _ in range(2))
    for _ in range(3):
        first @ second
    synchronize(device)
    started = time.perf_counter()
    for _ in range(products):
        first @ second
    synchronize(device)
    seconds = time.perf_counter() - started
    return {"measured bf16 TFLOP/s": 2 * size**3 * products / seconds / 1e12, "size": size, "products": products}


def planner_probe(model: str, micro_batch: int, warmup: int, timed: int, compiled: bool) -> dict:
    """One probe of the planner, as `recipes/plan.py` launches it: the recipes' loop timed on the embedded corpus at
    `micro_batch`, compiled as the check's other rows are, one training-state save timed after it."""
    with tempfile.TemporaryDirectory(prefix="cram-device-check-probe-") as folder:
        return probe_in(Path(folder), model, micro_batch, warmup, timed, compiled)


def probe_in(folder: Path, model: str, micro_batch: int, warmup: int, timed: int, compiled: bool) -> dict:
    import torch

    from cram.plan.models import recipe_for
    from cram.plan.probe import run_request
    from cram.plan.setting import Setting as ProbeSetting
    from cram.plan.setting import probe_request
    from cram.plan.space import Candidate as ProbeCandidate
    from cram.train.accelerator import build_accelerator

    os.environ.setdefault("CRAM_CACHE", str(folder / "cache"))  # where the corpus is prepared, unless given
    seq_len = recipe_for(model).seq_len
    setting = ProbeSetting(model, seq_len, micro_batch * 4, 1, False, "", None, warmup, timed)
    # A GPU's limit is its memory; on the CPU the probe needs one, which a toy step stays far below.
    limit = None if torch.cuda.is_available() else 8 * 2**30
    request = probe_request(setting, ProbeCandidate(), folder / "probe.json", mode="time", micro_batch=micro_batch,
                            memory_limit_bytes=limit, timed_steps=timed, compile="true" if compiled else "false")
    watch = DynamoWatch()
    accelerator = build_accelerator(request["precision"], request["compile"], None, str(folder))
    result = run_request(request, accelerator)
    step = result["step_time"]
    return {"tokens_per_second": result["tokens_per_second"], "seconds_per_step": step["median"],
            "ran_as": ran_as(watch.since_start()),
            "peak_memory_gib": result["peak_memory_bytes"] / 2**30 if result["peak_memory_bytes"] else None,
            "flops_per_token": result["flops_per_token"], "save_seconds": result["save_seconds"],
            "note": f"{model}, micro-batch {micro_batch}, {result['accumulation']} a step; one save "
                    f"{result['save_seconds']:.1f} s"}


# The rows and the run.

def facts_rows(compile_choice: str, shape_name: str | None) -> list[Row]:
    """The rows every run starts with, before the device is known to this process."""
    size = {"full": 8192, "toy": 256}.get(shape_name or "")
    return [Row("environment: versions, devices, the auto choices", "facts", "facts",
                lambda: environment(compile_choice)),
            Row("bf16 matrix products: the measured peak", "facts", "facts", lambda: matmul_peak(size))]


def measured_rows(shape: Shape, setting: Setting, shape_name: str) -> list[Row]:
    """Every row after the facts, in their order."""
    probe_model, probe_micro = ("crammed-bert", 128) if shape_name == "full" else ("crammed-bert-tiny", 4)
    probe = Row(f"the planner's probe ({probe_model}, micro-batch {probe_micro})", "planner",
                "compiled" if setting.compiled else "eager",
                lambda: planner_probe(probe_model, probe_micro, shape.rounds.warmup, 3, setting.compiled),
                unavailable="the planner's probe prepares the embedded corpus with datasets, which is not installed: "
                            "carry its wheels (docs/benchmarks.md: Carrying wheels)" if missing("datasets") else None)
    return [*recipe_rows(shape, setting),
            *(candidate_row(candidate, shape.rounds, setting.device) for candidate in candidates(shape, setting)),
            probe]


class Report:
    """The report as it grows: written to both files after every change, atomically (a temporary name, renamed)."""

    def __init__(self, output_dir: Path, argv: list[str], max_minutes: float):
        self.output_dir = output_dir
        self.data: dict = {"command": "python -m cram.bench.device_check " + " ".join(argv), "finished": False,
                           "max minutes": max_minutes, "shape": None, "environment": None,
                           "peaks": {"datasheet bf16 TFLOP/s": None, "measured bf16 TFLOP/s": None},
                           "plan": None, "running": None, "rows": [], "ratios": {}, "minutes spent": 0.0}

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)

    def write(self) -> None:
        self.data["ratios"] = ratios(self.data)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for name, text in zip(OUTPUT_FILES, (json.dumps(self.data, indent=2) + "\n", render_markdown(self.data)),
                              strict=True):
            staging = self.output_dir / f"{name}.tmp"
            staging.write_text(text)
            staging.replace(self.output_dir / name)


def ratios(data: dict) -> dict[str, float | None]:
    """Each ratio of tokens/s whose two rows were measured; None where either was not."""
    rates = {row["name"].split(" (")[0]: row.get("tokens_per_second") for row in data["rows"]}
    fields = data.get("name fields") or {}
    result = {}
    for what, faster, slower in RATIOS:
        faster_rate, slower_rate = (rates.get(name.format(**fields)) if fields else None for name in (faster, slower))
        result[what] = faster_rate / slower_rate if faster_rate and slower_rate else None
    return result


def with_mfu(fields: dict, row: Row, peaks: dict) -> dict:
    """The row's MFU against the datasheet's peak and the measured one, and for a causal model its attention's
    causal half as well."""
    rate = fields.get("tokens_per_second")
    flops = fields.get("flops_per_token") or row.flops_per_token
    causal = row.causal_flops_per_token
    fields = {**fields, "flops_per_token": flops, "causal_flops_per_token": causal}
    for key, peak in (("datasheet", peaks["datasheet bf16 TFLOP/s"]),
                      ("measured peak", peaks["measured bf16 TFLOP/s"])):
        fields[f"mfu ({key})"] = rate * flops / (peak * 1e12) if rate and flops and peak else None
        fields[f"mfu ({key}, causal half)"] = rate * causal / (peak * 1e12) if rate and causal and peak else None
    return fields


def run_check(output_dir: Path, argv: list[str], max_minutes: float, shape_name: str | None, compile_choice: str,
              original: Path | None, wanted: list[str], say: Callable[[str], None],
              clock: Callable[[], float] = time.monotonic) -> dict:
    """Every row in turn, each in its own process, within `max_minutes`; the report written after each."""
    started = clock()
    deadline = started + max_minutes * 60
    report = Report(output_dir, argv, max_minutes)
    longest: dict[str, float] = {}  # the longest row so far of each kind, the estimate of the next of its kind
    stop_on_signals()
    rows = facts_rows(compile_choice, shape_name)
    index = 0
    try:
        while index < len(rows):
            row = rows[index]
            index += 1
            if wanted and row.group != "facts" and not any(text in row.name for text in wanted):
                continue
            entry = run_row(row, report, longest, deadline, max_minutes, clock, say)
            report.data["minutes spent"] = (clock() - started) / 60
            if row.group == "facts" and entry["status"] == "measured":
                rows += facts_followed(entry, report, rows, shape_name, compile_choice, original, say)
            report.write()
        if len(rows) == 2:  # no environment: the rest cannot be named
            say("the environment row failed, so the rows after it were not built")
        report.data["finished"] = True
    except Stopped as stopped:
        running = report.data["running"]
        if running is not None:
            report.add({"name": running["row"], "group": running["group"], "status":
                        f"stopped: the device check was stopped by {stopped.signal_name}"})
        report.data["stopped by"] = stopped.signal_name
        raise
    finally:
        report.data["running"] = None
        report.data["minutes spent"] = (clock() - started) / 60
        report.write()
    return report.data


def facts_followed(entry: dict, report: Report, rows: list[Row], shape_name: str | None, compile_choice: str,
                   original: Path | None, say: Callable[[str], None]) -> list[Row]:
    """After a facts row: the environment names the device, and so the shape and every row after the facts; the
    matrix products give the measured peak."""
    data = report.data
    if "measured bf16 TFLOP/s" in entry:
        data["peaks"]["measured bf16 TFLOP/s"] = entry["measured bf16 TFLOP/s"]
        return []
    import torch

    environment_facts = {key: value for key, value in entry.items() if key not in ("name", "group", "status")}
    data["environment"] = environment_facts
    data["peaks"]["datasheet bf16 TFLOP/s"] = environment_facts["datasheet bf16 TFLOP/s"]
    device_type = environment_facts["device type"]
    chosen = shape_name or ("full" if device_type == "cuda" else "toy")
    data["shape"] = chosen
    choices = environment_facts["auto choices"]
    shape = shape_for(chosen)
    setting = Setting(torch.device(device_type), choices["precision"], choices["Pythia's precision"],
                      choices["compile used here"], compile_choice, original)
    data["name fields"] = {"pythia": shape.pythia, "mode": setting.mode, "micro2": 2 * shape.bert_batch,
                           "micro4": 4 * shape.bert_batch}
    data["rounds"] = asdict(shape.rounds)
    more = measured_rows(shape, setting, chosen)
    kinds = {kind: sum(1 for row in more if row.kind == kind and row.unavailable is None)
             for kind in ("eager", "compiled", "autotuned")}
    data["plan"] = (f"{len(more) + 2} rows ({sum(1 for row in more if row.unavailable)} of them unavailable here): "
                    f"{kinds['eager']} eager, {kinds['compiled']} compiled, {kinds['autotuned']} compiled with "
                    f"autotuning, each in a process of its own; rows that would pass --max-minutes "
                    f"{data['max minutes']:g} are skipped, with that reason")
    say(data["plan"])
    return more


def run_row(row: Row, report: Report, longest: dict[str, float], deadline: float, max_minutes: float,
            clock: Callable[[], float], say: Callable[[str], None]) -> dict:
    """One row: skipped (unavailable here, or its estimate past the bound), or run in its own process; its entry."""
    entry = {"name": row.name, "group": row.group}
    bound = f"--max-minutes {max_minutes:g}"
    left = deadline - clock()
    like = f"the longest {row.kind} row so far" if row.kind in longest else "the longest row so far"
    estimate = longest.get(row.kind, max(longest.values(), default=0.0))
    if row.unavailable is not None:
        entry["status"] = f"skipped: {row.unavailable}"
    elif left <= 0 or estimate > left:
        entry["status"] = (f"skipped: it would pass the time bound ({bound}): {max(left, 0):.0f} s left, "
                           f"{like} took {estimate:.0f} s")
    else:
        report.data["running"] = {"row": row.name, "group": row.group, "pid": None, "started": time.time()}

        def note_pid(pid: int) -> None:
            report.data["running"]["pid"] = pid
            report.write()

        outcome = run_isolated(row.work, deadline, note_pid, clock)
        report.data["running"] = None
        longest[row.kind] = max(longest.get(row.kind, 0.0), outcome.seconds)
        entry["seconds"] = outcome.seconds
        if outcome.status == "done":
            result = outcome.result if row.group == "facts" else with_mfu(outcome.result, row, report.data["peaks"])
            entry = {**entry, "status": "measured", **result}
        elif outcome.status == "stopped":
            entry["status"] = f"stopped: the time bound ({bound}) ended it after {outcome.seconds:.0f} s"
        elif outcome.error.startswith("Skip: "):
            entry["status"] = f"skipped: {outcome.error.removeprefix('Skip: ')}"
        else:
            entry["status"] = f"failed: {outcome.error}"
    report.add(entry)
    say(f"{row.name}: {entry['status']}" + (f" ({entry['seconds']:.1f} s)" if "seconds" in entry else ""))
    return entry


def render_markdown(data: dict) -> str:
    def show(value: object, percent: bool = False) -> str:
        if value is None:
            return "n/a"
        if percent:
            return f"{100 * value:.1f} %"
        return f"{value:,.3g}" if isinstance(value, float) else str(value)

    lines = ["# cram device check", "", f"`{data['command']}`", ""]
    if data.get("running"):
        lines += [f"**Running:** {data['running']['row']} (the check has not finished)", ""]
    elif not data["finished"]:
        lines += [f"**Stopped** ({data.get('stopped by') or 'before its end'}): the rows below are those finished.",
                  ""]
    environment_facts = data["environment"]
    if environment_facts:
        lines += ["## Versions", "", "| package | version |", "|---|---|"]
        lines += [f"| {package} | {version or 'not installed'} |"
                  for package, version in environment_facts["versions"].items()]
        lines += ["", "## Devices", ""]
        lines += ["- " + ", ".join(f"{key}: {value}" for key, value in device.items())
                  for device in environment_facts["devices"]]
        lines += ["", "## Auto choices", ""]
        lines += [f"- {key}: {value}" for key, value in environment_facts["auto choices"].items()]
    peaks = data["peaks"]
    measured, datasheet = peaks["measured bf16 TFLOP/s"], peaks["datasheet bf16 TFLOP/s"]
    lines += ["", "## Peak", "", f"- bf16 TFLOP/s, datasheet: {show(datasheet)} (cram.train.throughput's table; none "
              "for CPUs and unlisted GPUs)", f"- bf16 TFLOP/s, measured: {show(measured)}"
              + (f" ({show(measured / datasheet, percent=True)} of the datasheet's)" if measured and datasheet else "")]
    lines += ["", f"## Rows ({data['shape'] or 'shape not known yet'} shape, synthetic tokens)", "",
              "MFU: model FLOPs over the datasheet's peak, and over the measured one; for Pythia also with its "
              "attention's causal half (the convention counts the whole square).", "",
              "| row | ran as | tokens/s | MFU | MFU, measured peak | peak memory GiB | free GiB at its start | "
              "s/step | build and warm-up s | s in all | status |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in data["rows"]:
        if row["group"] == "facts":
            continue
        status = f"{row['status']}; {row['note']}" if row.get("note") else row["status"]
        mfu, mfu_measured = (show(row.get(f"mfu ({key})"), percent=True) + (
            f" (causal half {show(row[f'mfu ({key}, causal half)'], percent=True)})"
            if row.get(f"mfu ({key}, causal half)") else "") for key in ("datasheet", "measured peak"))
        numbers = " | ".join(show(row.get(key)) for key in (
            "peak_memory_gib", "free_memory_gib_at_start", "seconds_per_step", "warmup_seconds", "seconds"))
        lines.append(f"| {row['name']} | {row.get('ran_as') or ''} | {show(row.get('tokens_per_second'))} | {mfu} | "
                     f"{mfu_measured} | {numbers} | {status} |")
    failed_facts = [row for row in data["rows"] if row["group"] == "facts" and row["status"] != "measured"]
    lines += [f"- {row['name']}: {row['status']}" for row in failed_facts]
    lines += ["", "## Ratios of tokens/s", "", "| ratio | × |", "|---|---:|"]
    lines += [f"| {what} | {show(value)} |" for what, value in data["ratios"].items() if value is not None]
    lines += ["", "## Time", "", f"- plan: {data['plan'] or 'not made yet'}",
              f"- spent: {data['minutes spent']:.1f} min of the bound's {data['max minutes']:g}",
              "- skipped by the bound: " + (", ".join(row["name"] for row in data["rows"]
                                                      if "time bound" in row["status"]) or "none")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m cram.bench.device_check", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/device-check"),
                        help="where device_check.json and device_check.md are written (after every row)")
    parser.add_argument("--max-minutes", type=float, default=DEFAULT_MAX_MINUTES,
                        help="the bound on the whole check: a row that would pass it is skipped, with that reason, "
                             "and a row still running at it is ended")
    parser.add_argument("--shape", choices=("full", "toy"), default=None,
                        help="full (the default on GPUs) or toy (the default on CPUs)")
    parser.add_argument("--compile", choices=("auto", "true", "false"), default="auto",
                        help="whether the compiled rows run: auto (where recipes compile), true, false")
    parser.add_argument("--original", type=Path, default=None,
                        help="a checkout of the original cramming code (JonasGeiping/cramming: the folder holding "
                             "its pretrain.py) to time beside crammed BERT; it needs omegaconf and einops")
    parser.add_argument("--rows", default="",
                        help="only the rows whose name holds one of these texts, separated by | (and the facts)")
    args = parser.parse_args(argv)
    if args.max_minutes <= 0:
        parser.error("--max-minutes must be above 0")
    # The rows' processes are forked from this one, which must not initialise CUDA: a library asking whether there
    # is a GPU asks NVML instead of the CUDA runtime.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    say(f"device check: at most {args.max_minutes:g} min; both files written to {args.output_dir} after every row")
    wanted = [text.strip() for text in args.rows.split("|") if text.strip()]
    try:
        data = run_check(args.output_dir, argv, args.max_minutes, args.shape, args.compile, args.original, wanted,
                         say)
    except Stopped as stopped:
        say(f"stopped by {stopped.signal_name}: {args.output_dir / OUTPUT_FILES[1]} holds the rows finished")
        raise SystemExit(128 + {"SIGTERM": 15, "SIGINT": 2}[stopped.signal_name]) from None
    print(render_markdown(data))
    say(f"written: {args.output_dir / OUTPUT_FILES[1]} and {OUTPUT_FILES[0]}")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
