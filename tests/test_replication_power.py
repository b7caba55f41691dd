"""The replication verdict's power and false fails, simulated in this process (cram.bench.replication_sensitivity's
simulated part, smaller): seeds' mean losses at the default steps with the steps correlated, one more run judged by
cram.eval.seed_band as the check judges it. Each test fails when a piece of the verdict is taken out: the calibration
or Bonferroni over the steps, Student's t, the prediction factor √(1 + 1/K), the later steps, or a scale that our own
run widens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import cram.eval.seed_band as seed_band
from cram.bench.replication_sensitivity import SIMULATED_STEPS, simulated_fail_rate
from cram.eval.seed_band import bonferroni_critical, calibrated_critical, default_steps, judge_steps


@pytest.fixture
def quick_calibration(monkeypatch):
    """2,000 simulated runs a calibration, not 20,000 (the quantile's error grows to about ±0.05 in |z|): the rates
    below average over it."""
    monkeypatch.setattr(seed_band, "CALIBRATION_DRAWS", 2_000)


def test_with_ten_seeds_and_correlated_default_steps_a_faithful_run_fails_at_most_alpha_and_4_spreads_off_fails(
        quick_calibration):
    # The done criterion: K = 10, the 6 default steps, every pair of steps correlated 0.9 (a seed above the mean at
    # one step tends to stay above it).
    false_fails = simulated_fail_rate(10, SIMULATED_STEPS, 0.9, 0.0, trials=400, seed=3)
    power = simulated_fail_rate(10, SIMULATED_STEPS, 0.9, 4.0, trials=100, seed=4)
    # A departure at one late step alone is seen too: every step judged counts, not the first.
    late = simulated_fail_rate(10, SIMULATED_STEPS, 0.9, 6.0, trials=40, at_steps=(SIMULATED_STEPS - 1,), seed=5)
    assert false_fails <= 0.05 and power >= 0.8 and late >= 0.8, (false_fails, power, late)


def test_the_critical_value_is_calibrated_between_one_step_and_independent_steps():
    one_step = seed_band.t_quantile_two_sided(0.05, 9)  # 2.262
    # Steps that move together are one test: Student's t at alpha, not Bonferroni's 3.5.
    assert calibrated_critical(np.ones((6, 6)), 10, 0.05) == pytest.approx(one_step, abs=0.05)
    # Independent steps: Šidák's per-step tail 1 − (1 − alpha)^(1/6), each |z| a Student t of 9 degrees... nearly
    # (the six share no references' draws, only their count), so within the simulation's error of it.
    sidak = seed_band.t_quantile_two_sided(1 - 0.95 ** (1 / 6), 9)
    assert calibrated_critical(np.eye(6), 10, 0.05) == pytest.approx(sidak, abs=0.08)
    assert bonferroni_critical(10, 6, 0.05) > sidak > one_step
    # Fewer than 8 references: their correlation is not leaned on, Bonferroni's t.
    means = np.random.default_rng(0).standard_normal((4, 6))
    critical, method = seed_band.critical_value(means, 0.05)
    assert critical == bonferroni_critical(4, 6, 0.05) == pytest.approx(seed_band.t_quantile_two_sided(0.05 / 6, 3))
    assert method.startswith("Bonferroni over 6 steps")


def test_z_is_measured_in_the_seeds_spread_times_the_prediction_factor_against_students_t():
    # Three references of mean losses 1, 2, 3 at one step (mean 2, spread 1), ours 4: z = 2 / √(1 + 1/3), and
    # |z| ≤ 4.303 (Student's t, 2 degrees of freedom, 5 %) passes, not 1.96.
    (judgement,), _ = judge_steps([torch.tensor([4.0])], [torch.tensor([[1.0], [2.0], [3.0]])], 0.05, 0.1)
    assert judgement.spread == pytest.approx(1.0) and judgement.z == pytest.approx(2 / math.sqrt(4 / 3))
    assert judgement.critical == pytest.approx(4.303, abs=1e-3) and judgement.passed
    assert judgement.detectable == pytest.approx(4.303 * math.sqrt(4 / 3), abs=1e-3)
    assert judgement.detectable_spreads == pytest.approx(4.303 * math.sqrt(4 / 3), abs=1e-3)


def test_a_departure_that_varies_across_sequences_does_not_widen_its_own_band():
    # Ten seeds on 32 sequences, 0.0075 nats apart; our run 0.084 nats worse (11 seed spreads), its per-sequence
    # losses scattered 0.5 about that: the band is the seeds' spread, so it fails (a floor of our own scatter's
    # standard error, 0.5 / √32, would pass it at z ≈ 1).
    generator = torch.Generator().manual_seed(0)
    text = 3 + torch.rand(32, generator=generator, dtype=torch.float64)
    offsets = torch.randn(10, 1, generator=generator, dtype=torch.float64)
    offsets = (offsets - offsets.mean()) / offsets.std() * 0.0075
    references = text + offsets + torch.randn(10, 32, generator=generator, dtype=torch.float64) * 0.001
    scatter = torch.randn(32, generator=generator, dtype=torch.float64) * 0.5
    ours = references.mean(0) + 0.084 + scatter - scatter.mean()
    (judgement,), _ = judge_steps([ours], [references], 0.05, 0.1)
    assert judgement.z > 9 and not judgement.passed
    assert judgement.scoring_error < judgement.spread  # from the references alone: small here


def test_the_default_steps_are_few_and_chosen_before_looking():
    from cram.models.pythia_recipe import pythia_checkpoint_steps

    pythia = pythia_checkpoint_steps()
    assert len(pythia) == 154
    chosen = default_steps(pythia)
    assert chosen == [0, 32, 512, 48000, 95000, 143000] and len(chosen) == SIMULATED_STEPS
    # pythia-160m's matched set: 4 models × 6 steps = 24 downloads, not 1,540.
    assert default_steps([0, 4, 16, 64, 256, 512, 576, 640]) == [0, 16, 512, 576, 640]
