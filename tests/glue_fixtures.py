"""Small GLUE files in exactly the formats of the original GLUE download, for the GLUE tests.

`glue_rows` is what the files mean: per task and file, the (text_a, text_b, label) rows a correct reader returns,
labels as the Hub's class ids. `write_glue_dir` writes them in the download's formats, with the columns a reader
must skip (MRPC's IDs, MNLI's parses and annotator votes) holding values that differ from the right ones.
"""

from __future__ import annotations

import random
from pathlib import Path

GOOD = ["a wonderful film", "truly great acting", "a lovely and warm story", "\"brilliant\" from start to end"]
BAD = ["a dull mess", "boring and far too long", "the worst plot", "it's \"funny\" only by accident"]
# Class names in the order of the Hub's ClassLabel features (nyu-mll/glue README.md: dataset_info, label names).
MNLI_LABELS = ("entailment", "neutral", "contradiction")
ENTAILMENT_LABELS = ("entailment", "not_entailment")  # QNLI and RTE

Row = tuple[str, str | None, int | float]


def sentences(rng: random.Random, count: int) -> list[tuple[str, int]]:
    """(sentence, 1 if good else 0); some start with or hold a lone double quote, as real GLUE rows do."""
    rows = []
    for _ in range(count):
        label = rng.randrange(2)
        rows.append((f"{rng.choice(GOOD if label else BAD)} , {rng.choice(['really', 'i think', 'so'])} .", label))
    return rows


def pairs(rng: random.Random, count: int) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    return list(zip(sentences(rng, count), sentences(rng, count), strict=True))


def glue_rows(train: int = 24, dev: int = 12) -> dict[str, dict[str, list[Row]]]:
    """folder -> file name -> the rows it holds, as (text_a, text_b, Hub class id or STS-B score)."""
    rng = random.Random(0)
    rows: dict[str, dict[str, list[Row]]] = {}
    for split, count in (("train", train), ("dev", dev)):
        def add(folder: str, task_rows: list[Row], file_name: str = f"{split}.tsv") -> None:
            rows.setdefault(folder, {})[file_name] = task_rows

        add("CoLA", [(text, None, label) for text, label in sentences(rng, count)])
        add("SST-2", [(text, None, label) for text, label in sentences(rng, count)])
        add("MRPC", [(text, text if label else other, label) for (text, label), (other, _) in pairs(rng, count)])
        # A score the sentences' words add up to, so a tiny model learns it from a few dozen pairs.
        add("STS-B", [(text, other, 1.0 + 2 * (label + other_label))
                      for (text, label), (other, other_label) in pairs(rng, count)])
        add("QQP", [(f"why is {text} ?", f"why is {other} ?", int(label == other_label))
                    for (text, label), (other, other_label) in pairs(rng, count)])
        add("QNLI", [(f"what is {text} ?", other, int(label != other_label))
                     for (text, label), (other, other_label) in pairs(rng, count)])
        add("RTE", [(text, other, int(label != other_label))
                    for (text, label), (other, other_label) in pairs(rng, count)])
    for name, count in (("train", train), ("dev_matched", dev), ("dev_mismatched", dev)):
        rows.setdefault("MNLI", {})[f"{name}.tsv"] = [
            # Same sentiment: entailment when the closing words match too, else neutral; opposite: contradiction.
            (text, other, 2 if label != other_label else int(text.split()[-2] != other.split()[-2]))
            for (text, label), (other, other_label) in pairs(rng, count)
        ]
    return rows


def write(path: Path, lines: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(line) + "\n" for line in lines), encoding="utf-8")


def annotator_votes(gold: int, row_index: int, annotators: int) -> list[str]:
    """The labelN columns of an MNLI dev row: a majority for gold, but label1 (and some others) disagree."""
    if annotators == 1:
        return [MNLI_LABELS[(gold + 1) % 3]]
    votes = [MNLI_LABELS[(gold + 1 + row_index % 2) % 3], MNLI_LABELS[(gold + 2) % 3]]
    return votes + [MNLI_LABELS[gold]] * (annotators - 2)


def write_glue_dir(root: Path, train: int = 24, dev: int = 12) -> Path:
    """CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI and RTE folders, each with train.tsv and its dev file(s)."""
    for folder, files in glue_rows(train, dev).items():
        for name, rows in files.items():
            write(root / folder / name, task_lines(folder, name, rows))
    return root


