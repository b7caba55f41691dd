"""Causal-LM evaluation: held-out loss on a slice of Megatron data, and the real lm-eval harness scoring a local
task (a YAML over a jsonl file the test writes) on a tiny GPT-NeoX checkpoint."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GPTNeoXForCausalLM

from cram.data.causal import load_causal_data
from cram.data.megatron import tokenized_documents, write_megatron
from cram.data.tokenizer import train_byte_level_bpe
from cram.errors import UserError
from cram.eval.causal_lm import heldout_loss, run_lm_eval, tasks_index
from cram.models.pythia_model import pythia_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, english_texts) -> Path:
    """A tiny GPT-NeoX with the Pythia architecture (random weights) and a BPE trained on English, saved as a run
    would save them; plus a Megatron file of held-out text beside it."""
    folder = tmp_path_factory.mktemp("tiny-neox")
    tokenizer = train_byte_level_bpe(iter(english_texts), 600, lowercase=False, model_max_length=128)
    torch.manual_seed(0)
    config = pythia_config("pythia-14m", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=256, max_position_embeddings=128)
    GPTNeoXForCausalLM(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    write_megatron(folder / "heldout", tokenized_documents(english_texts[-20:], tokenizer))
    return folder


def test_heldout_loss_is_the_mean_next_token_loss_over_the_slice(checkpoint):
    model = GPTNeoXForCausalLM.from_pretrained(checkpoint / "model")
    result = heldout_loss(model, str(checkpoint / "heldout"), first=3, count=5, seq_len=16, batch_size=2,
                          tokenizer=str(checkpoint / "model"))
    # Sequence i is the i-th sample in GPT-NeoX's order for this document-level file (the order itself is checked
    # against a slow reference in test_megatron_index.py); the loss over it is computed here directly.
    sequences = load_causal_data(str(checkpoint / "heldout"), 16, model.config.vocab_size,
                                 str(checkpoint / "model"), None).sequences
    losses = []
    with torch.no_grad():
        for index in range(3, 8):
            sequence = torch.as_tensor(sequences[index]["input_ids"], dtype=torch.int64)[None]
            logits = model(input_ids=sequence[:, :-1]).logits[0]
            losses.append(torch.nn.functional.cross_entropy(logits, sequence[0, 1:], reduction="sum").item())
    assert result["tokens"] == 5 * 16
    assert result["loss"] == pytest.approx(sum(losses) / 80, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert math.log(600) - 1 < result["loss"] < math.log(600) + 1  # random weights: about ln(vocab)


def test_a_slice_outside_the_data_is_refused(checkpoint):
    model = GPTNeoXForCausalLM.from_pretrained(checkpoint / "model")
    with pytest.raises(UserError, match="give --first and --count inside it"):
        heldout_loss(model, str(checkpoint / "heldout"), first=0, count=10**6, seq_len=16,
                     tokenizer=str(checkpoint / "model"))


@pytest.fixture(scope="module")
def local_task(tmp_path_factory, english_texts) -> Path:
    """A LAMBADA-style task: predict each sentence's last word, over a local jsonl file."""
    folder = tmp_path_factory.mktemp("lm-eval-task")
    # Plain words only, so a sentence stays far inside the model's 128 positions (lm-eval would cut it from the left).
    # The embedded corpus is built from the installed packages' documents, so which texts come first depends on the
    # environment, and the first may hold no plain word at all: sentences are taken from any text that has enough.
    plain = ([word for word in text.split() if word.isalpha()][:10] for text in english_texts)
    sentences = [" ".join(words) for words in plain if len(words) >= 4][:8]
    with open(folder / "local.jsonl", "w", encoding="utf-8") as file:
        for sentence in sentences:
            file.write(json.dumps({"text": sentence}) + "\n")
    (folder / "cram_local_lambada.yaml").write_text(
        "task: cram_local_lambada\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'local.jsonl'}\n"
        "output_type: loglikelihood\n"
        "test_split: test\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
        "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
        "metric_list:\n"
        "  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    # A group of the folder's own that lists a task of lm-eval's registry.
    (folder / "cram_local_group.yaml").write_text("group: cram_local_group\ntask:\n  - lambada_openai\n")
    return folder


def direct_loglikelihoods(model_dir: Path, sentences: list[str]) -> list[tuple[float, bool]]:
    """Each sentence's log P(last word | the words before it) and whether it is the greedy continuation, computed
    here from the model's logits: the context and the target (" word") tokenized apart, no BOS token."""
    model = GPTNeoXForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scores = []
    for sentence in sentences:
        context, word = sentence.rsplit(" ", 1)
        context_ids, target_ids = tokenizer(context)["input_ids"], tokenizer(" " + word)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([context_ids + target_ids])).logits[0]
        predicted = logits[len(context_ids) - 1:-1].log_softmax(-1)  # the positions that predict the target
        targets = torch.tensor(target_ids)
        loglikelihood = predicted.gather(1, targets[:, None]).sum().item()
        scores.append((loglikelihood, bool((predicted.argmax(-1) == targets).all())))
    return scores


