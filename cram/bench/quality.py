"""Benchmark: MLM quality in equal wall-clock time, the cram recipe against the plain Hugging Face way, on the CPU.

    python -m cram.bench.quality [--minutes 3] [--presets tiny small] [--seeds 0 1 2] [--work-dir runs/bench-quality]

Both sides train on the same prepared text (the embedded corpus minus a held-out 5 % of its documents, packed
into 128-token blocks with one WordPiece tokenizer) and are scored on the same held-out blocks at the same
masking (the recipe's 25 %, exactly 32 positions per block, masks fixed by a seed):
- ours: `recipes/cram.py --preset P --seed S` through `accelerate launch` for T minutes (its budget clock);
- the baseline: `transformers.BertForMaskedLM` at preset P's depth, width, heads and vocabulary, trained as
  `run_mlm.py` does (Trainer, `DataCollatorForLanguageModeling`, AdamW, linear decay after warm-up), for T
  minutes at lr 1e-4 and at 5e-4, then for 2T minutes at the better of the two.
Trainer needs a step count for its schedule, so each baseline run first times 12 steps of its own configuration
(not counted) and sets max_steps to what fits in its minutes; a callback also stops it when the time is up.
Each contender runs in a fresh process, one after the other, at the precision `--precision auto` picks. Every
(seed, preset) race runs whole before the next starts, seeds outermost, and the report is rewritten after each, so
a bench cut short still reports every race it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 8192
SEQ_LEN = 128
HELD_OUT_FRACTION = 0.05
EVAL_BATCH = 32
BASELINE_LRS = (1e-4, 5e-4)
BASELINE_BATCH = 32
CALIBRATION_STEPS = 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="T: ours trains T minutes, the baseline T and 2T")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=["tiny", "small"],
                        help="model sizes to race (the baseline matches each one's shape)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one race per seed and preset")
    parser.add_argument("--work-dir", default="runs/bench-quality", help="where data, runs and the report go")
    parser.add_argument("--held-out-blocks", type=int, default=512, help="held-out 128-token blocks to score")
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work_dir).resolve()
    if args.contender == "baseline":
        print(json.dumps(train_baseline(work, args.lr, args.minutes, args.presets[0], args.seeds[0])))
        return

    work.mkdir(parents=True, exist_ok=True)
    prepared = prepare_split(work, args.held_out_blocks)
    minutes = args.minutes
    races: list[list[dict]] = []
    for seed in args.seeds:
        for preset in args.presets:
            results = [run_cram(work, prepared, minutes, preset, seed)]
            for lr in BASELINE_LRS:
                results.append(run_baseline_process(work, lr, minutes, preset, seed))
            best_lr = min(results[1:], key=lambda result: result["held_out_loss"])["lr"]
            results.append(run_baseline_process(work, best_lr, 2 * minutes, preset, seed))
            races.append(results)
            report(work, races, minutes)


def prepare_split(work: Path, held_out_blocks: int) -> Path:
    """Hold out 5 % of the embedded corpus's documents, prepare the rest, and pack the held-out blocks."""
    from cram.data import DataOptions, embedded_corpus_path, prepare

    documents = embedded_corpus_path().read_text(encoding="utf-8").splitlines()
    random.Random(0).shuffle(documents)
    cut = int(len(documents) * HELD_OUT_FRACTION)
    (work / "train.jsonl").write_text("\n".join(documents[cut:]) + "\n", encoding="utf-8")
    prepared = prepare(
        DataOptions(sources=[str(work / "train.jsonl")], vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN),
        cache_dir=work / "cache", output_dir=work / "prepared", progress=False,
    )
    tokenizer = prepared.tokenizer
    stream: list[int] = []
    for line in documents[:cut]:
        stream += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
        if len(stream) >= held_out_blocks * SEQ_LEN:
            break
    count = min(held_out_blocks, len(stream) // SEQ_LEN)
    blocks = torch.tensor(stream[: count * SEQ_LEN]).view(count, SEQ_LEN)
    torch.save(blocks, work / "held_out_blocks.pt")
    print(f"data: {len(prepared.dataset):,} training blocks, {count} held-out blocks", flush=True)
    return prepared.path


def held_out_loss(model: torch.nn.Module, work: Path) -> float:
    """Mean MLM cross-entropy over the masked positions of the held-out blocks; the same masks for every model."""
    from cram.data.collator import MaskedLMCollator
    from cram.data.prepare import load_prepared

    tokenizer = load_prepared(work / "prepared").tokenizer
    collator = MaskedLMCollator.for_tokenizer(tokenizer, mask_fraction=0.25, seed=1234)
    blocks = torch.load(work / "held_out_blocks.pt")
    model.eval().float()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(blocks), EVAL_BATCH):
            serials = torch.arange(start, min(start + EVAL_BATCH, len(blocks)))
            batch = collator({"input_ids": blocks[serials], "serials": serials})
            masked = int((batch["labels"] != -100).sum())
            total += model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item() * masked
            count += masked
    return total / count


