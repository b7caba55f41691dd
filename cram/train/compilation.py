"""Whether a run compiles its model with torch.compile, in which of its modes, and why."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from accelerate import Accelerator
from accelerate.utils import DynamoBackend

from cram.errors import UserError

CompileChoice = Literal["auto", "true", "false", "default", "reduce-overhead", "max-autotune",
                        "max-autotune-no-cudagraphs"]
COMPILE_CHOICES: tuple[str, ...] = get_args(CompileChoice)
# torch.compile's modes, each a --compile choice of its own; `true`, and `auto` where it compiles, mean `default`.
COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def resolve_compile(choice: str, device_type: str) -> bool:
    """Whether to `torch.compile`; `compile_reason` says why, for the resolved options.

    `auto` compiles on GPUs Triton supports (compute capability 7.0 and newer) and not on the CPU, where the step
    is matrix products that inductor leaves to the same kernels, so compiling would only add its own time
    (`python -m cram.bench.train_step --compile` compares the two; docs/benchmarks.md: torch.compile on the CPU).
    """
    return resolve_compile_mode(choice, device_type) is not None


def resolve_compile_mode(choice: str, device_type: str) -> str | None:
    """The torch.compile mode the run compiles in (one of `COMPILE_MODES`), or None where it runs eager."""
    return compile_decision(choice, device_type)[0]


def compile_reason(choice: str, device_type: str) -> str:
    """Why `resolve_compile` decided as it did, in a phrase."""
    return compile_decision(choice, device_type)[1]


def compile_decision(choice: str, device_type: str) -> tuple[str | None, str]:
    if choice not in COMPILE_CHOICES:
        raise UserError(f"unknown --compile value {choice!r}: choose one of {', '.join(COMPILE_CHOICES)}.")
    if choice == "false":
        return None, "--compile false asked for it"
    if choice in COMPILE_MODES:
        return choice, f"--compile {choice} asked for it"
    if choice == "true":
        return "default", "--compile true asked for it"
    if device_type != "cuda":
        return None, "auto: off on the CPU, where the step is matrix products inductor cannot speed up"
    major, minor = torch.cuda.get_device_capability()
    if major < 7:
        return None, f"auto: off on a GPU of compute capability {major}.{minor}, below Triton's 7.0"
    return "default", f"auto: on for a GPU of compute capability {major}.{minor} (Triton's inductor kernels)"


def is_compiled(accelerator: Accelerator) -> bool:
    """Whether `prepare` compiles the model."""
    return compiled_mode(accelerator) is not None


def compiled_mode(accelerator: Accelerator) -> str | None:
    """The torch.compile mode `prepare` compiles the model in, or None where it does not compile."""
    plugin = accelerator.state.dynamo_plugin
    return None if plugin.backend == DynamoBackend.NO else plugin.mode