def task_lines(folder: str, name: str, rows: list[Row]) -> list[list[str]]:
    """The TSV lines of one file, header first where the download has one."""
    if folder == "CoLA":  # no header; source, label, the original acceptability mark, sentence
        return [["gj04", str(label), "" if label else "*", text] for text, _, label in rows]
    if folder == "SST-2":
        return [["sentence", "label"]] + [[text, str(label)] for text, _, label in rows]
    if folder == "MRPC":
        return [["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]] + [
            [str(label), str(1000 + i), str(2000 + i), a, b] for i, (a, b, label) in enumerate(rows)
        ]
    if folder == "STS-B":
        return [["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
                 "score"]] + [
            [str(i), "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", a, b, f"{score:.3f}"]
            for i, (a, b, score) in enumerate(rows)
        ]
    if folder == "QQP":
        return [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]] + [
            [str(i), str(2 * i), str(2 * i + 1), a, b, str(label)] for i, (a, b, label) in enumerate(rows)
        ]
    if folder == "QNLI":
        return [["index", "question", "sentence", "label"]] + [
            [str(i), a, b, ENTAILMENT_LABELS[label]] for i, (a, b, label) in enumerate(rows)
        ]
    if folder == "RTE":
        return [["index", "sentence1", "sentence2", "label"]] + [
            [str(i), a, b, ENTAILMENT_LABELS[label]] for i, (a, b, label) in enumerate(rows)
        ]
    # MNLI: train has one annotator column, the dev files five; gold_label is the one to read, not label1.
    annotators = 1 if name == "train.tsv" else 5
    header = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
              "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]
    return [header + [f"label{n + 1}" for n in range(annotators)] + ["gold_label"]] + [
        [str(i), str(i), f"{i}e", "fiction", f"( {a} )", f"( {b} )", f"(ROOT {a})", f"(ROOT {b})", a, b,
         *annotator_votes(label, i, annotators), MNLI_LABELS[label]]
        for i, (a, b, label) in enumerate(rows)
    ]


# The Hub copy's column names per task (nyu-mll/glue README.md: dataset_info features) and its dev splits.
HUB_COLUMNS = {
    "cola": ("CoLA", ("sentence", None)), "sst2": ("SST-2", ("sentence", None)),
    "mrpc": ("MRPC", ("sentence1", "sentence2")), "stsb": ("STS-B", ("sentence1", "sentence2")),
    "qqp": ("QQP", ("question1", "question2")), "mnli": ("MNLI", ("premise", "hypothesis")),
    "qnli": ("QNLI", ("question", "sentence")), "rte": ("RTE", ("sentence1", "sentence2")),
}
HUB_LABEL_NAMES = {"mnli": MNLI_LABELS, "qnli": ENTAILMENT_LABELS, "rte": ENTAILMENT_LABELS,
                   "cola": ("unacceptable", "acceptable"), "sst2": ("negative", "positive"),
                   "mrpc": ("not_equivalent", "equivalent"), "qqp": ("not_duplicate", "duplicate")}


def hub_split(name: str, file_name: str) -> str:
    return {"train.tsv": "train", "dev.tsv": "validation", "dev_matched.tsv": "validation_matched",
            "dev_mismatched.tsv": "validation_mismatched"}[file_name]


def write_hub_copy(root: Path, train: int = 24, dev: int = 12) -> Path:
    """The same rows as `write_glue_dir`, saved in the layout of the Hub's nyu-mll/glue repository (one folder
    of parquet files per configuration, the configurations listed in README.md), at ROOT/nyu-mll/glue."""
    import datasets

    repo = root / "nyu-mll" / "glue"
    rows = glue_rows(train, dev)
    configs = []
    for name, (folder, (column_a, column_b)) in HUB_COLUMNS.items():
        label = (datasets.Value("float32") if name == "stsb"
                 else datasets.ClassLabel(names=list(HUB_LABEL_NAMES[name])))
        features = {column_a: datasets.Value("string")}
        if column_b:
            features[column_b] = datasets.Value("string")
        features = datasets.Features({**features, "label": label, "idx": datasets.Value("int32")})
        configs.append(f"- config_name: {name}\n  data_files:")
        for file_name, task_rows in rows[folder].items():
            split = hub_split(name, file_name)
            columns = {column_a: [a for a, _, _ in task_rows]}
            if column_b:
                columns[column_b] = [b for _, b, _ in task_rows]
            columns |= {"label": [label for _, _, label in task_rows], "idx": list(range(len(task_rows)))}
            datasets.Dataset.from_dict(columns, features=features).to_parquet(
                repo / name / f"{split}-00000-of-00001.parquet")
            configs.append(f"  - split: {split}\n    path: {name}/{split}-*")
    (repo / "README.md").write_text("---\nconfigs:\n" + "\n".join(configs) + "\n---\n")
    return repo
