"""The versions cram runs with: the floors pyproject.toml states, refused below, and the newest tested, warned below."""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Callable

from accelerate.utils import parse_flag_from_env
from packaging.requirements import Requirement
from packaging.version import Version

from cram.errors import UserError

# The newest versions the whole suite ran with (.ci/run's main job). Older ones down to the floors in pyproject.toml
# ran the floors job's subset (.ci/floors); a run with them gets one warning saying so.
NEWEST_TESTED = {
    "torch": "2.13",
    "transformers": "5.24",
    "accelerate": "1.15",
    "datasets": "5.2",
    "deepspeed": "0.19.8",
}
# Why an extra's floor is higher than the base install's: cram refuses the launch that takes that path with an
# older package, and names the reason.
EXTRA_FLOOR_REASONS = {
    ("deepspeed", "accelerate"): (
        "before accelerate 1.9 it enters DeepSpeed's `no_sync` under ZeRO-2 and ZeRO-3, which DeepSpeed 0.16 and "
        "later refuse, and before 1.8 its DeepSpeed wrapper ignored `sync_gradients`, so every micro-batch of an "
        "accumulation became an optimizer step on a down-scaled loss"
    ),
    ("deepspeed", "deepspeed"): (
        "before DeepSpeed 0.16.0 its checkpoints do not load under torch 2.6's `weights_only` default, so a ZeRO "
        "run cannot resume"
    ),
}
_warned_untested: set[str] = set()


def check_installed_versions(
    uses_deepspeed: bool | None = None,
    requirements: list[str] | None = None,
    installed: Callable[[str], str] = importlib.metadata.version,
) -> None:
    """Refuse a package older than cram's floor, or a combination known to train wrongly, in one sentence each;
    warn once about versions older than the newest tested.

    The floors come from the installed package's metadata (pyproject.toml as pip installed it), so they cannot
    drift from a copy. The base install's floors always apply; those of the `deepspeed` extra apply to a launch
    that uses DeepSpeed (`uses_deepspeed=None` reads the launch config's ACCELERATE_USE_DEEPSPEED), which also
    needs DeepSpeed itself installed.
    """
    if uses_deepspeed is None:
        uses_deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    if requirements is None:
        try:
            requirements = importlib.metadata.requires("cram") or []
        except importlib.metadata.PackageNotFoundError:
            requirements = []  # a source tree on PYTHONPATH, not installed: pip never saw its floors either
    if uses_deepspeed:
        try:
            installed("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            raise UserError(
                'the launch config uses DeepSpeed, which is not installed: pip install "cram[deepspeed]" (or pick '
                "a launch config without DeepSpeed, e.g. accel_configs/1gpu.yaml)."
            ) from None
    for line in requirements:
        requirement = Requirement(line)
        extra = _extra_of(requirement)
        if extra is not None and not (extra == "deepspeed" and uses_deepspeed):
            continue
        try:
            version = installed(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # pip installs every base requirement; a missing extra says so where it is imported
        if requirement.specifier.contains(version, prereleases=True):
            continue
        reason = EXTRA_FLOOR_REASONS.get((extra, requirement.name))
        why = f": {reason}" if reason else ""
        raise UserError(
            f"{requirement.name} {version} is installed but cram{f'[{extra}]' if extra else ''} needs "
            f"{requirement.name}{requirement.specifier}{why}; run pip install -U '{requirement.name}"
            f"{requirement.specifier}'."
        )
    warn_about_untested_versions(installed)


def _extra_of(requirement: Requirement) -> str | None:
    """The extra a `Requires-Dist` line belongs to (`; extra == "deepspeed"`), or None for the base install."""
    if requirement.marker is None:
        return None
    named = re.search(r'extra\s*==\s*"([^"]+)"', str(requirement.marker))
    return named.group(1) if named else None


def warn_about_untested_versions(installed: Callable[[str], str] = importlib.metadata.version) -> None:
    """One line per package older than the newest tested, once per process (and only on the first rank)."""
    if os.environ.get("RANK", "0") != "0":
        return
    for package, newest in NEWEST_TESTED.items():
        try:
            version = installed(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if package in _warned_untested or Version(version).release >= Version(newest).release:
            continue
        _warned_untested.add(package)
        print(
            f"note: {package} {version} is older than {newest}, the newest cram's whole test suite ran with; the "
            "floors job ran a subset of it at cram's floors (docs/compatibility.md).",
            file=sys.stderr,
        )
