"""--push-checkpoints uploads in the background: training goes on while an upload is slow (a Hub stand-in whose
commits wait on a gate the test opens), uploads go one at a time in order, and the final push waits for them.

The stand-in answers requests side by side, so an upload started beside another shows in its count of requests in
flight; every wait here has a deadline, the gate's included, so a pusher that waits where it should not fails its
test instead of hanging it."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from hub_standin import HubStandIn
from launching import started, wait_until
from tqdm import tqdm

from cram.errors import UserError
from cram.hub import BackgroundPusher

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cram.py"
TOKEN = "hf_background_secret_0123456789"
# Hang guards, not speed limits: each is far longer than what it guards takes (a call that hands an upload over or
# gives them up, an upload to the local stand-in, a 3-step recipe run).
CALL_GUARD_SECONDS = 120
GATE_GUARD_SECONDS = 600  # the test opens the gate long before, in a `finally`
RUN_GUARD_SECONDS = 900


class SlowHub(HubStandIn):
    """A Hub whose commits wait until `gate` is set (at most GATE_GUARD_SECONDS, so no upload waits forever)."""

    def __init__(self, token: str | None = None, session_address: bool = False) -> None:
        super().__init__(token, session_address)
        self.gate = threading.Event()

    def before_answer(self, method: str, path: str) -> None:
        if "/commit/" in path:
            self.gate.wait(timeout=GATE_GUARD_SECONDS)

    def commits_started(self) -> int:
        with self.lock:
            return sum(1 for request in self.requests if "/commit/" in request.path)


def returns_within(seconds: float, call: Callable[[], object], what: str) -> None:
    """Call `call()` in a thread of its own; the test fails if it has not returned within `seconds`."""
    failures = []

    def calling() -> None:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - reported by the test below
            failures.append(error)

    thread = threading.Thread(target=calling, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"{what} waited for an upload instead of returning"
    assert failures == []


def checkpoint_folder(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"step": step}))
    (path / "model.safetensors").write_bytes(bytes([step]) * 64)
    return path


def commit_order(hub: HubStandIn) -> list[str]:
    """The revisions commits were made to, in the order they reached the Hub."""
    return [request.path.rsplit("/", 1)[1] for request in hub.requests if "/commit/" in request.path]


def test_submitting_returns_while_an_upload_waits_and_finish_waits_for_all_in_order(tmp_path, monkeypatch):
    with SlowHub(token=TOKEN) as hub:
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        pusher = BackgroundPusher("lab/tiny")
        folders = [checkpoint_folder(tmp_path / f"step-{step}", step) for step in (1, 2, 3)]

        def submit_all() -> None:
            for step, folder in enumerate(folders, start=1):
                pusher.submit(folder, revision=f"step-{step}")

        try:
            # A submit() that waited for its upload would be held at the gate: the test fails instead.
            returns_within(CALL_GUARD_SECONDS, submit_all, "submit()")
            # The first upload is held at the gate with the other two handed over: a pusher that uploaded more
            # than one at a time would have the next one's requests in flight beside it by now.
            wait_until(lambda: hub.commits_started() >= 1, seconds=CALL_GUARD_SECONDS, what="the first commit")
            assert all(not stored.commits.get(f"step-{step}") for stored in hub.repos.values() for step in (1, 2, 3))
        finally:
            hub.gate.set()  # also frees an upload held at the gate, so a failure above ends the test
        returns_within(CALL_GUARD_SECONDS, pusher.finish, "finish()")
        stored = hub.repos["lab/tiny"]
        assert hub.most_in_flight == 1
        assert commit_order(hub) == ["step-1", "step-2", "step-3"]
        for step in (1, 2, 3):
            assert stored.branches[f"step-{step}"]["model.safetensors"] == bytes([step]) * 64
        assert not any(folder.exists() for folder in folders)  # pushed copies are removed


def test_a_failed_background_push_warns_and_keeps_its_folder(tmp_path, monkeypatch, capsys):
    with HubStandIn(token=TOKEN) as hub:
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        hub.commit_refusal = (507, "storage is full")  # 507: not one huggingface_hub retries with backoff
        pusher = BackgroundPusher("lab/tiny")
        folder = checkpoint_folder(tmp_path / "step-1", 1)
        pusher.submit(folder, revision="step-1")
        pusher.finish()
    warning = capsys.readouterr().err
    assert warning.startswith("warning: the Hugging Face Hub at") and "storage is full" in warning
    assert folder.is_dir()


def test_a_failed_push_warns_on_a_line_of_its_own_while_the_progress_bar_is_drawn(tmp_path, monkeypatch, capsys):
    # The training thread's bar ends without a newline; a warning printed after it must not join its line.
    def unreachable(folder, repo_id, **kwargs):
        raise UserError(f"could not reach the Hugging Face Hub to push {repo_id}")

    monkeypatch.setattr("cram.hub.push_checkpoint", unreachable)
    bar = tqdm(total=100, bar_format="{percentage:3.0f}% |{bar:20}| {desc}", file=sys.stderr)
    bar.set_description_str("step 1", refresh=True)
    pusher = BackgroundPusher("lab/tiny")
    pusher.submit(checkpoint_folder(tmp_path / "step-1", 1), revision="step-1")
    pusher.finish()
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert "warning: could not reach the Hugging Face Hub to push lab/tiny" in lines


def test_a_stopped_run_abandons_the_uploads_still_waiting_and_says_how_to_push_each(tmp_path, monkeypatch, capsys):
    with SlowHub(token=TOKEN) as hub:
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        pusher = BackgroundPusher("lab/tiny")
        folders = [checkpoint_folder(tmp_path / f"step-{step}", step) for step in (1, 2)]
        for step, folder in enumerate(folders, start=1):
            pusher.submit(folder, revision=f"step-{step}")
        try:
            wait_until(lambda: hub.commits_started() >= 1, seconds=CALL_GUARD_SECONDS, what="the first commit")
            # The stop gives up what is left: it must not wait for the upload held at the gate.
            returns_within(CALL_GUARD_SECONDS, pusher.abandon, "abandon()")
        finally:
            hub.gate.set()
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2
    for step, (warning, folder) in enumerate(zip(warnings, folders, strict=True), start=1):
        assert warning.startswith(f"warning: the push of step-{step} to lab/tiny did not finish before the stop")
        assert f"python -m cram.hub {folder} lab/tiny --revision step-{step}" in warning
    assert folders[1].is_dir()  # never started: kept for the later push
    assert commit_order(hub) == ["step-1"]


@pytest.mark.slow
def test_training_finishes_while_checkpoint_uploads_wait_and_the_final_push_follows_them(tmp_path, recipe_env):
    env = {**recipe_env, "HF_TOKEN": TOKEN}
    env.pop("HF_HUB_OFFLINE", None)
    with SlowHub(token=TOKEN, session_address=True) as hub:  # its programs fork as the others do
        command = [sys.executable, RECIPE, "--preset", "tiny", "--max-steps", "3", "--micro-batch-size", "8",
                   "--target-batch-size", "16", "--output-dir", tmp_path, "--push-to-hub", "lab/crammed-tiny",
                   "--checkpoint-every", "1", "--push-checkpoints"]
        with started(command, env={**env, "HF_ENDPOINT": hub.endpoint}) as recipe:
            try:
                # The first checkpoint's upload reaches the Hub and is held there; the summary is written once the last
                # step is done, while it is still held. (Its commit is waited for, not assumed: the background push
                # can reach the Hub after the three steps, and asserting it had made the test fail on a slow machine.)
                wait_until(lambda: hub.commits_started() == 1, recipe, RUN_GUARD_SECONDS,
                           what="the first checkpoint's upload held at the Hub")
                wait_until((tmp_path / "summary.json").exists, recipe, RUN_GUARD_SECONDS,
                           what="training past a held checkpoint upload")
                assert hub.commits_started() == 1 and recipe.poll() is None
            finally:
                hub.gate.set()  # a failure above must not leave the recipe waiting at the gate
            completed = recipe.finished(RUN_GUARD_SECONDS)
        assert completed.returncode == 0, completed.stderr[-3000:]
        stored = hub.repos["lab/crammed-tiny"]
    assert hub.most_in_flight == 1
    # One at a time in the order the steps saved them, and the final model last.
    assert commit_order(hub) == ["step-00000001", "step-00000002", "step-00000003", "main"]
    assert "model.safetensors" in stored.branches["main"]
    assert not (tmp_path / "hub-uploads").exists() or not any((tmp_path / "hub-uploads").iterdir())
