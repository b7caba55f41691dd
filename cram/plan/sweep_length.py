"""How long the sweep will take and how long each of its launches may run, said before the first launch.

A launch's parts are predicted before anything is measured: its start-up, each model build (every micro-batch probe
rebuilds the model and its optimizer), its optimizer steps at the model's step time (`cram.plan.cost`), and its one
timed training-state save. A launch's time limit is `LIMIT_FACTOR` times its prediction, so a slow candidate (an
offloaded optimizer, a spread that keeps the timing going) is measured, not ended as hung; `--candidate-timeout`
overrides it. The leaders' side-by-side launches and the verification take their limits from what the sweep measured.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from cram.devices import cpu_has_bf16_units
from cram.plan.cost import predicted_step_seconds
from cram.plan.days import revisions_in_step_run
from cram.plan.models import flops_per_token, recipe_for
from cram.plan.peak_memory import Shape
from cram.plan.rank import MOST_LEADERS, revision_and_state_bytes
from cram.plan.search import divisors
from cram.plan.setting import Setting
from cram.plan.space import Candidate
from cram.plan.timing import matmul_flops
from cram.train.throughput import peak_flops_for_name

# Seconds from a launch's command to its first model build (interpreters, torch, transformers, DeepSpeed, the process
# group, the prepared data): an allowance, as `ASSUMED_MFU` is for the steps, for the said length and the limits.
LAUNCH_START_SECONDS = 30.0
# A launch may run this many times its predicted seconds: room for an MFU down to a third of the assumed one, and for
# parts the prediction leaves out (compilation, the offloaded optimizer's host step, the allocator's warm-up).
LIMIT_FACTOR = 3.0
# No launch's limit is shorter: a small model's launch is mostly start-up and compilation, which no FLOP count sees.
SHORTEST_LIMIT_SECONDS = 900.0
# Recomputing the forward pass: 8 instead of 6 FLOPs per parameter and token.
CHECKPOINTING_SLOWDOWN = 8 / 6


@dataclass(frozen=True)
class LaunchCosts:
    """Seconds one launch's parts are predicted to take, before any is measured."""

    step_seconds: float | None  # one optimizer step of the global batch (None: no peak throughput is known)
    build_seconds: float  # building the model and its optimizer once; every probe rebuilds them
    save_seconds: float  # one training-state save
    start_seconds: float = LAUNCH_START_SECONDS


@dataclass(frozen=True)
class LaunchLimits:
    """Each launch's time limit: `LIMIT_FACTOR` × its predicted seconds, or `override_seconds` (--candidate-timeout)
    for every launch."""

    costs: LaunchCosts
    override_seconds: float | None = None

    @classmethod
    def fixed(cls, seconds: float) -> LaunchLimits:
        return cls(LaunchCosts(None, 0.0, 0.0), seconds)

    def limit(self, predicted_seconds: float | None) -> float:
        if self.override_seconds is not None:
            return self.override_seconds
        if predicted_seconds is None:  # no step time to scale: the shortest limit, several times over
            return 4 * SHORTEST_LIMIT_SECONDS
        return max(SHORTEST_LIMIT_SECONDS, LIMIT_FACTOR * predicted_seconds)

    def search_seconds(self, candidate: Candidate, setting: Setting) -> float | None:
        """Predicted seconds of `candidate`'s search-and-time launch (None: no step time known)."""
        if self.costs.step_seconds is None:
            return None
        step = self.costs.step_seconds * (CHECKPOINTING_SLOWDOWN if candidate.checkpointing else 1.0)
        probes = probes_at_most(setting)
        # A probe steps one micro-batch per process, at most the whole per-process batch: at most one full step.
        return (self.costs.start_seconds + (probes + 1) * self.costs.build_seconds + probes * step
                + timing_steps_at_most(setting) * step + self.costs.save_seconds)

    def search_limit(self, candidate: Candidate, setting: Setting) -> float:
        return self.limit(self.search_seconds(candidate, setting))

    def timing_limit(self, row: dict, steps: int) -> float:
        """The limit of a launch that times `row`'s measured micro-batch again for `steps` optimizer steps (warm-up
        included), from its measured step time and save."""
        if self.override_seconds is not None:
            return self.override_seconds
        predicted = (self.costs.start_seconds + self.costs.build_seconds + steps * row["step_time"]["median"]
                     + row["save_seconds"])
        return self.limit(predicted)


