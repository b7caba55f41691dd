"""Command-line plumbing the recipes share: dataclass options with help lines, strict parsing."""

from __future__ import annotations

import dataclasses

from transformers import HfArgumentParser

from cram.errors import UserError


def option(default, help: str):  # noqa: A002 - mirrors argparse's keyword
    """A dataclass field with a help line; `HfArgumentParser` adds the --dashed-spelling itself."""
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: default, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def parse_strictly(parser: HfArgumentParser) -> tuple:
    """Parse the command line into the parser's dataclasses; an unknown option is a `UserError`, not a traceback."""
    *parsed, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        raise UserError(f"unknown option {' '.join(unknown)}: run with --help to see the options")
    return tuple(parsed)
