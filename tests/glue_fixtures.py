"""Small GLUE files in exactly the formats of the original GLUE download, for the GLUE tests."""

from __future__ import annotations

import random
from pathlib import Path

GOOD = ["a wonderful film", "truly great acting", "a lovely and warm story", "\"brilliant\" from start to end"]
BAD = ["a dull mess", "boring and far too long", "the worst plot", "it's \"funny\" only by accident"]


def sentences(rng: random.Random, count: int) -> list[tuple[str, int]]:
    """(sentence, 1 if good else 0); some start with or hold a lone double quote, as real GLUE rows do."""
    rows = []
    for _ in range(count):
        label = rng.randrange(2)
        rows.append((f"{rng.choice(GOOD if label else BAD)} , {rng.choice(['really', 'i think', 'so'])} .", label))
    return rows


def pairs(rng: random.Random, count: int) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    return list(zip(sentences(rng, count), sentences(rng, count), strict=True))


def write(path: Path, lines: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(line) + "\n" for line in lines), encoding="utf-8")


def write_glue_dir(root: Path, train: int = 24, dev: int = 12) -> Path:
    """CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI and RTE folders, each with train.tsv and its dev file(s)."""
    rng = random.Random(0)
    nli = ["entailment", "neutral", "contradiction"]
    for split, count in (("train", train), ("dev", dev)):
        # CoLA: no header; source, label, the original acceptability mark, sentence.
        write(root / "CoLA" / f"{split}.tsv",
              [["gj04", str(label), "" if label else "*", text] for text, label in sentences(rng, count)])
        write(root / "SST-2" / f"{split}.tsv",
              [["sentence", "label"]] + [[text, str(label)] for text, label in sentences(rng, count)])
        write(root / "MRPC" / f"{split}.tsv", [["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]] + [
            [str(label), str(1000 + i), str(2000 + i), text, text if label else other]
            for i, ((text, label), (other, _)) in enumerate(pairs(rng, count))
        ])
        write(root / "STS-B" / f"{split}.tsv", [[
            "index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score",
        ]] + [
            [str(i), "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", text, other,
             f"{5.0 if text == other else 1.0 + 2 * (label == other_label):.3f}"]
            for i, ((text, label), (other, other_label)) in enumerate(pairs(rng, count))
        ])
        write(root / "QQP" / f"{split}.tsv", [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]] + [
            [str(i), str(2 * i), str(2 * i + 1), f"why is {text} ?", f"why is {other} ?",
             str(int(label == other_label))]
            for i, ((text, label), (other, other_label)) in enumerate(pairs(rng, count))
        ])
        write(root / "QNLI" / f"{split}.tsv", [["index", "question", "sentence", "label"]] + [
            [str(i), f"what is {text} ?", other, "entailment" if label == other_label else "not_entailment"]
            for i, ((text, label), (other, other_label)) in enumerate(pairs(rng, count))
        ])
        write(root / "RTE" / f"{split}.tsv", [["index", "sentence1", "sentence2", "label"]] + [
            [str(i), text, other, "entailment" if label == other_label else "not_entailment"]
            for i, ((text, label), (other, other_label)) in enumerate(pairs(rng, count))
        ])
    mnli_header = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                   "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]
    for name, count, annotators in (("train", train, 1), ("dev_matched", dev, 5), ("dev_mismatched", dev, 5)):
        header = mnli_header + [f"label{n + 1}" for n in range(annotators)] + ["gold_label"]
        rows = []
        for i, ((text, label), (other, other_label)) in enumerate(pairs(rng, count)):
            gold = nli[0] if text == other else nli[1 + int(label != other_label)]
            rows.append([str(i), str(i), f"{i}e", "fiction", f"( {text} )", f"( {other} )", f"(ROOT {text})",
                         f"(ROOT {other})", text, other] + [gold] * annotators + [gold])
        write(root / "MNLI" / f"{name}.tsv", [header] + rows)
    return root
