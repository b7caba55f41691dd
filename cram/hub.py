"""Publish a checkpoint folder on the Hugging Face Hub as one upload, its model card (`cram.model_card`) included.

    python -m cram.hub runs/cram/final my-org/crammed-bert            # private repo, branch main
    python -m cram.hub runs/cram/final my-org/crammed-bert --revision 24h --public

The token comes from `hf auth login` or the HF_TOKEN variable (never the command line, where other users
and the shell history would see it), and HF_ENDPOINT points the push at another Hub. A push that fails
leaves the checkpoint folder as it was, and the error says how to push it later.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id
from tqdm import tqdm

from cram import __version__
from cram.errors import UserError, run_cli

# The HTTP library's base error, whichever huggingface_hub uses (httpx, httpx2): huggingface_hub exports no
# transport error of its own, but its HfHubHTTPError derives from that base, as do connection refused, DNS
# failures and timeouts.
HTTP_LIBRARY_ERROR = next(base for base in HfHubHTTPError.__mro__[1:] if base.__name__ == "HTTPError")


class HubUnreachable(UserError):
    """The Hub could not be reached; the checkpoint is saved locally and can be pushed later."""


def check_repo_id(repo_id: str) -> None:
    """Refuse anything but ORG/NAME (by huggingface_hub's own rule for names) before any request, so a typo costs no
    upload."""
    try:
        validate_repo_id(repo_id)
        valid = repo_id.count("/") == 1
    except HFValidationError:
        valid = False
    if not valid:
        raise UserError(
            f"the Hub repository {repo_id!r} is not of the form ORG/NAME: give your user or organisation name, "
            "a slash and a model name made of letters, digits, '-', '_' and '.', e.g. my-org/crammed-bert."
        )


def check_checkpoint_dir(checkpoint_dir: Path) -> None:
    """Refuse a folder that is not a finished checkpoint, before creating anything on the Hub."""
    if not checkpoint_dir.is_dir():
        raise UserError(
            f"the checkpoint folder {checkpoint_dir} does not exist: give the folder a training run wrote, "
            "e.g. runs/cram/final."
        )
    if not (checkpoint_dir / "config.json").is_file():
        raise UserError(
            f"{checkpoint_dir} holds no config.json, so it is not a finished checkpoint: give the folder a training "
            "run wrote, e.g. runs/cram/final."
        )


def push_command(checkpoint_dir: Path, repo_id: str, revision: str | None, private: bool) -> str:
    """The shell command that repeats this push, for error messages."""
    words = ["python", "-m", "cram.hub", str(checkpoint_dir), repo_id]
    if revision is not None:
        words += ["--revision", revision]
    if not private:
        words.append("--public")
    return shlex.join(words)


def push_checkpoint(
    checkpoint_dir: str | Path,
    repo_id: str,
    *,
    private: bool = True,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
) -> str:
    """Upload the whole checkpoint folder to the Hub model repo `repo_id` and return the commit's URL.

    The repo is created if missing (private unless `private=False`; an existing repo keeps its visibility), and
    so is the branch `revision` (from main). `token=None` means the one `hf auth login` saved or HF_TOKEN;
    `endpoint=None` means the Hub huggingface_hub resolved (HF_ENDPOINT, else huggingface.co).
    """
    checkpoint_dir = Path(checkpoint_dir)
    check_checkpoint_dir(checkpoint_dir)
    check_repo_id(repo_id)
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    command = push_command(checkpoint_dir, repo_id, revision, private)
    later = f"the checkpoint is saved at {checkpoint_dir}; push it later with `{command}`"
    api = HfApi(endpoint=endpoint, token=token, library_name="cram", library_version=__version__)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision is not None and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=checkpoint_dir,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or f"Upload {checkpoint_dir.name} with cram",
        )
    except OfflineModeIsEnabled as err:
        raise HubUnreachable(
            f"HF_HUB_OFFLINE is set, so {repo_id} was not pushed to {endpoint}: the checkpoint is saved at "
            f"{checkpoint_dir}; unset HF_HUB_OFFLINE and push it later with `{command}`."
        ) from err
    except HfHubHTTPError as err:
        status = err.response.status_code
        if status in (401, 403):
            raise UserError(
                f"the Hugging Face Hub at {endpoint} refused the credentials for pushing {repo_id} (HTTP {status}): "
                f"log in with `hf auth login` or set HF_TOKEN to a token that can write to {repo_id.split('/')[0]}; "
                f"{later}."
            ) from err
        reason = " ".join(str(err.server_message or "").split()).rstrip(".") or "no reason given"
        raise UserError(
            f"the Hugging Face Hub at {endpoint} refused to push {repo_id} (HTTP {status}: {reason}); {later}."
        ) from err
    except HTTP_LIBRARY_ERROR as err:  # connection refused, DNS failure, timeout, dropped connection
        raise HubUnreachable(f"could not reach the Hugging Face Hub at {endpoint} to push {repo_id}: {later}.") from err
    return str(commit.commit_url)


class BackgroundPusher:
    """Push checkpoint folders from a background thread, one at a time in the order given, so a training step
    never waits for an upload (on rank 0, a slow one would also keep the other ranks waiting in the next
    collective); `finish()` waits for the pending ones.

    A pushed folder is deleted (give it a copy made for the upload); one whose push fails is kept, and a warning
    says how to push it later: a failed intermediate push must not end a long run. `upload_folder(run_as_future=
    True)` would defer only the upload: each push here also creates its branch first, and must delete its copy or
    warn once the upload is done, so the whole `push_checkpoint` runs in the background.
    """

    def __init__(self, repo_id: str, *, private: bool = True) -> None:
        self.repo_id = repo_id
        self.private = private
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-push")
        self._pending: list[tuple[Future, Path, str]] = []

    def submit(self, folder: str | Path, revision: str) -> None:
        folder = Path(folder)
        self._pending.append((self._uploads.submit(self._push, folder, revision), folder, revision))

    def abandon(self) -> None:
        """Give up the uploads not yet done (a stopped run), each with a warning that says how to push its folder
        later; one already under way may still finish if this process lives long enough."""
        for upload, folder, revision in self._pending:
            if not upload.done():
                command = push_command(folder, self.repo_id, revision, self.private)
                tqdm.write(f"warning: the push of {folder.name} to {self.repo_id} did not finish before the stop: "
                           f"push it later with `{command}`.", file=sys.stderr)
        self._pending.clear()
        self._uploads.shutdown(wait=False, cancel_futures=True)  # the queued ones never start

    def finish(self) -> None:
        """Wait until every submitted folder is pushed (or has failed with a warning)."""
        for upload, _, _ in self._pending:
            upload.result()
        self._pending.clear()
        self._uploads.shutdown()

    def _push(self, folder: Path, revision: str) -> None:
        try:
            push_checkpoint(folder, self.repo_id, private=self.private, revision=revision)
        except UserError as err:
            # On a line of its own, whatever the progress bar in the training thread has half-drawn.
            tqdm.write(f"warning: {err}", file=sys.stderr)
            return
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cram.hub",
        description="Push a checkpoint folder to a Hugging Face Hub model repo (private unless --public).",
        epilog="The token comes from `hf auth login` or HF_TOKEN; HF_ENDPOINT points at another Hub.",
    )
    parser.add_argument("checkpoint_dir", type=Path, help="the folder a training run wrote, e.g. runs/cram/final")
    parser.add_argument("repo_id", help="the model repo as ORG/NAME; created if missing")
    parser.add_argument("--revision", default=None, help="branch to push to, created from main if missing")
    parser.add_argument("--public", action="store_true", help="create the repo public (an existing repo keeps its own)")
    args = parser.parse_args(argv)
    url = push_checkpoint(args.checkpoint_dir, args.repo_id, private=not args.public, revision=args.revision)
    print(f"pushed {args.checkpoint_dir} to {url}")


if __name__ == "__main__":
    run_cli(main)
