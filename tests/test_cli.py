"""Every recipe's command line: `--help` lists the choices of each fixed-choice option and names options by their
dashed spelling first; a value outside the choices is refused in one line with exit status 2."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from launching import load_recipe

from cram.errors import run_cli
from cram.eval import causal_lm

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PRECISION = "--precision {auto,bf16,fp16,fp32}"
COMPILE = "--compile {auto,true,false,default,reduce-overhead,max-autotune,max-autotune-no-cudagraphs}"
TRACKER = "--report-to {none,wandb,tensorboard}"
# recipe -> (options with their choices as --help shows them, a bad choice's arguments, the start of its refusal)
CHOICES = {
    "cram": (
        ["--preset {crammed-bert,small,tiny}", "--optimizer {adamw,adamw-8bit}", PRECISION, COMPILE, TRACKER],
        ["--precision", "fp8"], "error: argument --precision: invalid choice: 'fp8'",
    ),
    "pythia": (
        ["--size {pythia-14m,pythia-31m,", "--precision {released,auto,bf16,fp16,fp32}", COMPILE, TRACKER],
        ["--size", "pythia-7b"], "error: argument --size: invalid choice: 'pythia-7b'",
    ),
    "plan": (
        ["--model {pythia-14m,", ",crammed-bert,crammed-bert-small,crammed-bert-tiny}"],
        ["--model", "gpt-2"], "error: argument --model: invalid choice: 'gpt-2'",
    ),
    "glue": (
        [PRECISION, COMPILE],
        ["--compile", "yes"], "error: argument --compile: invalid choice: 'yes'",
    ),
    "prepare_data": (
        ["--tokenizer-model {wordpiece,bpe}", "--ordering {curriculum,random,none}"],
        ["--ordering", "backwards"], "error: argument --ordering: invalid choice: 'backwards'",
    ),
}


def run_recipe(name: str, arguments: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    module = load_recipe(RECIPES / f"{name}.py", f"cli_{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *arguments])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exited:
        run_cli(module.main)
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


@pytest.mark.parametrize("name", list(CHOICES))
def test_help_lists_the_choices_and_the_dashed_spellings_first(name, monkeypatch, capsys):
    code, help_text, _ = run_recipe(name, ["--help"], monkeypatch, capsys)
    assert code == 0
    flat = re.sub(r"\s+", " ", help_text)
    for shown in CHOICES[name][0]:
        assert shown in flat, shown
    spellings = re.findall(r"--[a-z0-9][\w-]*", help_text)
    dashed = {spelling for spelling in spellings if "-" in spelling[2:]}
    assert dashed, "the recipe has options of several words"
    # Each option line starts with its dashed spelling; the underscored one only follows it on the same line.
    option_lines = [line.strip() for line in help_text.splitlines() if line.strip().startswith("--")]
    assert not [line for line in option_lines if "_" in line.split()[0]], option_lines
    listed = [line.split()[0] for line in help_text.splitlines() if line.startswith("  --")]  # not wrapped text
    assert len(listed) == len(set(listed)), f"an option listed twice: {listed}"
    usage = help_text.split("\n\n")[0]
    assert "--" in usage and not re.search(r"--\w*_", usage), usage
    # The description is the docstring's whole first paragraph, not a first line cut mid-sentence.
    docstring = sys.modules[f"cli_{name}"].__doc__
    assert " ".join(docstring.split("\n\n")[0].split()) in flat


def test_the_causal_lm_evaluations_help_describes_it_in_whole_sentences(capsys):
    with pytest.raises(SystemExit) as exited:
        causal_lm.main(["--help"])
    assert exited.value.code == 0
    assert "on a slice of data, and EleutherAI's lm-eval harness on the tasks the Pythia paper reports." in \
        " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("name", list(CHOICES))
def test_a_value_outside_the_choices_is_refused_in_one_line(name, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing may be written, here or anywhere
    code, out, err = run_recipe(name, CHOICES[name][1], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(CHOICES[name][2]), err
    assert list(tmp_path.iterdir()) == []