@pytest.mark.slow
def test_lm_eval_scores_a_local_task_as_the_models_own_likelihoods_give(checkpoint, local_task):
    scores = run_lm_eval(checkpoint / "model", ["cram_local_lambada"], include_path=local_task, batch_size=4,
                         device="cpu")
    task = scores["cram_local_lambada"]
    sentences = [json.loads(line)["text"] for line in (local_task / "local.jsonl").read_text().splitlines()]
    direct = direct_loglikelihoods(checkpoint / "model", sentences)
    # lm-eval's perplexity aggregation: exp of minus the mean per-document log-likelihood of the target.
    expected_perplexity = math.exp(-sum(loglikelihood for loglikelihood, _ in direct) / len(direct))
    assert task["perplexity,none"] == pytest.approx(expected_perplexity, rel=1e-4)
    assert task["acc,none"] == pytest.approx(sum(greedy for _, greedy in direct) / len(direct))


@pytest.mark.slow  # lm-eval indexes its whole task registry first, which is slow
def test_an_unknown_lm_eval_task_is_refused(checkpoint, local_task):
    with pytest.raises(UserError, match="lm-eval knows no task no_such_task"):
        run_lm_eval(checkpoint / "model", ["no_such_task"], include_path=local_task)


@pytest.mark.slow  # as above: the same index of the registry and the folder, built once in this process
def test_tasks_all_in_the_include_path_are_looked_up_without_lm_evals_registry(local_task):
    own = tasks_index(["cram_local_lambada"], str(local_task))
    assert sorted(own.all_tasks) == ["cram_local_group", "cram_local_lambada"]
    # A task of the registry asked for beside it, or a group of the folder's whose tasks are the registry's: the
    # registry is indexed too.
    for tasks in (["cram_local_lambada", "lambada_openai"], ["cram_local_group"]):
        index = tasks_index(tasks, str(local_task))
        assert {"cram_local_lambada", "lambada_openai"} <= set(index.all_tasks), tasks


def test_the_checkpoint_tokenizer_round_trips(checkpoint, english_texts):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "model")
    assert tokenizer.decode(tokenizer(english_texts[0][:200])["input_ids"]) == english_texts[0][:200]
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0


# `cram.eval` imports the module before runpy runs it again as __main__, which runpy warns about; harmless here.
run_module_warning = pytest.mark.filterwarnings("ignore:'cram.eval.causal_lm' found in sys.modules:RuntimeWarning")


def run_module(module: str, monkeypatch, *arguments: str) -> None:
    """`python -m module arguments…`, run in this process: the module's own `__main__` entry, no new interpreter."""
    monkeypatch.setattr(sys, "argv", [module, *map(str, arguments)])
    runpy.run_module(module, run_name="__main__", alter_sys=True)


@run_module_warning
def test_the_command_line_prints_the_heldout_loss_of_the_slice(checkpoint, monkeypatch, capsys):
    run_module("cram.eval.causal_lm", monkeypatch, checkpoint / "model", "--data", checkpoint / "heldout",
               "--first", "3", "--count", "5", "--seq-len", "16", "--batch-size", "2")
    printed = json.loads(capsys.readouterr().out)
    model = GPTNeoXForCausalLM.from_pretrained(checkpoint / "model")
    expected = heldout_loss(model, str(checkpoint / "heldout"), first=3, count=5, seq_len=16,
                            tokenizer=str(checkpoint / "model"))
    assert printed == {"heldout": pytest.approx(expected, rel=1e-6)}


@run_module_warning
def test_the_command_line_with_nothing_to_evaluate_says_so_in_one_sentence(checkpoint, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        run_module("cram.eval.causal_lm", monkeypatch, checkpoint / "model")
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and len(stderr.strip().splitlines()) == 1
    assert stderr.startswith("error: nothing to evaluate: pass --data")