def run_cram(work: Path, prepared: Path, minutes: float, preset: str, seed: int) -> dict:
    from cram.models.crammed_bert import CrammedBertForMaskedLM
    from cram.models.crammed_bert_recipe import crammed_bert_recipe

    output_dir = work / f"cram-{preset}-seed{seed}"
    command = [
        Path(sys.executable).with_name("accelerate"), "launch", "-q",
        "--config_file", REPO / "accel_configs" / "cpu.yaml", REPO / "recipes" / "cram.py",
        "--preset", preset, "--seed", seed, "--budget", f"{round(minutes * 60)}s", "--data", prepared,
        "--output-dir", output_dir, "--log-every", "2", "--checkpoint-every-minutes", "0",
    ]
    shutil.rmtree(output_dir, ignore_errors=True)  # the recipe refuses to start afresh over an old run's states
    subprocess.run([str(part) for part in command], check=True, cwd=REPO)
    summary = json.loads((output_dir / "summary.json").read_text())
    model = CrammedBertForMaskedLM.from_pretrained(output_dir / "final")
    return {
        "name": f"cram recipe (crammed BERT, {preset})", "preset": preset, "seed": seed,
        "lr": crammed_bert_recipe(preset).lr, "minutes": minutes,
        "optimizer_steps": summary["optimizer_steps"], "sequences": summary["sequences"],
        "largest_batch": max(row["batch_size"] for row in summary["history"]),
        "train_seconds": summary["seconds"], "held_out_loss": held_out_loss(model, work),
        "curve": [(row["elapsed"], row["loss"]) for row in summary["history"]],
    }


def run_baseline_process(work: Path, lr: float, minutes: float, preset: str, seed: int) -> dict:
    command = [sys.executable, "-m", "cram.bench.quality", "--contender", "baseline", "--work-dir", str(work),
               "--lr", str(lr), "--minutes", str(minutes), "--presets", preset, "--seeds", str(seed)]
    completed = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    print(f"baseline {preset} seed {seed} lr {lr:g}, {minutes:g} min: held-out loss {result['held_out_loss']:.4f}",
          flush=True)
    return result


def train_baseline(work: Path, lr: float, minutes: float, preset: str, seed: int) -> dict:
    """`run_mlm.py`'s way: BertForMaskedLM, DataCollatorForLanguageModeling, Trainer's AdamW and linear schedule."""
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from cram.data.prepare import load_prepared
    from cram.models.crammed_bert import PRESETS
    from cram.train.precision import resolve_precision

    prepared = load_prepared(work / "prepared")
    shape = PRESETS[preset]
    config = BertConfig(
        vocab_size=len(prepared.tokenizer), hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_hidden_layers"], num_attention_heads=shape["num_attention_heads"],
        intermediate_size=4 * shape["hidden_size"],
        max_position_embeddings=SEQ_LEN, pad_token_id=prepared.tokenizer.pad_token_id,
    )
    collator = DataCollatorForLanguageModeling(prepared.tokenizer, mlm_probability=0.25)
    bf16 = resolve_precision("auto", "cpu") == "bf16"

    def trainer_for(max_steps: int, output: str, callback: TrainerCallback) -> Trainer:
        torch.manual_seed(seed)
        arguments = TrainingArguments(
            output_dir=str(work / output), per_device_train_batch_size=BASELINE_BATCH, learning_rate=lr,
            weight_decay=0.01, warmup_steps=0.06, lr_scheduler_type="linear", max_steps=max_steps, bf16=bf16,
            use_cpu=True, logging_steps=5, save_strategy="no", report_to="none", disable_tqdm=True, seed=seed,
        )
        return Trainer(model=BertForMaskedLM(config), args=arguments, train_dataset=prepared.dataset,
                       data_collator=collator, callbacks=[callback])

    timer = StepTimer()
    trainer_for(CALIBRATION_STEPS, "calibration", timer).train()
    max_steps = max(1, int(minutes * 60 / timer.seconds_per_step()))

    stop = StopAtTime(minutes * 60)
    trainer = trainer_for(max_steps, f"baseline-{preset}-seed{seed}-lr{lr:g}-{minutes:g}min", stop)
    output = trainer.train()
    return {
        "name": "HF BertForMaskedLM + Trainer", "preset": preset, "seed": seed, "lr": lr, "minutes": minutes,
        "optimizer_steps": output.global_step, "largest_batch": BASELINE_BATCH,
        "sequences": output.global_step * BASELINE_BATCH, "train_seconds": round(time.perf_counter() - stop.start, 1),
        "planned_steps": max_steps, "held_out_loss": held_out_loss(trainer.model, work), "curve": stop.curve,
    }


