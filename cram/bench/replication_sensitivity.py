"""Benchmark: the replication verdict against runs whose truth is known, pythia-14m trained on the CPU.

    python -m cram.bench.replication_sensitivity [--seeds 8] [--departures half-lr,double-lr,...|all] [--jobs 2]
        [--output-dir runs/bench-replication] [--reuse-runs]

The data: the embedded corpus's documents in one fixed shuffle; the first ones are the training set (a byte-level
BPE trained on them, and their tokens as a document-level Megatron file), the next ones, which no run sees, the
held-out file in the layout of the Pile's split (val.jsonl.zst: zstandard-compressed JSON lines of "text" and
"meta": {"pile_set_name": ...}).

The runs: recipes/pythia.py, pythia-14m in fp32 on one process, small sequences and batch, a --max-steps schedule
long enough to pass step 512, its revisions kept at some of Pythia's checkpoint steps up to 512 and at late steps
after: faithful seeds 1 … S, and departures from the recipe, each trained from seed S (the seed left out of the
departures' references, whose init a reference must not share). A departure the recipe has a flag for is that flag
(--lr, --global-batch-size); one it has none for (no warm-up, GPT-NeoX's default init) replaces a field of the
recipe's or the size table's row in the process that runs it, and nothing else.

The check (python -m cram.eval.replication, every step the runs kept, a fixed number of held-out sequences so that a
rerun scores the same text):
- leave-one-out: each faithful seed against all the others; the false-fail rate is the share that fail. Seed S
  against seeds 1 … S−1 is "one more faithful seed" against K = S − 1 references;
- each departure against seeds 1 … K: whether it fails, first at which step, early (≤ 512) or late, its z-scores;
  half the global batch cannot be compared, and must be refused (exit 2).

The verdict's false fails and power on simulated seeds are cram.bench.replication_power's (`make bench-replication`
runs it first).

Commands run in --jobs worker processes, each in-process as `python SCRIPT` or `python -m MODULE` runs it (the
interpreter and its imports start once a worker, not once a command), one thread each. A table goes to stdout,
the figures to OUTPUT_DIR/results.json, each command's output to OUTPUT_DIR/logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import runpy
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "pythia.py"
SIZE = "pythia-14m"
VOCAB_MULTIPLE = 128  # GPT-NeoX neox_args.py: make_vocab_size_divisible_by (the 20B tokenizer's 50,277 -> 50,304)


@dataclass(frozen=True)
class Scale:
    """How big the data and the runs are: the benchmark's, or a test's smaller one."""

    train_documents: int
    heldout_documents: int
    tokenizer_vocab: int
    seq_len: int
    global_batch_size: int
    max_steps: int
    steps: tuple[int, ...]  # the revisions each run keeps, all of which the check compares
    heldout_sequences: int  # held-out sequences each model scores

    @property
    def vocab_size(self) -> int:
        """Embedding rows: the tokenizer's vocabulary padded up as Pythia pads the 20B tokenizer's."""
        return -(-self.tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


# 640 steps of 8 × 32 tokens: each run passes step 512 in well under a minute of one core; about a third of the
# training set's tokens, so no run repeats text.
BENCH_SCALE = Scale(train_documents=1500, heldout_documents=400, tokenizer_vocab=1000, seq_len=32,
                    global_batch_size=8, max_steps=640, steps=(0, 4, 16, 64, 256, 512, 576, 640),
                    heldout_sequences=128)


@dataclass(frozen=True)
class Departure:
    """A way a run can differ from the recipe, as a user would make it."""

    name: str
    what: str
    options: dict[str, str] = field(default_factory=dict)  # recipe flags set
    recipe_fields: dict[str, object] = field(default_factory=dict)  # PythiaRecipe fields replaced (no flag)
    size_fields: dict[str, object] = field(default_factory=dict)  # the size table's row's fields replaced (no flag)
    comparable: bool = True  # False: the check must refuse the run before scoring it


def departures(scale: Scale) -> dict[str, Departure]:
    """Every departure the benchmark knows, by name."""
    from cram.models.pythia_model import NEOX_DEFAULT, NEOX_INIT_STD, PYTHIA_SIZES
    from cram.models.pythia_recipe import pythia_recipe

    recipe, peak_lr = pythia_recipe(SIZE), PYTHIA_SIZES[SIZE].peak_lr
    half_batch = str(scale.global_batch_size // 2)
    known = (
        Departure("half-lr", f"half the peak learning rate (--lr {peak_lr / 2:g}, the size's {peak_lr:g})",
                  {"--lr": f"{peak_lr / 2:g}"}, comparable=False),
        Departure("double-lr", f"double the peak learning rate (--lr {peak_lr * 2:g}, the size's {peak_lr:g})",
                  {"--lr": f"{peak_lr * 2:g}"}, comparable=False),
        Departure("no-warm-up", f"no warm-up: the cosine from the peak at step 0 (the recipe warms up over "
                                f"{recipe.warmup_fraction:.0%} of the steps)", recipe_fields={"warmup_fraction": 0.0}),
        Departure("neox-init", f"GPT-NeoX's default init (normal {NEOX_INIT_STD:g}, scaled_normal), where the size's "
                               "config names small_init and wang_init", size_fields={"init": NEOX_DEFAULT}),
        Departure("no-weight-decay", f"no weight decay (the recipe's {recipe.weight_decay:g})",
                  recipe_fields={"weight_decay": 0.0}, comparable=False),
        Departure("adam-beta2-0.999", f"Adam's beta2 0.999 (the recipe's {recipe.betas[1]:g})",
                  recipe_fields={"betas": (recipe.betas[0], 0.999)}),
        Departure("half-batch", f"half the global batch (--global-batch-size {half_batch})",
                  {"--global-batch-size": half_batch, "--micro-batch-size": half_batch}, comparable=False),
    )
    return {departure.name: departure for departure in known}


DEFAULT_DEPARTURES = ("half-lr", "double-lr", "no-warm-up", "neox-init", "half-batch")


@dataclass(frozen=True)
class Data:
    prefix: Path  # the training set's Megatron .bin/.idx prefix
    tokenizer: Path
    heldout: Path  # val.jsonl.zst


def corpus_split(train_documents: int, heldout_documents: int) -> tuple[list[str], list[str]]:
    """The training and the held-out documents: disjoint slices of one fixed shuffle of the embedded corpus."""
    from cram.data import embedded_corpus_path

    with open(embedded_corpus_path(), encoding="utf-8") as file:
        texts = [json.loads(line)["text"] for line in file]
    if train_documents + heldout_documents > len(texts):
        raise ValueError(f"the embedded corpus has {len(texts)} documents, fewer than the "
                         f"{train_documents + heldout_documents} asked for")
    random.Random(0).shuffle(texts)
    return texts[:train_documents], texts[train_documents:train_documents + heldout_documents]


def write_heldout(path: Path, texts: list[str], set_name: str) -> Path:
    """`texts` as the Pile's splits ship: zstandard-compressed JSON lines of "text" and "meta"."""
    import zstandard

    lines = "".join(json.dumps({"text": text, "meta": {"pile_set_name": set_name}}) + "\n" for text in texts)
    path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    return path