def probes_at_most(setting: Setting) -> int:
    """The search's probes at most: doubling or halving from the seed, then bisecting, over the divisors of the
    per-process batch."""
    return 2 * len(divisors(setting.global_batch_size // setting.num_processes)).bit_length()


def timing_steps_at_most(setting: Setting) -> int:
    return setting.warmup_steps + (setting.max_timed_steps or setting.timed_steps)


def sweep_length(to_launch: list[Candidate], cached: int, ruled_out: int, setting: Setting, limits: LaunchLimits,
                 paired_rounds: int, verify_steps: int, mixed_precision: bool) -> str:
    """The line said before the first launch: at most how many launches, model builds, optimizer steps and saves the
    sweep, the side-by-side timing of its leaders (`paired_rounds`) and the verification (`verify_steps`, 0: none)
    take, how long at the predicted costs with each launch's start-up, each launch's time limit, and how the run's
    revisions will count in its days (`revisions_said`)."""
    costs = limits.costs
    leaders = min(MOST_LEADERS, len(to_launch) + cached) if len(to_launch) + cached >= 2 else 0
    paired_launches = leaders * paired_rounds
    later_launches = paired_launches + (verify_steps > 0)
    launches = len(to_launch) + later_launches
    builds = len(to_launch) * (probes_at_most(setting) + 1) + later_launches
    later_steps = (paired_launches * (setting.warmup_steps + setting.timed_steps)
                   + (setting.warmup_steps + max(verify_steps, setting.max_timed_steps or 0) if verify_steps else 0))
    steps = len(to_launch) * (probes_at_most(setting) + timing_steps_at_most(setting)) + later_steps
    line = (f"sweep: {len(to_launch)} candidate(s) to launch ({cached} cached, {ruled_out} ruled out by the rules or "
            f"the memory model), then {later_launches} launch(es) to time the leaders side by side and verify the "
            f"pick: at most {launches} launches, {builds} model builds, {steps} optimizer steps and {launches} saves")
    if costs.step_seconds is None:
        line += " (no step time can be predicted for this device)"
    else:
        seconds = (launches * costs.start_seconds + builds * costs.build_seconds + steps * costs.step_seconds
                   + launches * costs.save_seconds)
        line += (f", about {format_duration(seconds)} at the predicted {costs.step_seconds:.3g} s per step, "
                 f"{costs.build_seconds:.3g} s per build, {costs.save_seconds:.3g} s per save and "
                 f"{costs.start_seconds:.3g} s per launch's start-up")
    if limits.override_seconds is not None:
        line += f"; each launch may take {format_duration(limits.override_seconds)} (--candidate-timeout)"
    elif to_launch:
        each = sorted({limits.search_limit(candidate, setting) for candidate in to_launch})
        shown = format_duration(each[0]) + (f" to {format_duration(each[-1])}" if len(each) > 1 else "")
        line += (f"; a candidate's launch may take {shown} ({LIMIT_FACTOR:g} × its predicted time, at least "
                 f"{format_duration(SHORTEST_LIMIT_SECONDS)}; --candidate-timeout SECONDS sets one limit for all)")
    return line + revisions_said(to_launch, setting.model, mixed_precision, costs.save_seconds) + (
        "; --candidates NAME,NAME measures fewer")


def revisions_said(to_launch: list[Candidate], model: str, mixed_precision: bool, save_seconds: float) -> str:
    """How a step-based recipe's revisions (Pythia's checkpoint steps) count in the run's days, as
    `cram.plan.rank.add_estimates` counts them: each at its share of the candidate's measured training-state save,
    the model's bytes over the state's; at the predicted save, how long they take in all. Empty for a recipe without
    revisions, or with no candidate to launch."""
    recipe = recipe_for(model)
    revisions = revisions_in_step_run(recipe.steps, recipe.checkpoint_steps) if recipe.steps else 0
    if not revisions or not to_launch:
        return ""
    shares = {}
    for candidate in to_launch:
        revision, state = revision_and_state_bytes(candidate.sharding, mixed_precision)
        shares.setdefault((revision, state), set()).add("DeepSpeed" if candidate.is_deepspeed else "DDP and FSDP")
    said = ", ".join(f"{revision:g}/{state:g} under {' and '.join(sorted(kinds))}"
                     for (revision, state), kinds in sorted(shares.items(), key=lambda item: item[0][0] / item[0][1]))
    line = (f"; the run's days will count its {revisions} revisions (the model alone, saved at {model}'s checkpoint "
            f"steps) each at its share of the candidate's measured training-state save, the model's bytes over the "
            f"state's: {said}")
    if save_seconds > 0:
        each = sorted(revisions * save_seconds * revision / state for revision, state in shares)
        shown = format_duration(each[0]) + (f" to {format_duration(each[-1])}" if len(each) > 1 else "")
        line += f", about {shown} in all at the predicted save"
    return line


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def predict_step_seconds(config: PretrainedConfig, global_batch_size: int, seq_len: int, num_processes: int,
                         use_cpu: bool, device: str) -> float | None:
    """A step's seconds before any is measured (`cram.plan.cost.predicted_step_seconds`): from the GPU table's
    peak, or on the CPU from this process's matrix-product rate (the processes share the cores); None for a GPU
    the table does not hold."""
    if use_cpu:
        peak = matmul_flops(torch.bfloat16 if cpu_has_bf16_units() else torch.float32)
    else:
        one_device = peak_flops_for_name(device)
        if one_device is None:
            return None
        peak = one_device * num_processes
    return predicted_step_seconds(global_batch_size * seq_len, flops_per_token(config, seq_len), peak)


def training_state_bytes(shape: Shape) -> float:
    """Bytes one training-state save writes over the node: the weights in the training dtype and Adam's fp32
    master weights and moments."""
    return (shape.activation_bytes + 12.0) * shape.parameters


def predicted_costs(shape: Shape, step_seconds: float | None, folder: Path) -> LaunchCosts:
    """The launch costs on this node: a build initialises each process's fp32 model at this process's measured
    initialisation rate (the processes build side by side); a save writes the training state at the measured
    write rate of `folder`, where the probes save."""
    build = 4.0 * shape.parameters / initialisation_bytes_per_second()
    save = training_state_bytes(shape) / write_bytes_per_second(folder)
    return LaunchCosts(step_seconds, build, save)


def initialisation_bytes_per_second(elements: int = 1 << 24) -> float:
    """Bytes per second this process fills with normally distributed fp32 values, as a model's initialisation
    does."""
    values = torch.empty(elements)
    values.normal_()  # the first fill pays for the page faults
    started = time.perf_counter()
    values.normal_()
    return 4.0 * elements / (time.perf_counter() - started)


def write_bytes_per_second(folder: Path, size: int = 1 << 26) -> float:
    """Bytes per second written and synced to the disk that holds `folder` (measured in its nearest existing
    folder, so nothing is created)."""
    folder = next(parent for parent in (folder.absolute(), *folder.absolute().parents) if parent.is_dir())
    block = os.urandom(1 << 20)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-rate") as target:
        started = time.perf_counter()
        for _ in range(size // len(block)):
            target.write(block)
        target.flush()
        os.fsync(target.fileno())
        return size / (time.perf_counter() - started)
