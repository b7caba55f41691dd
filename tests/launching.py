"""The start of every `accelerate launch` command the tests run."""

from __future__ import annotations

import sys
from pathlib import Path

from cram.plan.sweep import free_port

ACCELERATE = Path(sys.executable).with_name("accelerate")


def accelerate_launch(config: Path | str) -> list:
    """`accelerate launch -q` with `config` on a free port: at Accelerate's default 29500, two launches at once (two
    pytest sessions on one machine, or a test beside a user's run) met in one rendezvous and hung."""
    return [ACCELERATE, "launch", "-q", "--config_file", config, "--main_process_port", str(free_port())]
