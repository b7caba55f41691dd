"""Optional dependencies: imported on the paths that use them, and a missing one named with its extra."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from cram.errors import UserError


def missing_sentence(package: str, extra: str, purpose: str) -> str:
    return f'{purpose} needs {package}, which is not installed: pip install "cram[{extra}]".'


def import_optional(module: str, *, package: str, extra: str, purpose: str) -> ModuleType:
    """`import module`, or one sentence naming the extra that installs it (`pip install "cram[glue]"`)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or module.split(".")[0] != err.name.split(".")[0]:
            raise  # the package is there but one of its own dependencies is not: its own message says which
        raise UserError(missing_sentence(package, extra, purpose)) from None


def require_installed(module: str, *, package: str, extra: str, purpose: str) -> None:
    """Refuse early, without importing it (wandb takes seconds), when `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise UserError(missing_sentence(package, extra, purpose))
