"""The start of every `accelerate launch` command the tests run."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from cram.plan.sweep import free_port

ACCELERATE = Path(sys.executable).with_name("accelerate")


def accelerate_launch(config: Path | str) -> list:
    """`accelerate launch -q` with `config` on a free port: at Accelerate's default 29500, two launches at once (two
    pytest sessions on one machine, or a test beside a user's run) met in one rendezvous and hung."""
    return [ACCELERATE, "launch", "-q", "--config_file", config, "--main_process_port", str(free_port())]


def run_recipe_in_process(monkeypatch, capsys, recipe: Path, arguments: list) -> tuple[object, str]:
    """Run `python RECIPE ARGUMENTS` in this process and return its exit status and stderr: for bad input, which a
    recipe refuses before any training (a fresh interpreter per case costs about 10 s of imports)."""
    monkeypatch.setattr(sys, "argv", [str(recipe), *map(str, arguments)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # a recipe drops its own folder from the import path
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(recipe), run_name="__main__")
    return stopped.value.code, capsys.readouterr().err
