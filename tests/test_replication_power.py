"""The replication verdict's power and false fails, simulated in this process (cram.bench.replication_power, smaller):
seeds' mean losses at six steps at real loss scales (a spread of about 0.01 nats, its own at each step), the steps
correlated, one more run judged by cram.eval.seed_band's bands as the check judges it. Each test fails when a piece of
the verdict is taken out: the calibration on the steps' correlation (or the correlation replaced by the covariance or
by the identity), Student's t, the prediction factor √(1 + 1/K), the later steps, a scale that our own run widens, the
leave-one-out screening, or the calibration's bounded memory."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch

import cram.eval.seed_band as seed_band
from cram.bench.replication_power import (
    SIMULATED_SPREADS,
    SIMULATED_STEPS,
    Scenario,
    departures,
    draw_runs,
    simulate,
)
from cram.eval.seed_band import (
    bonferroni_critical,
    calibrate,
    calibrated_critical,
    default_steps,
    judge_steps,
    reference_bands,
)


@pytest.fixture
def quick_calibration(monkeypatch):
    """2,000 simulated runs a calibration, not 20,000 (the quantile's error grows to about ±0.05 in |z|): the rates
    below average over it."""
    monkeypatch.setattr(seed_band, "CALIBRATION_DRAWS", 2_000)


def test_with_ten_seeds_at_real_loss_scales_a_faithful_run_fails_at_most_alpha_and_4_spreads_off_fails(
        quick_calibration):
    # K = 10, six steps, every pair correlated 0.9, the seeds' spread 0.036 nats at the init and 0.010 late.
    columns = departures()
    result = simulate(Scenario(10, 0.9), 300, seed=3,
                      shifts={name: columns[name] for name in ("faithful", "4", "6 at the last step only")})
    faithful, power, late = (result["columns"][name]["verdict"]["rate"]
                             for name in ("faithful", "4", "6 at the last step only"))
    # 300 trials: ±0.013 at 0.05; a departure at one late step alone is seen too (every step judged counts).
    assert faithful <= 0.05 and power >= 0.75 and late >= 0.85, result


def test_one_outlying_reference_is_left_out_and_no_longer_takes_the_power(quick_calibration):
    # One of ten references 5 seed spreads off at every step: the band of all ten is wide and a run 4 spreads off
    # passes; the verdict leaves the outlier out and catches it, while a faithful run still passes.
    columns = departures()
    result = simulate(Scenario(10, 0.9, outlier=5.0), 150, seed=4,
                      shifts={name: columns[name] for name in ("faithful", "4")})
    four, faithful = result["columns"]["4"], result["columns"]["faithful"]
    assert four["every"]["rate"] <= 0.3 and four["verdict"]["rate"] >= 0.6, result
    assert faithful["verdict"]["rate"] <= 0.08 and result["left_out"]["rate"] >= 0.4, result


def references_at_real_scale(correlation: float, references: int = 10, seed: int = 0) -> np.ndarray:
    """`references` seeds' mean losses at the six steps: wide at the init, narrow late, steps correlated."""
    return draw_runs(Scenario(references - 1, correlation), np.random.default_rng(seed))  # K − 1 and one more


def test_the_critical_value_is_calibrated_on_the_steps_correlation_at_real_loss_scales(quick_calibration):
    # Ten seeds whose steps move together (0.99), at spreads of 0.010 … 0.036 nats: the critical value is near one
    # step's Student t, far below independent steps' (Šidák's). With the covariance in place of the correlation
    # (entries of 1e-4 against a diagonal of 1) or the identity, the calibration sees independent steps.
    means = references_at_real_scale(0.99)
    assert means.shape == (10, SIMULATED_STEPS) and 0.005 < means.std(0, ddof=1).min() < means.std(0, ddof=1).max()
    bands = reference_bands(means, 0.05)
    independent = calibrate(np.eye(SIMULATED_STEPS), 10, 0.05)
    assert bands.every.critical < independent.plain - 0.2, (bands.every.critical, independent)
    assert bands.verdict.critical < independent.screened - 0.2, (bands.verdict.critical, independent)
    assert bands.verdict.kept == tuple(range(10))  # none far


def test_the_critical_value_lies_between_one_step_and_independent_steps():
    one_step = seed_band.t_quantile_two_sided(0.05, 9)  # 2.262
    # Steps that move together are one test: Student's t at alpha, not Bonferroni's 3.5.
    assert calibrated_critical(np.ones((6, 6)), 10, 0.05) == pytest.approx(one_step, abs=0.05)
    # Independent steps: Šidák's per-step tail 1 − (1 − alpha)^(1/6), each |z| a Student t of 9 degrees... nearly
    # (the six share no references' draws, only their count), so within the simulation's error of it.
    sidak = seed_band.t_quantile_two_sided(1 - 0.95 ** (1 / 6), 9)
    assert calibrated_critical(np.eye(6), 10, 0.05) == pytest.approx(sidak, abs=0.08)
    assert bonferroni_critical(10, 6, 0.05) > sidak > one_step
    # The screening costs a little: the verdict's critical value, which allows for a faithful reference left out,
    # is above the plain one, and the bound on the farthest of ten faithful references is above both.
    calibration = calibrate(np.eye(6), 10, 0.05)
    assert calibration.plain < calibration.screened < calibration.plain + 0.3 < calibration.screen
    # Fewer than 8 references: their correlation is not leaned on, Bonferroni's t, and none is left out.
    means = np.random.default_rng(0).standard_normal((4, 6))
    bands = reference_bands(means, 0.05)
    assert bands.verdict.critical == bonferroni_critical(4, 6, 0.05) == pytest.approx(
        seed_band.t_quantile_two_sided(0.05 / 6, 3))
    assert bands.verdict.method.startswith("Bonferroni over 6 steps") and bands.verdict.kept == (0, 1, 2, 3)


def test_the_calibration_holds_bounded_memory_whatever_the_steps(monkeypatch):
    # Pythia's 154 steps at once: the calibration's memory is its chunks', the same for 2,000 draws as for 8,000
    # (a [draws, m, m] array of the references' cross-products would be 380 MB at 2,000).
    correlation = np.full((154, 154), 0.9) + np.eye(154) * 0.1
    peaks = []
    for draws in (2_000, 8_000):
        tracemalloc.start()
        critical = calibrated_critical(correlation, 10, 0.05, draws=draws)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert 2.3 < critical < bonferroni_critical(10, 154, 0.05)
    assert max(peaks) < 64 * 2**20 and peaks[1] < 1.5 * peaks[0], peaks


def test_a_far_reference_is_named_and_left_out_with_ten_and_only_named_with_four(quick_calibration):
    generator = np.random.default_rng(1)
    spreads = np.array(SIMULATED_SPREADS)
    for count in (10, 4):
        means = 4.0 + generator.standard_normal((count, SIMULATED_STEPS)) * spreads
        means[2] += 12 * spreads  # a reference far from the others at every step
        ours = means[[index for index in range(count) if index != 2]].mean(0) + 4.5 * spreads
        scores = [torch.tensor(means[:, step:step + 1]) for step in range(SIMULATED_STEPS)]
        judged = judge_steps([torch.tensor([value]) for value in ours], scores, 0.05, 0.1)
        assert judged.screening.far == 2 and judged.screening.largest[2] > judged.screening.bound
        assert max(judged.screening.largest[:2] + judged.screening.largest[3:]) < judged.screening.largest[2]
        if count == 10:  # left out: the band of the other nine fails ours, the band with it would pass it
            assert judged.kept == (0, 1, 3, 4, 5, 6, 7, 8, 9) and judged.screening.left_out
            assert not judged.passed and all(judgement.passed for judgement in judged.other)
        else:  # named only: the band keeps it (so it passes ours), the verdict without it is reported
            assert judged.kept == (0, 1, 2, 3) and not judged.screening.left_out and judged.other_kept == (0, 1, 3)
            assert judged.passed and judged.other[0].critical == pytest.approx(bonferroni_critical(3, 6, 0.05))


def test_z_is_measured_in_the_seeds_spread_times_the_prediction_factor_against_students_t():
    # Three references of mean losses 1, 2, 3 at one step (mean 2, spread 1), ours 4: z = 2 / √(1 + 1/3), and
    # |z| ≤ 4.303 (Student's t, 2 degrees of freedom, 5 %) passes, not 1.96.
    (judgement,) = judge_steps([torch.tensor([4.0])], [torch.tensor([[1.0], [2.0], [3.0]])], 0.05, 0.1).judgements
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
    (judgement,) = judge_steps([ours], [references], 0.05, 0.1).judgements
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
