"""GLUE data as it ships, metrics against hand-computed values, the median over seeds and the report's layout."""

from __future__ import annotations

import math
import shutil
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
from glue_fixtures import HUB_COLUMNS, glue_rows, hub_split, write_glue_dir, write_hub_copy
from readymade_standin import authors_tokenizer
from tokenizers import processors

from cram.data.tokenizer import train_wordpiece
from cram.errors import UserError
from cram.eval.glue_data import TASKS, check_classification_token_first, load_task, parse_tasks, read_tsv
from cram.eval.glue_finetune import tokenized
from cram.eval.glue_report import PUBLISHED, eval_results, headline, markdown_report, summarize, task_metrics


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    return write_glue_dir(tmp_path_factory.mktemp("glue"), train=24, dev=12)


def test_every_task_reads_its_real_file_format(glue_dir):
    for task in TASKS.values():
        data = load_task(task, str(glue_dir))
        assert len(data.train) == 24 and all(len(dev) == 12 for dev in data.dev.values())
        labels = list(data.train["label"])
        if task.is_regression:
            assert all(isinstance(label, float) for label in labels) and max(labels) == 5.0
        else:
            assert set(labels) <= set(range(task.num_labels))
        is_pair = task.tsv_columns[1] is not None
        assert all((text_b is not None) == is_pair for text_b in data.train["text_b"])
    assert list(load_task(TASKS["mnli"], str(glue_dir)).dev) == ["mnli_matched", "mnli_mismatched"]


@pytest.fixture(scope="module", params=["ours", "authors-order-0", "authors-order-1"])
def tokenizer(request, english_texts):
    """This project's WordPiece ([CLS] at 2) and the authors' (<cls> at a set-drawn id, no <cls> in `$A <sep>`)."""
    texts = english_texts[:100]
    if request.param == "ours":
        return train_wordpiece(texts, 1000, True, 128)
    return authors_tokenizer(texts, 1000, 128, order_seed=int(request.param[-1]))


def test_every_encoded_glue_example_starts_with_the_classification_token(glue_dir, tokenizer):
    evaluation = SimpleNamespace(tokenizer=tokenizer, options=SimpleNamespace(max_length=128))
    for task in TASKS.values():
        data = load_task(task, str(glue_dir))
        for name, dataset in {"train": data.train, **data.dev}.items():
            encoded = tokenized(evaluation, dataset)["input_ids"]  # as fine-tuning and prediction encode them
            assert [ids[0] for ids in encoded] == [tokenizer.cls_token_id] * len(dataset), (task.name, name)
    check_classification_token_first(tokenizer, "model")


def test_a_single_sentence_is_framed_as_the_original_frames_it(glue_dir, english_texts):
    # cramming's preprocess_function: (sentence, "") through the pair template, so <cls> A <sep> <sep>.
    tokenizer = authors_tokenizer(english_texts[:100], 1000, 128, order_seed=0)
    evaluation = SimpleNamespace(tokenizer=tokenizer, options=SimpleNamespace(max_length=128))
    sst2 = load_task(TASKS["sst2"], str(glue_dir)).train.select(range(1))
    words = tokenizer(sst2["text_a"][0], add_special_tokens=False)["input_ids"]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    assert tokenized(evaluation, sst2)["input_ids"][0] == [cls, *words, sep, sep]


def test_a_tokenizer_without_the_classification_token_first_is_refused(english_texts):
    tokenizer = authors_tokenizer(english_texts[:100], 1000, 128, order_seed=0)
    sep = tokenizer.sep_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <sep>", pair="$A <sep> $B <sep>", special_tokens=[("<sep>", sep)])
    with pytest.raises(UserError, match="does not put a classification token first"):
        check_classification_token_first(tokenizer, "model")


def rows_of(dataset) -> list[tuple]:
    return list(zip(dataset["text_a"], dataset["text_b"], dataset["label"], strict=True))


def test_every_task_reads_the_right_columns_and_labels(glue_dir):
    # The fixture's skipped columns hold other values (MRPC's IDs, MNLI's parses, annotator votes that disagree
    # with gold_label), and the truth has the Hub's class ids: a wrong column or label order changes the rows.
    truth = glue_rows(train=24, dev=12)
    for task in TASKS.values():
        data = load_task(task, str(glue_dir))
        assert rows_of(data.train) == truth[task.folder]["train.tsv"], task.name
        for key, (file_name, _) in task.dev_sets.items():
            assert rows_of(data.dev[key]) == truth[task.folder][file_name], key
    mnli = load_task(TASKS["mnli"], str(glue_dir)).dev["mnli_matched"]
    assert set(mnli["label"]) == {0, 1, 2}  # every class occurs, so the order of all three is pinned
    first = (glue_dir / "MNLI" / "dev_matched.tsv").read_text().splitlines()[1].split("\t")
    assert first[10] != first[-1]  # label1 is not gold_label in the fixture


