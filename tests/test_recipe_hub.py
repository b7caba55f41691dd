"""`recipes/cram.py --push-to-hub`: the finished model, its card and intermediate revisions reach the Hub (a local
stand-in for its HTTP API); with no Hub reachable, the run still leaves its complete local checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hub_standin import HubStandIn, unreachable_endpoint
from launching import run, run_recipe_in_process

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cram.py"
TOKEN = "hf_recipe_secret_0123456789"
RUN = ["--preset", "tiny", "--max-steps", "2", "--micro-batch-size", "8", "--target-batch-size", "16"]


@pytest.fixture(scope="module")
def env(recipe_env) -> dict[str, str]:
    environment = {**recipe_env, "HF_TOKEN": TOKEN}
    environment.pop("HF_HUB_OFFLINE", None)
    return environment


@pytest.mark.slow
def test_the_final_model_and_each_checkpoint_are_pushed_privately_with_a_card(tmp_path, env):
    with HubStandIn(token=TOKEN, session_address=True) as hub:  # its programs fork as the others do
        command = [sys.executable, RECIPE, *RUN, "--output-dir", tmp_path, "--push-to-hub", "lab/crammed-tiny",
                   "--checkpoint-every", "1", "--push-checkpoints"]
        completed = run(command, env={**env, "HF_ENDPOINT": hub.endpoint})
        assert completed.returncode == 0, completed.stderr[-3000:]
        assert hub.unknown_routes == []
        stored = hub.repos["lab/crammed-tiny"]
    assert stored.private
    final = stored.branches["main"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "cram_options.json", "README.md"} <= final.keys()
    assert final["model.safetensors"] == (tmp_path / "final" / "model.safetensors").read_bytes()
    card = final["README.md"].decode()
    assert "lab/crammed-tiny" in card and "AutoModelForMaskedLM" in card and "1 × CPU" in card
    assert {"step-00000001", "step-00000002"} <= stored.branches.keys()
    assert "model.safetensors" in stored.branches["step-00000001"]
    assert TOKEN not in completed.stdout + completed.stderr
    assert f"pushed to the Hub: {hub.endpoint}/lab/crammed-tiny" in completed.stdout
    # Nor is it written anywhere in the run's folder: checkpoints, options, card, summary.
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert written and not [path for path in written if TOKEN.encode() in path.read_bytes()]


@pytest.mark.slow
def test_with_no_hub_reachable_the_local_checkpoint_is_complete_and_the_error_is_one_sentence(tmp_path, env):
    # Intermediate pushes fail too: each is a warning, and training goes on to the end.
    command = [sys.executable, RECIPE, *RUN, "--output-dir", tmp_path, "--push-to-hub", "lab/crammed-tiny",
               "--checkpoint-every", "1", "--push-checkpoints"]
    completed = run(command, env={**env, "HF_ENDPOINT": unreachable_endpoint()})
    assert completed.returncode == 2
    last_line = completed.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: could not reach the Hugging Face Hub")
    assert f"python -m cram.hub {tmp_path / 'final'} lab/crammed-tiny" in last_line
    assert "Traceback" not in completed.stderr
    assert {"model.safetensors", "config.json", "README.md", "cram_options.json"} <= {
        path.name for path in (tmp_path / "final").iterdir()}
    # Counted in the text, not by line starts: a push thread's warning that lands while the final model's shard bar
    # is drawn comes after tqdm's cursor-up code, on its own line in a terminal but not at the start of a line here.
    assert completed.stderr.count("warning: ") == completed.stderr.count(
        "warning: could not reach the Hugging Face Hub") == 2, completed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["optimizer_steps"] == 2


def test_a_bad_repository_name_is_refused_before_training(tmp_path, monkeypatch, capsys):
    # Refused while the options are checked, before anything starts: in this process, as tests/test_cli.py's are.
    status, stderr = run_recipe_in_process(monkeypatch, capsys, RECIPE, [
        *RUN, "--output-dir", tmp_path / "run", "--push-to-hub", "no-slash"])
    assert status == 2 and stderr.startswith("error: ")
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
