"""The wall-clock budget, the learning-rate triangle, the batch ramp and the accumulation it drives."""

import datasets
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from cram.data.collator import MaskedLMCollator
from cram.data.sampling import stream_loader
from cram.errors import UserError
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.models.crammed_bert_recipe import RAMP_END
from cram.train.budget import BudgetClock, StepClock, budget_triangle, parse_budget
from cram.train.loop import train
from cram.train.optim import build_adamw
from cram.train.ramp import full_accumulation, ramp_accumulation
from cram.train.state import TrainState


@pytest.mark.parametrize(
    "text, seconds", [("24h", 86400), ("90m", 5400), ("30s", 30), ("1.5d", 129600), (" 2h ", 7200)]
)
def test_parse_budget(text, seconds):
    assert parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "h", "ten minutes", "-5m", "0s", "5y"])
def test_unparsable_budget_is_a_user_error(text):
    with pytest.raises(UserError, match="budget"):
        parse_budget(text)


@pytest.mark.parametrize("progress, multiplier", [(0.0, 0.25), (0.6, 0.85), (0.75, 1.0), (1.0, 0.0), (0.9, 0.4)])
def test_budget_triangle(progress, multiplier):
    assert budget_triangle(progress) == pytest.approx(multiplier)


def test_budget_triangle_peaks_at_three_quarters():
    values = [budget_triangle(step / 1000) for step in range(1001)]
    assert max(values) == pytest.approx(1.0) and values.index(max(values)) == 750


def test_ramp_reaches_the_full_batch_at_sixty_percent_and_grows_monotonically():
    full = full_accumulation(8192, 128)
    assert full == 64
    steps = [ramp_accumulation(step / 100, full, RAMP_END) for step in range(101)]
    assert steps[0] == 1
    assert steps[30] == 32
    assert steps[60] == 64 and steps[-1] == 64
    assert all(a <= b for a, b in zip(steps, steps[1:], strict=False))
    assert ramp_accumulation(0.59, full, RAMP_END) < 64


def test_accumulation_accounts_for_processes():
    assert full_accumulation(8192, 128, num_processes=4) == 16


def test_micro_batch_that_does_not_divide_the_target_is_a_user_error():
    with pytest.raises(UserError, match="does not divide"):
        full_accumulation(8192, 96, num_processes=1)


def test_clock_progress():
    clock = BudgetClock(1000.0)
    assert clock.progress() == 0.0
    clock.start()
    assert 0.0 <= clock.progress() < 0.01 and clock.remaining() > 990


def test_a_resumed_budget_clock_continues_where_it_stopped():
    clock = BudgetClock(1000.0)
    clock.start(elapsed_before=600.0)
    assert 0.6 <= clock.progress() < 0.61 and 390 < clock.remaining() <= 400


def test_step_clock_progress_counts_optimizer_steps():
    clock = StepClock(40)
    clock.start(elapsed_before=12.0, steps_before=10)
    assert clock.progress(10) == 0.25 and clock.progress(40) == 1.0 and clock.progress(50) == 1.0
    assert clock.elapsed >= 12.0
    # Stopped early on the same schedule: the run ends at step 10, the learning rate still spans 40 steps.
    early = StepClock(40, stop_at=10)
    assert early.progress(5) == 0.5 and early.progress(10) == 1.0 and early.schedule_progress(10) == 0.25


def logged_first_step(micro_batch_size: int, accumulation: int) -> dict:
    """The log row of one optimizer step of the real loop over 16 sequences, cut into micro-batches."""
    set_seed(0)
    config = CrammedBertConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=32,
                                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    accelerator = Accelerator(cpu=True)
    model = CrammedBertForMaskedLM(config)
    optimizer = build_adamw(model, 1e-3, (0.9, 0.98), 1e-12, 0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    blocks = datasets.Dataset.from_dict({"input_ids": reference_blocks().tolist()})
    batches = iter(stream_loader(blocks, MaskedLMCollator(4, 1000, range(5)), start=0,
                                 micro_batch_size=micro_batch_size, process_index=0, num_processes=1))
    state = TrainState()
    train(model, optimizer, batches, accelerator, StepClock(1), state, peak_lr=1e-3, lr_shape=budget_triangle,
          accumulation_at=lambda progress: accumulation, max_grad_norm=1e9, show_progress=False)
    return state.history[0]


def reference_blocks() -> torch.Tensor:
    return torch.randint(5, 1000, (16, 32), generator=torch.Generator().manual_seed(3))


def test_an_accumulated_step_logs_the_gradient_of_the_mean_loss_over_all_its_sequences():
    # Computed apart from the loop: the same initial model, the 16 sequences masked by serial, one backward.
    set_seed(0)
    config = CrammedBertConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=32,
                                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = CrammedBertForMaskedLM(config)
    loss = model(**MaskedLMCollator(4, 1000, range(5))({"input_ids": reference_blocks(),
                                                        "serials": torch.arange(16)})).loss
    loss.backward()
    expected_norm = torch.linalg.vector_norm(torch.stack([param.grad.norm() for param in model.parameters()]))
    # Every sequence masks the same number of positions, so the mean over micro-batches is the mean over all:
    # a missing division by the accumulation, or a sum in its place, shows as a norm 2 or 4 times too large.
    for micro_batch_size, accumulation in [(16, 1), (8, 2), (4, 4)]:
        row = logged_first_step(micro_batch_size, accumulation)
        assert row["batch_size"] == 16
        assert row["loss"] == pytest.approx(loss.item(), rel=1e-5), accumulation
        assert row["grad_norm"] == pytest.approx(expected_norm.item(), rel=1e-4), accumulation