def test_the_hub_path_maps_each_tasks_columns(tmp_path, monkeypatch):
    # A local folder named like the Hub dataset is what `datasets.load_dataset("nyu-mll/glue", task)` reads first.
    write_hub_copy(tmp_path, train=24, dev=12)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    truth = glue_rows(train=24, dev=12)
    for name, (folder, _) in HUB_COLUMNS.items():
        data = load_task(TASKS[name], None)
        assert rows_of(data.train) == truth[folder]["train.tsv"], name
        for key, (file_name, split) in TASKS[name].dev_sets.items():
            assert split == hub_split(name, file_name)
            assert rows_of(data.dev[key]) == truth[folder][file_name], key


def qqp_file(path, good_rows: int, malformed_rows: int):
    header = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    good = [f"{i}\t{2 * i}\t{2 * i + 1}\twhy {i} ?\thow {i} ?\t{i % 2}\n" for i in range(good_rows)]
    broken = [f"{i}\t{i}\twhy a question cut short\n" for i in range(malformed_rows)]
    # The broken rows sit after the good ones' first line, as QQP's own do, inside the file.
    path.write_text(header + good[0] + "".join(broken) + "".join(good[1:]))
    return path


def test_malformed_rows_are_skipped_up_to_ten_or_a_thousandth(tmp_path, capsys):
    qqp = TASKS["qqp"]
    # Ten of 100 rows: at most 10, so skipped with a note.
    data = read_tsv(qqp, qqp_file(tmp_path / "ten.tsv", 90, 10))
    assert len(data) == 90 and data[1]["text_a"] == "why 1 ?"
    assert "skipped 10 malformed rows" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"has 11 rows without the 6 tab-separated fields .*\(line 3 first\)"):
        read_tsv(qqp, qqp_file(tmp_path / "eleven.tsv", 89, 11))
    # 20 of 20,000 rows is 0.1 %: skipped; 21 is more than 0.1 %: refused.
    assert len(read_tsv(qqp, qqp_file(tmp_path / "big.tsv", 19_980, 20))) == 19_980
    with pytest.raises(UserError, match="has 21 rows"):
        read_tsv(qqp, qqp_file(tmp_path / "too-many.tsv", 19_979, 21))


def test_headerless_cola_keeps_its_first_row_and_quotes_stay_in_the_text(glue_dir):
    first_line = (glue_dir / "CoLA" / "train.tsv").read_text().splitlines()[0].split("\t")
    data = load_task(TASKS["cola"], str(glue_dir))
    assert data.train[0] == {"text_a": first_line[3], "text_b": None, "label": int(first_line[1])}
    texts = list(data.train["text_a"]) + list(load_task(TASKS["sst2"], str(glue_dir)).train["text_a"])
    assert any(text.startswith('"') for text in texts)  # a leading quote is text, not CSV quoting


def test_string_labels_map_to_the_hub_order(tmp_path):
    (tmp_path / "RTE").mkdir()
    rows = "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tnot_entailment\n1\tc\td\tentailment\n"
    (tmp_path / "RTE" / "train.tsv").write_text(rows)
    (tmp_path / "RTE" / "dev.tsv").write_text(rows)
    assert list(load_task(TASKS["rte"], str(tmp_path)).train["label"]) == [1, 0]
    (tmp_path / "RTE" / "dev.tsv").write_text(rows.replace("not_entailment", "maybe"))
    with pytest.raises(UserError, match="label 'maybe'"):
        load_task(TASKS["rte"], str(tmp_path))


def test_missing_task_folder_or_dev_set_names_the_file(glue_dir, tmp_path):
    partial = shutil.copytree(glue_dir, tmp_path / "glue")
    (partial / "MNLI" / "dev_mismatched.tsv").unlink()
    with pytest.raises(UserError, match="lacks MNLI/dev_mismatched.tsv"):
        load_task(TASKS["mnli"], str(partial))
    shutil.rmtree(partial / "RTE")
    with pytest.raises(UserError, match="lacks RTE/train.tsv and dev.tsv"):
        load_task(TASKS["rte"], str(partial))