class StopAtTime(TrainerCallback):
    """Stops training when the minutes are spent, and records (seconds, loss) at every log."""

    def __init__(self, seconds: float):
        self.seconds, self.start, self.curve = seconds, time.perf_counter(), []

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() - self.start >= self.seconds:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.curve.append((time.perf_counter() - self.start, logs["loss"]))


class StepTimer(TrainerCallback):
    """Times optimizer steps after the first few (which pay one-off costs)."""

    def __init__(self, skip: int = 4):
        self.skip, self.times = skip, []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())

    def seconds_per_step(self) -> float:
        timed = self.times[self.skip:]
        return (timed[-1] - timed[0]) / max(1, len(timed) - 1)


def report(work: Path, races: list[list[dict]], minutes: float) -> None:
    """Every finished race's table, then one line per race and per preset: the recipe at T against the HF way
    at 2T, with the spread over seeds."""
    lines = [f"T = {minutes:g} minutes; held-out MLM loss at 25 % masking on the same blocks (lower is better).", ""]
    for results in races:
        ours = results[0]
        lines += [
            f"preset {ours['preset']}, seed {ours['seed']}:", "",
            "| run | lr | minutes | optimizer steps | largest batch | sequences | held-out loss | perplexity "
            "| ours' loss minus this |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for result in results:
            loss = result["held_out_loss"]
            lines.append(
                f"| {result['name']} | {result['lr']:g} | {result['minutes']:g} | {result['optimizer_steps']:,} | "
                f"{result['largest_batch']:,} | {result['sequences']:,} | {loss:.4f} | {math.exp(loss):.1f} | "
                f"{ours['held_out_loss'] - loss:+.4f} |"
            )
        lines.append("")
    lines += ["| preset | seed | ours at T | HF at 2T | margin (HF 2T minus ours) | ours beats HF at 2T |",
              "|---|---:|---:|---:|---:|---|"]
    margins: dict[str, list[float]] = {}
    for results in races:
        ours, at_double = results[0], results[-1]
        margin = at_double["held_out_loss"] - ours["held_out_loss"]
        margins.setdefault(ours["preset"], []).append(margin)
        lines.append(f"| {ours['preset']} | {ours['seed']} | {ours['held_out_loss']:.4f} | "
                     f"{at_double['held_out_loss']:.4f} | {margin:+.4f} | {'yes' if margin > 0 else 'no'} |")
    lines.append("")
    for preset, values in margins.items():
        wins = sum(value > 0 for value in values)
        lines.append(f"{preset}: the recipe at T beats the HF way at 2T in {wins} of {len(values)} seed(s); margin "
                     f"mean {sum(values) / len(values):+.4f}, min {min(values):+.4f}, max {max(values):+.4f} nat.")
    table = "\n".join(lines)
    print(table, flush=True)
    (work / "quality.md").write_text(table + "\n")
    (work / "quality.json").write_text(json.dumps(races, indent=2) + "\n")
    latest = races[-1][0]
    plot = work / f"quality-{latest['preset']}-seed{latest['seed']}.png"
    plot_curves(races[-1], plot)
    print(f"report: {work / 'quality.md'}, {work / 'quality.json'}, {plot} (one plot per race)")


def plot_curves(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for result in results:
        label = f"{result['name']}, lr {result['lr']:g}, {result['minutes']:g} min"
        seconds, losses = zip(*result["curve"], strict=True) if result["curve"] else ((), ())
        line, = axes.plot([s / 60 for s in seconds], losses, label=f"{label} (training)")
        axes.scatter([result["train_seconds"] / 60], [result["held_out_loss"]], color=line.get_color(), marker="o",
                     zorder=3)
    axes.set_xlabel("wall-clock minutes")
    axes.set_ylabel("MLM loss (lines: training; dots: held-out at the end)")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
