"""`.ci/floors` names its subset test by test: each name must still exist, or the job errors instead of testing."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_test_the_floors_job_names_exists():
    script = (REPO / ".ci" / "floors").read_text()
    named = re.findall(r"(tests/test_\w+\.py)(?:::(\w+))?", script)
    assert len(named) >= 10
    for path, test in named:
        assert (REPO / path).is_file(), path
        if test:
            assert re.search(rf"^def {test}\(", (REPO / path).read_text(), re.MULTILINE), f"{path}::{test}"
