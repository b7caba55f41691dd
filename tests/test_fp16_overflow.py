"""fp16 overflow steps as GPT-NeoX v1.0 handled them: the loss scale follows DeepSpeed's rules (hysteresis 2,
minimum 1) outside DeepSpeed too, and a skipped step does not advance the learning-rate schedule while it does count
as a step. Both are checked against GPT-NeoX's and DeepSpeed's code written out here, on the real GradScaler,
optimizer and training-loop path, with overflows forced by an infinite loss."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launching import run

from cram.errors import UserError
from cram.models.pythia_recipe import pythia_recipe
from cram.train.accelerator import build_accelerator
from cram.train.budget import StepClock
from cram.train.loop import train
from cram.train.loss_scaling import HysteresisGradScaler, hysteresis_scaler_like, record_overflows
from cram.train.state import TrainState


class DeeperSpeedDynamicLossScaler:
    """`DynamicLossScaler` of deepspeed/runtime/fp16/loss_scaler.py at DeeperSpeed eb7f5cff (the commit GPT-NeoX
    v1.0's requirements pin), as written there, without its logging (consecutive_hysteresis False)."""

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise Exception("Current loss scale already at minimum - cannot decrease scale anymore.")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class AnnealingLR:
    """GPT-NeoX v1.0 megatron/learning_rates.py `AnnealingLR` (cosine), as written there: `step()` advances the
    iteration and sets the learning rate; the constructor sets that of iteration 0."""

    def __init__(self, start_lr: float, warmup_iter: float, total_iters: int, min_lr: float):
        self.start_lr, self.warmup_iter, self.end_iter, self.min_lr = start_lr, warmup_iter, total_iters, min_lr
        self.num_iters = 0
        self.lr = self.get_lr()

    def get_lr(self) -> float:
        num_iters_ = min(self.num_iters, self.end_iter - self.warmup_iter)
        if self.warmup_iter > 0 and self.num_iters <= self.warmup_iter:
            return float(self.start_lr) * num_iters_ / self.warmup_iter
        num_iters_ = num_iters_ - self.warmup_iter
        lr = self.start_lr / 2.0 * (math.cos(math.pi * num_iters_ / self.end_iter) + 1)
        return max(lr, self.min_lr)

    def step(self) -> None:
        self.num_iters += 1
        self.lr = self.get_lr()


class Probe(torch.nn.Module):
    """A linear model whose loss the batch multiplies by `factor`: infinite on the steps that must overflow."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, input_ids: torch.Tensor, factor: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=self.linear(input_ids.float()).pow(2).mean() * factor.max())


def probe_batch(step: int, overflow: bool) -> dict[str, torch.Tensor]:
    inputs = torch.arange(8, dtype=torch.float32).reshape(2, 4) / (step + 1)
    return {"input_ids": inputs, "factor": torch.tensor([math.inf if overflow else 1.0])}


def drive_scaler(scaler: torch.amp.GradScaler, overflows: set[int], steps: range) -> list[tuple[float, bool]]:
    """Run `steps` through the real scale → backward → step → update path; per step, (scale after it, whether its
    update was applied)."""
    torch.manual_seed(0)
    model = Probe()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in steps:
        before = model.linear.weight.detach().clone()
        loss = model(**probe_batch(step, step in overflows)).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        seen.append((scaler.get_scale(), not torch.equal(before, model.linear.weight)))
    return seen


def pythia_scaler() -> torch.amp.GradScaler:
    """What recipes/pythia.py puts in place of Accelerate's GradScaler: pythia-*.yml's fp16 block, on this device."""
    scaling = pythia_recipe("pythia-160m").loss_scaling
    return hysteresis_scaler_like(torch.amp.GradScaler("cpu"), 2.0**scaling.initial_scale_power, scaling.window,
                                  scaling.hysteresis, scaling.min_scale)


OVERFLOWS = {3, 4, 9, 10, 11, 30, 1040, 2041, 2042}  # single, paired, tripled; one in each 1000-step window


def test_the_grad_scaler_follows_deepspeed_s_hysteresis_window_and_skips_as_gpt_neox_did():
    scaler = pythia_scaler()
    assert isinstance(scaler, HysteresisGradScaler) and scaler.get_scale() == 4096.0  # initial_scale_power 12
    reference = DeeperSpeedDynamicLossScaler(4096.0, 1000, 1.0, 2)  # loss_scale_window, min_loss_scale, hysteresis
    seen = drive_scaler(scaler, OVERFLOWS, range(2100))
    for step, (scale, applied) in enumerate(seen):
        reference.update_scale(step in OVERFLOWS)
        assert (scale, applied) == (reference.cur_scale, step not in OVERFLOWS), step
    # The rules at work: the first overflow of a pair is absorbed, and the window doubles the scale.
    scales = [scale for scale, _ in seen]
    assert scales[3] == 4096.0 and scales[4] == 2048.0 and max(scales) > scales[1039]


SHARDED_RUN = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from test_fp16_overflow import OVERFLOWS, drive_scaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from cram.train.loss_scaling import HysteresisLossScaling, hysteresis_scaler_like
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
scaler = hysteresis_scaler_like(ShardedGradScaler("cpu"), 4096.0, 1000, 2, 1.0)
assert isinstance(scaler, ShardedGradScaler) and isinstance(scaler, HysteresisLossScaling)
print(drive_scaler(scaler, OVERFLOWS, range(1100)))
dist.destroy_process_group()
"""


@pytest.mark.launch
def test_fsdp1_s_sharded_scaler_gets_the_same_rules():
    """FSDP1 launches (fsdp_version 1) scale through torch's ShardedGradScaler, which all-reduces the overflow
    check: the replacement keeps that kind, in a process group of its own (a subprocess, one rank)."""
    from cram.plan.launch import free_port

    completed = run([sys.executable, "-c", SHARDED_RUN, str(Path(__file__).parent), str(free_port())])
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip() == str(drive_scaler(pythia_scaler(), OVERFLOWS, range(1100)))


def test_the_scaler_resumes_from_its_saved_state_as_if_never_stopped():
    never_stopped = pythia_scaler()
    whole = drive_scaler(never_stopped, OVERFLOWS, range(1100))
    first = pythia_scaler()
    drive_scaler(first, OVERFLOWS, range(1045))
    resumed = pythia_scaler()
    resumed.load_state_dict(first.state_dict())  # what Accelerate's save_state / load_state carry in scaler.pt
    assert drive_scaler(resumed, OVERFLOWS, range(1045, 1100)) == whole[1045:]
    counts = ("iteration", "last_overflow_iteration", "hysteresis_left")  # where the window and hysteresis stand
    assert [getattr(resumed, name) for name in counts] == [getattr(never_stopped, name) for name in counts]


def test_the_scale_never_falls_below_the_minimum_and_an_overflow_there_ends_the_run_as_deepspeed_does():
    scaler = hysteresis_scaler_like(torch.amp.GradScaler("cpu"), 4.0, 1000, 1, 3.0)
    reference = DeeperSpeedDynamicLossScaler(4.0, 1000, 3.0, 1)
    reference.update_scale(True)
    assert [scale for scale, _ in drive_scaler(scaler, {0}, range(1))] == [reference.cur_scale] == [3.0]
    with pytest.raises(Exception, match="already at minimum"):
        reference.update_scale(True)
    with pytest.raises(UserError, match=r"minimum loss scale 3, .*--precision bf16\)\.$"):
        drive_scaler(scaler, {0}, range(1))


def accelerators_scaler() -> torch.amp.GradScaler:
    """What build_accelerator leaves in an fp16 Accelerator outside DeepSpeed: Accelerate's GradScaler, its rules
    unchanged, in the kind that records overflows."""
    accelerator = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000))
    record_overflows(accelerator)
    assert (accelerator.scaler.get_scale(), accelerator.scaler.get_growth_interval()) == (2.0**16, 1000)
    return accelerator.scaler


