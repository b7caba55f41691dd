"""GLUE metrics (scikit-learn/scipy: the `glue` extra), the median over seeds, and the report: markdown, JSON, chart.

The headline layout is the table of cramming's model_card.md ("Evaluation results"): MNLI m/mm, QQP, QNLI, SST-2,
CoLA, STS-B, MRPC, RTE and the average of those 9 numbers (MNLI counted twice), ×100, with the published
crammed-BERT and BERT-base rows beside ours. Ours is shown twice: the median over each task's fine-tuning seeds,
which is what the published crammed-BERT row reports (model_card.md: "the median over 5 trials"), and the single
fine-tuning with seed 0, one run of those the median is taken over.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

from cram.optional import import_optional

# The headline's 9 numbers: (result key, primary metric, column title).
HEADLINE = [
    ("mnli_matched", "accuracy", "MNLI m"),
    ("mnli_mismatched", "accuracy", "MNLI mm"),
    ("qqp", "f1", "QQP"),
    ("qnli", "accuracy", "QNLI"),
    ("sst2", "accuracy", "SST-2"),
    ("cola", "matthews", "CoLA"),
    ("stsb", "pearson", "STS-B"),
    ("mrpc", "f1", "MRPC"),
    ("rte", "accuracy", "RTE"),
]
PRIMARY = {key: metric for key, metric, _ in HEADLINE}

# GLUE dev ×100 as published, in HEADLINE order, then the published average: crammed BERT from cramming's
# model_card.md ("Evaluation results": the median over 5 fine-tunings); the v1 model and BERT-base from the paper's
# GLUE-dev results table (Geiping & Goldstein, "Cramming", arXiv:2212.14034).
PUBLISHED = {
    "crammed BERT, 24 h, one A6000 (model card: median of 5 fine-tunings)": [
        84.1, 84.6, 87.5, 90.2, 92.0, 53.3, 87.4, 88.9, 58.5, 80.7],
    "crammed BERT, v1 code, one A6000": [83.9, 84.1, 87.3, 89.5, 92.2, 44.5, 84.6, 87.5, 53.8, 78.6],
    "BERT-base, fully trained": [83.2, 83.4, 87.7, 90.6, 91.9, 56.5, 86.7, 89.3, 59.2, 80.9],
}


def task_metrics(result_key: str, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The protocol's metric for one dev set plus the secondary ones people quote; `predictions` are the model's
    outputs (class logits, or the score for STS-B)."""
    stats = import_optional("scipy.stats", package="scipy", extra="glue", purpose="GLUE's metrics")
    sklearn_metrics = import_optional("sklearn.metrics", package="scikit-learn", extra="glue", purpose="GLUE's metrics")
    if result_key == "stsb":
        scores = predictions.reshape(-1).astype(np.float64)
        return {"pearson": float(stats.pearsonr(scores, labels)[0]),
                "spearman": float(stats.spearmanr(scores, labels)[0])}
    classes = predictions.argmax(-1) if predictions.ndim == 2 else predictions
    metrics = {"accuracy": float(sklearn_metrics.accuracy_score(labels, classes))}
    if result_key == "cola":
        metrics["matthews"] = float(sklearn_metrics.matthews_corrcoef(labels, classes))
    if result_key in ("mrpc", "qqp"):
        metrics["f1"] = float(sklearn_metrics.f1_score(labels, classes))
    return metrics


