"""Command-line plumbing the recipes share: dataclass options with help lines, strict parsing."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable
from typing import NoReturn

from transformers import HfArgumentParser

from cram.errors import UserError


def option(default, help: str):  # noqa: A002 - mirrors argparse's keyword
    """A dataclass field with a help line; `OptionParser` adds the --dashed-spelling itself."""
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: default, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def summary(docstring: str) -> str:
    """A module docstring's first paragraph as one line: the description `--help` shows."""
    return " ".join(docstring.strip().split("\n\n")[0].split())


class OptionParser(HfArgumentParser):
    """`HfArgumentParser` that names each option by its dashed spelling first (`--max-steps`, the underscored one
    still accepted) and reports a bad value in one line, as the recipes report every other mistake."""

    def __init__(self, dataclass_types: type | Iterable[type], **kwargs):
        super().__init__(dataclass_types, **kwargs)
        for action in self._actions:
            action.option_strings.sort(key=lambda spelling: "_" in spelling)  # stable: the order is kept otherwise

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {message}; run with --help to see the options.", file=sys.stderr)
        sys.exit(2)


def parse_strictly(parser: HfArgumentParser) -> tuple:
    """Parse the command line into the parser's dataclasses; an unknown option is a `UserError`, not a traceback."""
    *parsed, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        raise UserError(f"unknown option {' '.join(unknown)}: run with --help to see the options")
    return tuple(parsed)