# Fused AdamW takes the scaler's inf check into its kernel and skips there: the optimizer's step is still called, so
# Accelerate's `optimizer_step_was_skipped` stays False and only the loss scaler knows of the overflow.
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
@pytest.mark.parametrize("scaler", [pythia_scaler, accelerators_scaler], ids=["pythia-scaler", "torch-scaler"])
def test_a_skipped_step_counts_as_a_step_but_does_not_advance_the_lr_schedule(tmp_path, fused, scaler):
    """The loop on the real Accelerate path: the GradScaler in the accelerator (on a GPU, Accelerate builds it for
    fp16 and recipes/pythia.py replaces it; the CPU has no fp16 autocast, so the test puts it there), its optimizer
    step skipped on an overflow and Accelerate reporting it. The learning rates must be GPT-NeoX's: AnnealingLR stepped
    by DeepSpeed's engine only after a step without overflow (`_take_model_step`), so each overflow holds the
    schedule back one step."""
    recipe = pythia_recipe("pythia-14m")
    schedule, stop_at, overflows = 40, 12, {2, 5, 6}
    accelerator = build_accelerator("fp32", "false", None, str(tmp_path))
    accelerator.scaler = scaler()
    torch.manual_seed(0)
    model = Probe()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), fused=fused))
    state = TrainState()
    batches = iter(probe_batch(step, step in overflows) for step in range(stop_at))
    finished = train(model, optimizer, batches, accelerator, StepClock(schedule, stop_at=stop_at), state,
                     peak_lr=recipe.peak_lr, lr_shape=recipe.lr_shape(schedule), accumulation_at=lambda pace: 1,
                     max_grad_norm=None, log_every=1, show_progress=False)
    assert finished and state.optimizer_steps == stop_at  # GPT-NeoX's iteration counts skipped steps too
    assert state.skipped_steps == len(overflows) and state.history[-1]["skipped_steps"] == len(overflows)
    scheduler = AnnealingLR(recipe.peak_lr, 0.01 * schedule, schedule, recipe.peak_lr * 0.1)
    expected = []
    for step in range(stop_at):
        expected.append(scheduler.lr)
        if step not in overflows:
            scheduler.step()
    assert [row["lr"] for row in state.history] == pytest.approx(expected, rel=1e-12, abs=0.0)
    assert expected[3] == expected[2] and expected[7] == expected[6] == expected[5]  # held after each overflow
