"""The GLUE tasks: what each one is, and its data from the Hugging Face Hub or from the original GLUE download.

Every task comes out as `datasets.Dataset`s with the columns `text_a`, `text_b` (None for single sentences) and
`label` (an int class, or a float score for STS-B): one for training and one per dev set (MNLI has two);
`encode_texts` turns those columns into the model's input ids.

The local layout is the one `download_glue_data.py` made: DIR/CoLA/train.tsv, DIR/CoLA/dev.tsv, …,
DIR/MNLI/dev_matched.tsv and dev_mismatched.tsv. The files are read as they ship: CoLA without a header row,
the others with theirs (taken by column name, extra columns ignored), MNLI/QNLI/RTE with string labels. Quotes
are ordinary characters in these files (a sentence may start with one), so they are read with QUOTE_NONE.
"""

from __future__ import annotations

import csv
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import datasets
from transformers import BatchEncoding, PreTrainedTokenizerBase

from cram.errors import UserError

HUB_DATASET = "nyu-mll/glue"


@dataclass(frozen=True)
class GlueTask:
    name: str  # the Hub's configuration name, also the name on the command line
    folder: str  # the task's folder in the original download
    dev_sets: dict[str, tuple[str, str]]  # result key -> (local file, Hub split)
    num_labels: int  # 1 means regression
    # Columns of the local TSV: (text_a, text_b or None, label) by header name, or by position when headerless.
    tsv_columns: tuple[str | int, str | int | None, str | int]
    hub_columns: tuple[str, str | None]
    label_names: tuple[str, ...] = ()  # string labels of the local files, in the Hub's order

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1


def _dev(name: str) -> dict[str, tuple[str, str]]:
    return {name: ("dev.tsv", "validation")}


TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in [
        GlueTask("cola", "CoLA", _dev("cola"), 2, (3, None, 1), ("sentence", None)),
        GlueTask("sst2", "SST-2", _dev("sst2"), 2, ("sentence", None, "label"), ("sentence", None)),
        GlueTask("mrpc", "MRPC", _dev("mrpc"), 2, ("#1 String", "#2 String", "Quality"), ("sentence1", "sentence2")),
        GlueTask("stsb", "STS-B", _dev("stsb"), 1, ("sentence1", "sentence2", "score"), ("sentence1", "sentence2")),
        GlueTask("qqp", "QQP", _dev("qqp"), 2, ("question1", "question2", "is_duplicate"), ("question1", "question2")),
        GlueTask(
            "mnli", "MNLI",
            {"mnli_matched": ("dev_matched.tsv", "validation_matched"),
             "mnli_mismatched": ("dev_mismatched.tsv", "validation_mismatched")},
            3, ("sentence1", "sentence2", "gold_label"), ("premise", "hypothesis"),
            ("entailment", "neutral", "contradiction"),
        ),
        GlueTask("qnli", "QNLI", _dev("qnli"), 2, ("question", "sentence", "label"), ("question", "sentence"),
                 ("entailment", "not_entailment")),
        GlueTask("rte", "RTE", _dev("rte"), 2, ("sentence1", "sentence2", "label"), ("sentence1", "sentence2"),
                 ("entailment", "not_entailment")),
    ]
}


@dataclass
class TaskData:
    task: GlueTask
    train: datasets.Dataset
    dev: dict[str, datasets.Dataset]  # result key -> dev set