def summarize(results: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per dev set and metric: the median over seeds, the smallest and largest value, and the number of seeds."""
    by_key: dict[str, dict[str, list[float]]] = {}
    for result in results:
        for key, metrics in result["dev"].items():
            for metric, value in metrics.items():
                by_key.setdefault(key, {}).setdefault(metric, []).append(value)
    return {
        key: {
            metric: {"median": statistics.median(values), "min": min(values), "max": max(values), "seeds": len(values)}
            for metric, values in metrics.items()
        }
        for key, metrics in by_key.items()
    }


def seed_zero(results: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """The summary of the runs with seed 0 alone (each "median" is then that one run's value)."""
    return summarize([result for result in results if result["seed"] == 0])


def headline(summary: dict) -> tuple[list[float | None], float | None]:
    """The 9 headline numbers (×100, None for tasks not run) and their average (None unless all 9 are there)."""
    numbers = [
        100 * summary[key][metric]["median"] if key in summary else None for key, metric, _ in HEADLINE
    ]
    present = [number for number in numbers if number is not None]
    return numbers, (sum(present) / len(present) if len(present) == len(HEADLINE) else None)


def markdown_report(model_name: str, summary: dict, seeds: dict[str, int], seed0: dict | None = None) -> str:
    """The headline table (ours, then ours with seed 0 alone when `seed0` is given, then the published rows) and
    every metric's spread over seeds."""
    numbers, average = headline(summary)

    def cells(values: list[float | None]) -> list[str]:
        return [f"{value:.1f}" if value is not None else "–" for value in values]

    def row(name: str, values: list[float | None], avg: float | None) -> str:
        shown = cells(values)
        mnli = f"{shown[0]}/{shown[1]}"
        return f"| {name} | {mnli} | {' | '.join(shown[2:])} | {cells([avg])[0]} |"

    lines = [
        "| model | MNLI m/mm | QQP | QNLI | SST-2 | CoLA | STS-B | MRPC | RTE | avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
        row(f"**ours**: {model_name} (median over seeds)", numbers, average),
    ]
    if seed0 is not None:
        lines.append(row(f"ours, seed 0 alone (one fine-tuning per task): {model_name}", *headline(seed0)))
    lines += [row(name, published[:9], published[9]) for name, published in PUBLISHED.items()]
    lines += [
        "",
        "GLUE dev ×100; **ours** is the median over each task's fine-tuning seeds (the seeds column below), as the "
        "published crammed-BERT row is the median over 5 fine-tunings (cramming's model_card.md)"
        + ("; the next row is a single fine-tuning per task, the one with seed 0, not a median"
           if seed0 is not None else "")
        + ". The average is over the 9 numbers (MNLI twice)"
        + ("" if average is not None else "; it is shown only when all 9 were run") + ".",
        "",
        "| task | metric | median | min | max | seeds |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, metrics in summary.items():
        for metric, values in metrics.items():
            primary = " (headline)" if PRIMARY.get(key) == metric else ""
            lines.append(
                f"| {key} | {metric}{primary} | {100 * values['median']:.2f} | {100 * values['min']:.2f} | "
                f"{100 * values['max']:.2f} | {values['seeds']} |"
            )
    return "\n".join(lines) + "\n"


def eval_results(summary: dict) -> dict[str, float]:
    """`eval_results.json`'s content, as `cram.hub` pushes it: result key -> headline metric (a fraction)."""
    results = {key: summary[key][metric]["median"] for key, metric, _ in HEADLINE if key in summary}
    numbers, average = headline(summary)
    if average is not None:
        results["glue_average"] = average / 100
    return results


def bar_chart(model_name: str, summary: dict, path: Path) -> None:
    """Ours against the published rows, per headline number and the average."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numbers, average = headline(summary)
    titles = [title for _, _, title in HEADLINE] + ["avg"]
    rows = {f"ours: {model_name}": [*numbers, average], **PUBLISHED}
    figure, axes = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(rows)
    positions = np.arange(len(titles))
    for index, (name, values) in enumerate(rows.items()):
        heights = [value if value is not None else 0.0 for value in values]
        axes.bar(positions + (index - (len(rows) - 1) / 2) * width, heights, width, label=name)
    axes.set_xticks(positions, titles)
    axes.set_ylabel("GLUE dev ×100")
    axes.set_title("GLUE dev: ours (median over seeds) against the published rows")
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)  # below: bars stay visible
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    write_atomically(path, lambda staging: figure.savefig(staging, dpi=120, format="png"))
    plt.close(figure)


def write_json(path: Path, value: object) -> None:
    write_atomically(path, lambda staging: staging.write_text(json.dumps(value, indent=2) + "\n"))


def write_atomically(path: Path, write) -> None:
    """Write through `write(staging_path)` beside `path`, then rename: a crash never leaves half a file there."""
    path = Path(path)
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(staging))
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