def write_data(folder: Path, scale: Scale, train: list[str], heldout: list[str]) -> Data:
    """The tokenizer (trained on the training documents alone), the training set and the held-out file in `folder`."""
    from cram.data.megatron import tokenized_documents, write_megatron
    from cram.data.tokenizer import train_byte_level_bpe

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_byte_level_bpe(iter(train), scale.tokenizer_vocab, lowercase=False, model_max_length=2048)
    tokenizer.save_pretrained(folder / "tokenizer")
    write_megatron(folder / "document", tokenized_documents(train, tokenizer))
    return Data(folder / "document", folder / "tokenizer",
                write_heldout(folder / "val.jsonl.zst", heldout, "embedded-corpus"))


def build_index(data: Data, scale: Scale) -> None:
    """GPT-NeoX's index of the training set as the faithful runs read it, built here once rather than by the first run
    of every worker at the same time."""
    from cram.data.causal import load_causal_data

    load_causal_data(str(data.prefix), scale.seq_len, scale.vocab_size, str(data.tokenizer), None,
                     scale.max_steps * scale.global_batch_size)


def recipe_command(data: Data, scale: Scale, seed: int, output_dir: Path, departure: Departure | None) -> list[str]:
    """`python recipes/pythia.py …` (without `python`) for one run."""
    options = {"--size": SIZE, "--data": str(data.prefix), "--tokenizer": str(data.tokenizer),
               "--vocab-size": str(scale.vocab_size), "--seq-len": str(scale.seq_len),
               "--global-batch-size": str(scale.global_batch_size), "--micro-batch-size": str(scale.global_batch_size),
               "--max-steps": str(scale.max_steps), "--seed": str(seed), "--precision": "fp32",
               "--revision-steps": ",".join(map(str, scale.steps)), "--checkpoint-every-minutes": "0",
               "--log-every": str(max(1, scale.max_steps // 4)), "--output-dir": str(output_dir)}
    if departure is not None:
        options.update(departure.options)
    return [str(RECIPE), *(part for pair in options.items() for part in pair)]


def check_command(run: Path, references: list[Path], data: Data, scale: Scale, output: Path) -> list[str]:
    """`python -m cram.eval.replication …` (without `python`): `run` against `references` on the held-out file."""
    return ["-m", "cram.eval.replication", str(run), *(part for reference in references
                                                        for part in ("--reference", str(reference))),
            "--data", str(data.prefix), "--heldout", str(data.heldout), "--sequences", str(scale.heldout_sequences),
            "--steps", ",".join(map(str, scale.steps)),
            "--device", "cpu", "--micro-batch-size", "32", "--output", str(output)]


@contextmanager
def departed(departure: Departure | None) -> Iterator[None]:
    """The recipe as `departure` changes it where it has no flag for the change; restored on the way out."""
    if departure is None or not (departure.recipe_fields or departure.size_fields):
        yield
        return
    import cram.models.pythia_model as sizes
    import cram.models.pythia_recipe as recipes

    # recipes/pythia.py looks both up when it starts, so a run started in here trains with the changed ones.
    published_recipe, published_size = recipes.pythia_recipe, sizes.PYTHIA_SIZES[SIZE]
    recipes.pythia_recipe = lambda name: dataclasses.replace(published_recipe(name), **departure.recipe_fields)
    sizes.PYTHIA_SIZES[SIZE] = dataclasses.replace(published_size, **departure.size_fields)
    try:
        yield
    finally:
        recipes.pythia_recipe, sizes.PYTHIA_SIZES[SIZE] = published_recipe, published_size


def run_command(command: list[str], log: Path, departure: Departure | None = None) -> int:
    """Run `python COMMAND` (a script and its arguments, or -m MODULE and its) in this process as the interpreter
    would, its output to `log`: its exit status (an uncaught exception: 1, its traceback in the log)."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output, redirect_stdout(output), redirect_stderr(output), departed(departure):
        try:
            if command[0] == "-m":
                sys.argv = [command[1], *command[2:]]
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(command)
                runpy.run_path(command[0], run_name="__main__")
            status = 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except Exception:  # noqa: BLE001 - as the interpreter ends on one: a traceback and exit status 1
            traceback.print_exc()
            status = 1
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path  # a recipe takes its own folder off the import path
    return status


@dataclass(frozen=True)
class Task:
    """One command for a worker: a run to train, or a check."""

    name: str
    command: list[str]
    log: Path
    departure: Departure | None = None
    cost: float = 1.0  # relative, to share the tasks out evenly


def run_tasks(tasks: list[Task], jobs: int, scale: Scale, folder: Path) -> dict[str, dict]:
    """Run `tasks` in `jobs` worker processes (the costliest first, each to the least loaded worker): per task, its
    exit status and seconds."""
    shares: list[list[Task]] = [[] for _ in range(min(jobs, len(tasks)))]
    for task in sorted(tasks, key=lambda task: -task.cost):
        min(shares, key=lambda share: sum(task.cost for task in share)).append(task)
    folder.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "CRAM_CPU_THREADS": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    workers = []
    for index, share in enumerate(shares):
        plan = folder / f"worker-{index}.json"
        plan.write_text(json.dumps({"scale": dataclasses.asdict(scale), "tasks": [
            {"name": task.name, "command": task.command, "log": str(task.log),
             "departure": task.departure.name if task.departure else None} for task in share]}))
        with open(folder / f"worker-{index}.err", "w") as errors:
            workers.append(subprocess.Popen([sys.executable, "-m", "cram.bench.replication_sensitivity", "--worker",
                                             str(plan)], stdout=subprocess.PIPE, stderr=errors, text=True,
                                            env=environment, cwd=REPO))
    results = {}
    for worker in workers:
        output, _ = worker.communicate()
        for line in output.splitlines():
            if line.startswith("{"):
                result = json.loads(line)
                results[result.pop("name")] = result
    return results


def worker(plan_path: Path) -> None:
    """Run a worker's share of the tasks one after the other, a JSON line each on stdout."""
    plan = json.loads(plan_path.read_text())
    scale = Scale(**{**plan["scale"], "steps": tuple(plan["scale"]["steps"])})
    known = departures(scale)
    for task in plan["tasks"]:
        started = time.perf_counter()
        status = run_command(task["command"], Path(task["log"]), known.get(task["departure"]))
        print(json.dumps({"name": task["name"], "status": status, "seconds": time.perf_counter() - started}),
              flush=True)


def check_outcome(status: int, output: Path, log: Path) -> dict:
    """What one check said: its exit status and verdicts, or the sentence it refused with."""
    outcome: dict = {"status": status}
    if status not in (0, 1):
        lines = log.read_text().strip().splitlines()
        outcome["refusal"] = next((line for line in reversed(lines) if line.startswith("error: ")),
                                  lines[-1] if lines else "")
        return outcome
    result = json.loads((output / "replication.json").read_text())
    rows = result["rows"]
    outcome.update(
        passed=result["passed"], first_failed_step=result["first_failed_step"],
        early=result["phases"]["early"]["passed"], late=result["phases"]["late"]["passed"],
        critical=rows[0]["critical"], z={row["step"]: row["z"] for row in rows},
        ours={row["step"]: row["ours"] for row in rows}, mean={row["step"]: row["mean"] for row in rows},
        spread={row["step"]: row["spread"] for row in rows},
        scoring_error={row["step"]: row["scoring_error"] for row in rows})
    return outcome


def false_fail_rate(leave_one_out: dict[str, dict]) -> float:
    """The share of faithful seeds the check fails against the others."""
    return sum(1 for outcome in leave_one_out.values() if outcome["status"] != 0) / len(leave_one_out)


def format_outcome(name: str, outcome: dict, steps: tuple[int, ...]) -> str:
    """One table line: the verdict, early and late, and the z-score per step (* where the step fails)."""
    if "refusal" in outcome:
        return f"{name:<18} refused (exit {outcome['status']}): {outcome['refusal']}"
    phases = " ".join(f"{phase} {'pass' if outcome[phase] else 'FAIL'}" for phase in ("early", "late")
                      if outcome[phase] is not None)
    verdict = "PASS" if outcome["passed"] else f"FAIL at {outcome['first_failed_step']}"
    z = " ".join(f"{outcome['z'][step]:+7.1f}{'*' if abs(outcome['z'][step]) > outcome['critical'] else ' '}"
                 for step in steps)
    return f"{name:<18}{verdict:<13}{phases:<22}{z}"


def machine() -> dict:
    """The CPU the figures come from and how busy it was."""
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    return {"cpu": model, "cores": os.cpu_count(), "load_average": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8,
                        help="faithful seeds S (at least 6): each is checked against the other S − 1")
    parser.add_argument("--departures", default=",".join(DEFAULT_DEPARTURES),
                        help="departures to train and check, separated by commas, or all: "
                             + ", ".join(departures(BENCH_SCALE)))
    parser.add_argument("--jobs", type=int, default=2, help="worker processes, one thread each")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench-replication"),
                        help="where the data, runs, checks, logs and results.json go")
    parser.add_argument("--reuse-runs", action="store_true",
                        help="keep the data and the runs a previous call finished here, and check them again")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    known = departures(BENCH_SCALE)
    chosen = list(known) if args.departures == "all" else [name.strip() for name in args.departures.split(",")]
    unknown = [name for name in chosen if name not in known]
    if unknown or args.seeds < 6 or args.jobs < 1:
        parser.error(f"give --seeds 6 or more, --jobs 1 or more and departures among {', '.join(known)}")
    report = sensitivity(BENCH_SCALE, args.seeds, [known[name] for name in chosen], args.jobs,
                         args.output_dir.resolve(), args.reuse_runs)
    print_report(report)


def sensitivity(scale: Scale, seeds: int, chosen: list[Departure], jobs: int, output_dir: Path,
                reuse_runs: bool = False) -> dict:
    """Train the seeds and departures, run every check, and write results.json: the figures, as a dict."""
    started = time.perf_counter()
    report: dict = {"scale": dataclasses.asdict(scale), "seeds": seeds, "machine_before": machine(),
                    "seconds": {}}
    data_folder, runs_folder = output_dir / "data", output_dir / "runs"
    if not reuse_runs:
        for folder in (data_folder, runs_folder, output_dir / "checks", output_dir / "logs"):
            shutil.rmtree(folder, ignore_errors=True)
    if reuse_runs and (data_folder / "val.jsonl.zst").is_file():
        data = Data(data_folder / "document", data_folder / "tokenizer", data_folder / "val.jsonl.zst")
    else:
        data = write_data(data_folder, scale, *corpus_split(scale.train_documents, scale.heldout_documents))
    build_index(data, scale)
    report["seconds"]["data"] = time.perf_counter() - started

    # A departure starts from the init of the seed left out of its references: a run of a reference's seed would
    # share its init, which the check refuses among several references.
    runs = {f"seed{seed}": (seed, None) for seed in range(1, seeds + 1)}
    runs.update({departure.name: (seeds, departure) for departure in chosen})
    training = [Task(name, recipe_command(data, scale, seed, runs_folder / name, departure),
                     output_dir / "logs" / f"train-{name}.log", departure,
                     cost=float(departure.options.get("--global-batch-size", scale.global_batch_size))
                     if departure else float(scale.global_batch_size))
                for name, (seed, departure) in runs.items()
                if not (reuse_runs and (runs_folder / name / "final").is_dir())]
    phase = time.perf_counter()
    report["training"] = run_tasks(training, jobs, scale, output_dir / "logs")
    report["seconds"]["training"] = time.perf_counter() - phase
    failed = {name: result for name, result in report["training"].items() if result["status"] != 0}
    if failed:
        raise RuntimeError(f"runs failed to train: {', '.join(failed)}; see {output_dir / 'logs'}")

    faithful = [runs_folder / f"seed{seed}" for seed in range(1, seeds + 1)]
    checks = [Task(f"seed{seed}", check_command(faithful[seed - 1], faithful[:seed - 1] + faithful[seed:], data,
                                                 scale, output_dir / "checks" / f"seed{seed}"),
                   output_dir / "logs" / f"check-seed{seed}.log") for seed in range(1, seeds + 1)]
    checks += [Task(departure.name, check_command(runs_folder / departure.name, faithful[:-1], data, scale,
                                                  output_dir / "checks" / departure.name),
                    output_dir / "logs" / f"check-{departure.name}.log", cost=1.0 if departure.comparable else 0.1)
               for departure in chosen]
    phase = time.perf_counter()
    statuses = run_tasks(checks, jobs, scale, output_dir / "logs")
    report["seconds"]["checks"] = time.perf_counter() - phase
    outcomes = {task.name: {**check_outcome(statuses[task.name]["status"], output_dir / "checks" / task.name,
                                            task.log), "seconds": statuses[task.name]["seconds"]}
                for task in checks}
    report["leave_one_out"] = {f"seed{seed}": outcomes[f"seed{seed}"] for seed in range(1, seeds + 1)}
    report["false_fail_rate"] = false_fail_rate(report["leave_one_out"])
    report["departures"] = {departure.name: {"what": departure.what, "comparable": departure.comparable,
                                             **outcomes[departure.name]} for departure in chosen}
    report["seconds"]["total"] = time.perf_counter() - started
    report["machine_after"] = machine()
    (output_dir / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    report["output_dir"] = str(output_dir)
    return report


def print_report(report: dict) -> None:
    scale, seeds = report["scale"], report["seeds"]
    steps = tuple(scale["steps"])
    print(f"{SIZE}, {scale['max_steps']} steps of {scale['global_batch_size']} × {scale['seq_len']} tokens in fp32, "
          f"{seeds} faithful seeds; the check on {scale['heldout_sequences']} held-out sequences at steps "
          f"{', '.join(map(str, steps))}; z per step, * out of the band")
    header = f"{'run':<18}{'verdict':<13}{'phases':<22}" + "".join(f"{step:>9}" for step in steps)
    print(f"\nleave-one-out: each seed against the other {seeds - 1}\n{header}")
    for name, outcome in report["leave_one_out"].items():
        print(format_outcome(name, outcome, steps))
    failures = sum(1 for outcome in report["leave_one_out"].values() if outcome["status"] != 0)
    print(f"false-fail rate: {failures}/{seeds} = {report['false_fail_rate']:.2f}")
    print(f"\ndepartures, each against seeds 1 … {seeds - 1}\n{header}")
    for name, outcome in report["departures"].items():
        print(format_outcome(name, outcome, steps))
    seconds = report["seconds"]
    print(f"\nwall time {seconds['total']:.0f} s (data {seconds['data']:.0f} s, training {seconds['training']:.0f} s, "
          f"checks {seconds['checks']:.0f} s) on {report['machine_before']['cores']} cores of "
          f"{report['machine_before']['cpu']}, load average before "
          f"{report['machine_before']['load_average'][0]:.1f}, after {report['machine_after']['load_average'][0]:.1f}"
          f"; {report['output_dir']}/results.json")


if __name__ == "__main__":
    main()