def parse_tasks(spec: str) -> list[GlueTask]:
    """`cola,sst2` (or `all`) -> the tasks, in the order given; an unknown name is a UserError."""
    names = list(TASKS) if spec.strip() == "all" else [name.strip().lower() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise UserError(
            f"{', '.join(unknown) or 'no task'} is not a GLUE task this evaluation runs: choose from "
            f"{', '.join(TASKS)} (comma-separated), or all."
        )
    return [TASKS[name] for name in dict.fromkeys(names)]


def load_task(task: GlueTask, glue_dir: str | None) -> TaskData:
    """The task's train and dev sets, from `glue_dir` when given, else from the Hub."""
    if glue_dir is not None:
        folder = Path(glue_dir) / task.folder
        files = {"train": folder / "train.tsv", **{key: folder / name for key, (name, _) in task.dev_sets.items()}}
        missing = [path.name for path in files.values() if not path.is_file()]
        if missing:
            raise UserError(
                f"the GLUE folder {glue_dir} lacks {task.folder}/{' and '.join(missing)}: give a folder in the layout "
                f"of the original GLUE download (one folder per task with train.tsv and dev.tsv), or leave {task.name} "
                "out of --tasks."
            )
        sets = {key: read_tsv(task, path) for key, path in files.items()}
    else:
        sets = load_from_hub(task)
    train = sets.pop("train")
    return TaskData(task, train, sets)


def read_tsv(task: GlueTask, path: Path) -> datasets.Dataset:
    """One file of the original GLUE download, as (text_a, text_b, label) rows."""
    csv.field_size_limit(sys.maxsize)  # a few MNLI/QQP fields are long; the csv default would stop on them
    with open(path, encoding="utf-8", newline="") as file:
        rows = list(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE))
    text_a, text_b, label = task.tsv_columns
    if isinstance(label, int):  # headerless (CoLA): columns by position
        header, width, positions = None, None, (text_a, text_b, label)
    else:
        if not rows:
            raise UserError(f"{path} is empty: it should start with a header row naming {label!r}.")
        header, rows = rows[0], rows[1:]
        absent = [name for name in task.tsv_columns if name is not None and name not in header]
        if absent:
            raise UserError(
                f"{path} has no column {', '.join(map(repr, absent))} in its header row: give the {task.folder} files "
                "of the original GLUE download."
            )
        width = len(header)
        positions = tuple(None if name is None else header.index(name) for name in task.tsv_columns)
    columns: dict[str, list] = {"text_a": [], "text_b": [], "label": []}
    needed = max(position for position in positions if position is not None)
    malformed = []
    for line_number, row in enumerate(rows, start=2 if header else 1):
        if not row:
            continue
        if (width is not None and len(row) != width) or len(row) <= needed:
            malformed.append(line_number)
            continue
        columns["text_a"].append(row[positions[0]])
        columns["text_b"].append(row[positions[1]] if positions[1] is not None else None)
        columns["label"].append(parse_label(task, row[positions[2]], path, line_number))
    # The QQP download has a few broken rows, which BERT's own reader skips too; many of them mean a wrong file.
    if len(malformed) > max(10, len(rows) // 1000):
        raise UserError(
            f"{path} has {len(malformed)} rows without the {width or needed + 1} tab-separated fields of its "
            f"format (line {malformed[0]} first): give the file as the GLUE download ships it."
        )
    if malformed:
        print(f"note: skipped {len(malformed)} malformed rows of {path} (lines {malformed[:5]})", file=sys.stderr)
    return datasets.Dataset.from_dict(columns, features=features(task))


def parse_label(task: GlueTask, value: str, path: Path, line_number: int) -> int | float:
    try:
        if task.is_regression:
            return float(value)
        if task.label_names:
            return task.label_names.index(value)
        label = int(value)
        if not 0 <= label < task.num_labels:
            raise ValueError(value)
        return label
    except ValueError:
        expected = "a number" if task.is_regression else ", ".join(task.label_names or map(str, range(task.num_labels)))
        raise UserError(f"{path} line {line_number} has the label {value!r}, not one of {expected}.") from None


def features(task: GlueTask) -> datasets.Features:
    label = datasets.Value("float32") if task.is_regression else datasets.Value("int64")
    return datasets.Features({"text_a": datasets.Value("string"), "text_b": datasets.Value("string"), "label": label})


def load_from_hub(task: GlueTask) -> dict[str, datasets.Dataset]:
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)  # without a network, each retry would print a line before our one sentence
    try:
        loaded = datasets.load_dataset(HUB_DATASET, task.name)
    except Exception as err:  # no network, offline mode, a proxy, a renamed dataset: all end the same way
        raise UserError(
            f"could not load GLUE task {task.name} from the Hugging Face Hub ({type(err).__name__}): without a "
            "network, pass --glue-dir DIR with the original GLUE download (DIR/CoLA/train.tsv, …)."
        ) from err
    finally:
        hub_logger.setLevel(level)
    text_a, text_b = task.hub_columns
    splits = {"train": "train", **{key: split for key, (_, split) in task.dev_sets.items()}}
    sets = {}
    for key, split in splits.items():
        part = loaded[split]
        sets[key] = datasets.Dataset.from_dict(
            {"text_a": part[text_a], "text_b": part[text_b] if text_b else [None] * len(part), "label": part["label"]},
            features=features(task),
        )
    return sets


def encode_texts(tokenizer: PreTrainedTokenizerBase, text_a: list[str], text_b: list[str | None],
                 max_length: int) -> BatchEncoding:
    """A batch of examples as input ids, always through the tokenizer's pair template: a single sentence (CoLA,
    SST-2) goes as a pair with an empty second text, as the original does (cramming/data/
    downstream_task_preparation.py: preprocess_function, "fake 2nd option all of the time"). The authors' tokenizer
    frames a single text as `$A <sep>`, with no <cls>, and only its pair template puts <cls> at position 0, where
    the classification head pools; BERT-style tokenizers put it there either way.

    Called on a batch: transformers reads an empty second text of a single, unbatched call as no second text.
    """
    second = ["" if text is None else text for text in text_b]
    return tokenizer(text_a, second, truncation=True, max_length=max_length)


def check_classification_token_first(tokenizer: PreTrainedTokenizerBase, model: str) -> None:
    """Refuse a tokenizer whose encoding of a GLUE example does not start with its classification token, which
    crammed BERT's head pools (position 0), before any fine-tuning."""
    first = encode_texts(tokenizer, ["a sentence", "a premise"], [None, "a hypothesis"], 16)["input_ids"]
    if tokenizer.cls_token_id is None or any(ids[0] != tokenizer.cls_token_id for ids in first):
        raise UserError(
            f"the tokenizer of {model} does not put a classification token first in a sentence pair, where "
            "crammed BERT's head pools: save a tokenizer with a cls_token and a pair template that starts with it."
        )