def test_task_names_are_checked():
    assert [task.name for task in parse_tasks("all")] == list(TASKS)
    assert [task.name for task in parse_tasks("RTE, cola")] == ["rte", "cola"]
    with pytest.raises(UserError, match="wnli is not a GLUE task"):
        parse_tasks("cola,wnli")


def test_metrics_equal_hand_computed_values():
    labels = np.array([1, 1, 1, 0, 0, 0, 1, 0])
    classes = np.array([1, 1, 0, 0, 0, 1, 1, 0])  # TP 3, FN 1, FP 1, TN 3
    logits = np.eye(2)[classes]
    tp, fn, fp, tn = 3, 1, 1, 3
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert task_metrics("cola", logits, labels) == pytest.approx({"accuracy": 6 / 8, "matthews": mcc})
    assert task_metrics("mrpc", logits, labels) == pytest.approx({"accuracy": 0.75, "f1": 2 * 3 / (2 * 3 + 1 + 1)})
    assert task_metrics("rte", logits, labels) == pytest.approx({"accuracy": 0.75})

    scores = np.array([[1.0], [2.0], [3.0], [4.0]])
    gold = np.array([1.0, 3.0, 2.0, 5.0])
    x, y = scores.ravel(), gold
    dx, dy = x - x.mean(), y - y.mean()
    pearson = (dx * dy).sum() / math.sqrt((dx**2).sum() * (dy**2).sum())
    # Ranks of gold: 1, 3, 2, 4 against 1, 2, 3, 4: Spearman = 1 - 6·Σd² / (n(n² - 1)) = 1 - 6·2/60.
    assert task_metrics("stsb", scores, gold) == pytest.approx({"pearson": pearson, "spearman": 0.8})


def seed_result(seed: int, **dev) -> dict:
    return {"task": "x", "seed": seed, "dev": dev}


def test_the_summary_is_the_median_over_seeds_with_its_spread():
    results = [seed_result(0, rte={"accuracy": 0.5}), seed_result(1, rte={"accuracy": 0.7}),
               seed_result(2, rte={"accuracy": 0.6}), seed_result(3, rte={"accuracy": 0.9})]
    summary = summarize(results)
    assert summary["rte"]["accuracy"] == pytest.approx({"median": 0.65, "min": 0.5, "max": 0.9, "seeds": 4})


def test_the_average_counts_nine_numbers_and_the_report_has_every_column():
    values = {"mnli_matched": 0.80, "mnli_mismatched": 0.82, "qqp": 0.85, "qnli": 0.88, "sst2": 0.90,
              "cola": 0.40, "stsb": 0.84, "mrpc": 0.86, "rte": 0.55}
    metric = {"qqp": "f1", "mrpc": "f1", "cola": "matthews", "stsb": "pearson"}
    summary = summarize(
        [seed_result(0, **{key: {metric.get(key, "accuracy"): value}}) for key, value in values.items()]
    )
    numbers, average = headline(summary)
    assert average == pytest.approx(100 * sum(values.values()) / 9)
    assert eval_results(summary)["glue_average"] == pytest.approx(sum(values.values()) / 9)
    assert eval_results(summary)["cola"] == pytest.approx(0.40)

    report = markdown_report("my-model", summary, {})
    lines = report.splitlines()
    assert lines[0] == "| model | MNLI m/mm | QQP | QNLI | SST-2 | CoLA | STS-B | MRPC | RTE | avg |"
    # avg: (80 + 82 + 85 + 88 + 90 + 40 + 84 + 86 + 55) / 9 = 76.7
    assert lines[2] == ("| **ours**: my-model (median over seeds) | 80.0/82.0 | 85.0 | 88.0 | 90.0 | 40.0 | 84.0 | "
                        "86.0 | 55.0 | 76.7 |")
    assert "| BERT-base, fully trained | 83.2/83.4 | 87.7 | 90.6 | 91.9 | 56.5 | 86.7 | 89.3 | 59.2 | 80.9 |" in lines
    assert all(name in report for name in PUBLISHED)


def test_a_partial_evaluation_has_no_average():
    summary = summarize([seed_result(0, rte={"accuracy": 0.6})])
    numbers, average = headline(summary)
    assert average is None and numbers[-1] == pytest.approx(60.0) and numbers[0] is None
    assert "glue_average" not in eval_results(summary)
