"""`make gpu-report` at the CPU toy shape: both files, every section, every measured step; and it runs where only
torch, transformers and accelerate are installed, saying why each skipped step was skipped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launching import run

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("## Versions", "## Devices", "## Auto choices", "## Peak", "## Measured steps")
STEPS = ("crammed BERT, eager", "crammed BERT, compiled", "HF BertForMaskedLM, eager", "pythia-14m, eager",
         "crammed BERT, DeepSpeed ZeRO-1")
# Everything cram installs beyond torch, transformers and accelerate (and what those pull in).
NOT_INSTALLED = ("datasets", "deepspeed", "bitsandbytes", "wandb", "tensorboard", "lm_eval", "peft", "sklearn",
                 "scipy", "matplotlib", "zstandard")


def gpu_report(output_dir: Path, env: dict, *hidden: str) -> dict:
    """The report run in its own process (DeepSpeed starts a process group), with `hidden` modules missing."""
    program = (f"import sys\nfor module in {hidden!r}:\n    sys.modules[module] = None\n"
               "from cram.bench.gpu_report import main\nmain(sys.argv[1:])\n")
    completed = run([sys.executable, "-c", program, "--output-dir", str(output_dir)], cwd=REPO, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    markdown = (output_dir / "gpu_report.md").read_text()
    assert markdown in completed.stdout
    return {"markdown": markdown, "json": json.loads((output_dir / "gpu_report.json").read_text())}


@pytest.mark.slow
def test_the_toy_report_writes_markdown_and_json_with_every_section_and_step(tmp_path, recipe_env):
    extensions = tmp_path / "torch-extensions"  # where DeepSpeed would build an op
    report = gpu_report(tmp_path / "report", {**recipe_env, "TORCH_EXTENSIONS_DIR": str(extensions)})
    for section in SECTIONS:
        assert section in report["markdown"]
    data = report["json"]
    assert data["shape"] == "toy" and data["versions"]["torch"] and data["devices"][0]["device"] == "cpu"
    assert data["auto choices"]["precision"] in ("bf16", "no") and data["auto choices"]["compile"] is False
    rows = {row["name"].split(" (")[0]: row for row in data["measurements"]}
    assert set(rows) == set(STEPS)
    for name in ("crammed BERT, eager", "HF BertForMaskedLM, eager", "pythia-14m, eager",
                 "crammed BERT, DeepSpeed ZeRO-1"):
        assert rows[name]["status"] == "measured" and rows[name]["tokens_per_second"] > 0, rows[name]
        assert rows[name]["mfu"] is None  # no published peak for a CPU
    assert rows["crammed BERT, compiled"]["status"].startswith("skipped: --compile auto")
    assert data["crammed BERT eager over HF BertForMaskedLM"] > 0
    # The ZeRO-1 step on the CPU builds nothing: DeepSpeed's shared-memory all-reduce (inference only) is skipped, as
    # in a recipe's launch, where probing and building it would make a first start slow on a small machine.
    assert not list(extensions.glob("**/*shm*")), sorted(extensions.rglob("*"))


@pytest.mark.slow
def test_with_only_torch_transformers_and_accelerate_the_rest_is_skipped_with_a_line(tmp_path, recipe_env):
    report = gpu_report(tmp_path, recipe_env, *NOT_INSTALLED)
    rows = {row["name"].split(" (")[0]: row for row in report["json"]["measurements"]}
    assert rows["crammed BERT, DeepSpeed ZeRO-1"]["status"] == (
        'skipped: DeepSpeed is not installed (pip install "cram[deepspeed]")')
    assert rows["pythia-14m, eager"]["status"] == "measured"
    assert 'skipped: DeepSpeed is not installed (pip install "cram[deepspeed]")' in report["markdown"]
