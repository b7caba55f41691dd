"""The model card a checkpoint carries (its README.md): YAML front matter the Hub reads, what the model is, how it
was trained, how to load it, and GLUE results once they exist."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from cram.errors import UserError

CARD_FILE = "README.md"


PIPELINE_TAGS = {"AutoModelForMaskedLM": "fill-mask", "AutoModelForCausalLM": "text-generation"}


# GLUE result keys (cram.eval.glue_report's eval_results) -> (dataset config, split, metric id on the Hub, title).
GLUE_RESULTS = {
    "mnli_matched": ("mnli", "validation_matched", "accuracy", "MNLI matched"),
    "mnli_mismatched": ("mnli", "validation_mismatched", "accuracy", "MNLI mismatched"),
    "qqp": ("qqp", "validation", "f1", "QQP"),
    "qnli": ("qnli", "validation", "accuracy", "QNLI"),
    "sst2": ("sst2", "validation", "accuracy", "SST-2"),
    "cola": ("cola", "validation", "matthews_correlation", "CoLA"),
    "stsb": ("stsb", "validation", "pearsonr", "STS-B"),
    "mrpc": ("mrpc", "validation", "f1", "MRPC"),
    "rte": ("rte", "validation", "accuracy", "RTE"),
    "glue_average": (None, "validation", "average", "GLUE average"),
}


@dataclass
class ModelCardFacts:
    """What the model card says about one pretrained checkpoint; the training recipe fills it in."""

    repo_id: str
    architecture: str  # one line, e.g. "crammed BERT, 16 layers × 768, 12 heads"
    num_parameters: int
    data: str
    budget: str  # e.g. "24h" or "1000 steps"
    hardware: str  # e.g. "1 × NVIDIA H100" or "2 × CPU processes"
    tokens_seen: int
    optimizer_steps: int
    final_loss: float
    eval_results: dict[str, float] | None = None  # task -> score
    auto_class: str = "AutoModelForMaskedLM"  # the `transformers` class the "how to load it" snippet uses
    trust_remote_code: bool = True  # the checkpoint carries its modelling file (config.json's auto_map)


def render_model_card(facts: ModelCardFacts) -> str:
    """The checkpoint's README.md: YAML front matter the Hub reads (with GLUE results as model-index metadata, so the
    Hub shows the scores), then the model, training, evaluation, loading."""
    card_data = ModelCardData(
        library_name="transformers", license="apache-2.0", pipeline_tag=PIPELINE_TAGS.get(facts.auto_class),
        tags=["cram", "pretrained-from-scratch"], model_name=facts.repo_id.split("/")[-1],
        eval_results=glue_eval_results(facts.eval_results) or None,
    )
    front_matter = card_data.to_yaml()

    remote_code = ", trust_remote_code=True" if facts.trust_remote_code else ""
    lines = [
        "---", front_matter, "---", "",
        f"# {facts.repo_id.split('/')[-1]}", "",
        "A language model pretrained from scratch with `cram`.", "",
        "## Model", "",
        f"- Architecture: {facts.architecture}",
        f"- Parameters: {facts.num_parameters:,} ({short_count(facts.num_parameters)})",
        "",
        "## Training", "",
        f"- Data: {facts.data}",
        f"- Budget: {facts.budget}",
        f"- Hardware: {facts.hardware}",
        f"- Tokens seen: {facts.tokens_seen:,}",
        f"- Optimizer steps: {facts.optimizer_steps:,}",
        f"- Final training loss: {facts.final_loss:.4f}",
        "",
    ]
    if facts.eval_results:
        lines += ["## Evaluation", "", "| Task | Score |", "| --- | ---: |"]
        lines += [f"| {task.replace('|', '/')} | {score:.4g} |" for task, score in facts.eval_results.items()]
        lines.append("")
    lines += [
        "## How to load it", "",
        "```python",
        f"from transformers import {facts.auto_class}, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{facts.repo_id}")',
        f'model = {facts.auto_class}.from_pretrained("{facts.repo_id}"{remote_code})',
        "```",
    ]
    if facts.trust_remote_code:
        lines += [
            "",
            "`trust_remote_code=True` runs the modelling file stored in this repository, so the model loads "
            "without installing `cram`; read that file first if you do not trust its source.",
        ]
    return ModelCard("\n".join(lines) + "\n").content


def glue_eval_results(results: dict[str, float] | None) -> list[EvalResult]:
    """GLUE scores as the Hub's model-index entries: one per task (its config, split and headline metric)."""
    entries = []
    for key, score in (results or {}).items():
        config, split, metric, title = GLUE_RESULTS.get(key, (key, "validation", "score", key))
        entries.append(EvalResult(
            task_type="text-classification", dataset_type="nyu-mll/glue", dataset_name=f"GLUE {title}",
            dataset_config=config, dataset_split=split, metric_type=metric, metric_value=float(score),
        ))
    return entries


def short_count(count: int) -> str:
    """1234567 -> "1.2 M": the size people quote for a model."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f} {suffix}"
    return str(count)


def write_model_card(checkpoint_dir: str | Path, facts: ModelCardFacts) -> Path:
    """Write README.md into the checkpoint folder; a crash while writing never leaves half a card under that name."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(f"the checkpoint folder {checkpoint_dir} does not exist: save the checkpoint before its card.")
    card_path = checkpoint_dir / CARD_FILE
    _write_atomically(card_path, render_model_card(facts))
    return card_path


def add_eval_results_to_card(checkpoint_dir: str | Path, results: dict[str, float]) -> Path | None:
    """Put GLUE results into the model-index metadata of the card beside a checkpoint (replacing earlier ones), so
    the next push shows them on the Hub; None where the folder has no card."""
    card_path = Path(checkpoint_dir) / CARD_FILE
    if not card_path.is_file():
        return None
    card = ModelCard.load(card_path)
    card.data.model_name = card.data.model_name or Path(checkpoint_dir).name
    card.data.eval_results = glue_eval_results(results) or None
    _write_atomically(card_path, str(card))
    return card_path


def _write_atomically(path: Path, text: str) -> None:
    """Write under a temporary name in the same folder, then rename: a crash never leaves half a file."""
    staging = tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
    )
    try:
        with staging:
            staging.write(text)
        os.replace(staging.name, path)
    except BaseException:
        Path(staging.name).unlink(missing_ok=True)  # the folder gets uploaded whole: leave nothing stray in it
        raise
