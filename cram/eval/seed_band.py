"""The replication verdict's band: where one more faithful run's loss falls, judged from the seeds' own spread.

At each step the K references (seeds of one recipe) give a mean and a sample standard deviation s of their held-out
losses. One more run drawn like them lies within mean ± t · s · √(1 + 1/K) with probability 1 − a, t Student's
quantile with K − 1 degrees of freedom at 1 − a/2 (a prediction interval for one observation), so its z-score is
(ours − mean) / (s · √(1 + 1/K)).

What varies: every model scores the same held-out sequences, so a reference's mean loss is the text's difficulty
(shared by all, cancelled in ours − mean) plus its seed's offset plus the seed-by-sequence noise averaged over the
sequences scored. s measures those two together, at the count of sequences scored, and that is the variance the band
models: a faithful run differs from the references' mean by exactly what a seed does. Nothing of our own run enters
the scale (a departure that varies across sequences must not widen its own band); the scoring's share of s is
reported beside it (`scoring_error`, from the references alone).

Over m steps the largest |z| must stay below a critical value c, chosen so that a faithful run fails anywhere with
probability alpha. The steps are correlated (a seed above the mean at one step tends to be above it at the next), so
Bonferroni's t at alpha/(2m) is too strict; with K ≥ CALIBRATION_MIN_REFERENCES, c is the 1 − alpha quantile of the
largest |z| over the steps in simulation, with the steps correlated as the references' own deviations from their
mean are (shrunk towards independence, since K seeds estimate that correlation roughly), and never above
Bonferroni's. With fewer references their correlation is too rough to lean on, and c is Bonferroni's. With one
reference there is no spread to judge by: the band is that reference ± a tolerance the user chooses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

# Pythia's checkpoints are log-spaced up to step 512 and every 1000 after (pythia-*.yml: `extra-save-iters`
# [0, 1, 2, 4, …, 512], `checkpoint-factor: 1000`): the early steps, where the seeds' spread is widest, are judged
# apart from the late ones.
EARLY_STEPS_END = 512
# The default steps judged, chosen before any loss is seen: a few early ones, log-spaced (the init, where another
# init shows, then 32 and 512), and late ones at a third, two thirds and the end of what both sides kept. Few steps
# keep the downloads few (6 × K models) and the power high.
DEFAULT_EARLY_STEPS = (0, 32, 512)
DEFAULT_LATE_FRACTIONS = (1 / 3, 2 / 3, 1.0)
# Below this many references, their correlation between steps is too rough an estimate to calibrate on (the
# simulations in docs/benchmarks.md fail a faithful run more often than alpha with 5): Bonferroni.
CALIBRATION_MIN_REFERENCES = 8
# The estimated correlations, times this: a few seeds overstate how much the steps move together, which would lower
# the critical value below what alpha allows.
CORRELATION_SHRINK = 0.8
CALIBRATION_DRAWS = 20_000  # simulated faithful runs: enough that the quantile's own error is small next to z
CALIBRATION_SEED = 0  # the simulation is seeded: the same losses always give the same verdict


def t_two_sided_probability(t: float, degrees: int) -> float:
    """P(|T| ≤ t) for Student's T with integer `degrees`, in closed form (Abramowitz & Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(abs(t) / math.sqrt(degrees))
    cos2 = math.cos(theta) ** 2
    if degrees % 2:  # odd: 2/π (θ + sin θ cos θ (1 + 2/3 cos²θ + 2·4/(3·5) cos⁴θ + … up to cos^(ν−3)θ))
        total, term = 0.0, 1.0
        for k in range(1, (degrees - 1) // 2 + 1):
            total += term
            term *= cos2 * (2 * k) / (2 * k + 1)
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    total, term = 0.0, 1.0  # even: sin θ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + … up to cos^(ν−2)θ)
    for k in range(1, degrees // 2 + 1):
        total += term
        term *= cos2 * (2 * k - 1) / (2 * k)
    return math.sin(theta) * total


@cache
def t_quantile_two_sided(tail: float, degrees: int) -> float:
    """The t with P(|T| > t) = `tail` for Student's T with integer `degrees` ≥ 1 (bisection on the angle θ,
    t = √ν tan θ, over which P(|T| ≤ t) rises monotonically)."""
    low, high = 0.0, math.pi / 2
    for _ in range(200):
        middle = (low + high) / 2
        if t_two_sided_probability(math.sqrt(degrees) * math.tan(middle), degrees) < 1 - tail:
            low = middle
        else:
            high = middle
    return math.sqrt(degrees) * math.tan((low + high) / 2)


def prediction_factor(references: int) -> float:
    """√(1 + 1/K): one more seed varies about the references' mean by its own spread and the mean's error."""
    return math.sqrt(1 + 1 / references)


def bonferroni_critical(references: int, steps: int, alpha: float) -> float:
    """Student's t with K − 1 degrees of freedom at alpha / (2 · steps)."""
    return t_quantile_two_sided(alpha / steps, references - 1)


def step_correlation(means: np.ndarray) -> np.ndarray:
    """The correlation between steps of the references' deviations from their mean (`means`: [K, m], each
    reference's mean loss at each step), which is that of their leave-one-out z-scores; shrunk by
    CORRELATION_SHRINK towards independence."""
    deviations = means - means.mean(0)
    spread = deviations.std(0, ddof=1)
    spread[spread == 0] = 1.0
    deviations = deviations / spread
    correlation = deviations.T @ deviations / (len(means) - 1)
    correlation = CORRELATION_SHRINK * correlation + (1 - CORRELATION_SHRINK) * np.eye(len(correlation))
    np.fill_diagonal(correlation, 1.0)
    return correlation


@cache
def _standard_draws(references: int, steps: int, draws: int) -> tuple[np.ndarray, np.ndarray]:
    """The seeded standard normal draws every calibration of this shape starts from, as the two things z needs of
    them: one more run's difference from the seeds' mean, [draws, m], and the seeds' centred cross-products,
    [draws, m, m] (z is linear in the draws, so a correlation's root applies to these as to the draws)."""
    drawn = np.random.default_rng(CALIBRATION_SEED).standard_normal((draws, references + 1, steps))
    seeds = drawn[:, :references]
    centred = seeds - seeds.mean(1, keepdims=True)
    return drawn[:, references] - seeds.mean(1), np.einsum("dki,dkj->dij", centred, centred)


def calibrated_critical(correlation: np.ndarray, references: int, alpha: float, draws: int | None = None) -> float:
    """The 1 − alpha quantile of the largest |z| over the steps of one more faithful run against `references` others,
    all drawn with the steps correlated as `correlation` says: z from the simulated references' own mean and
    spread, as the verdict computes it."""
    values, vectors = np.linalg.eigh(correlation)
    root = vectors * np.sqrt(np.clip(values, 0, None))  # root @ root.T == correlation
    difference, products = _standard_draws(references, len(correlation), draws or CALIBRATION_DRAWS)
    variance = ((products @ root.T) * root.T).sum(1) / (references - 1)  # root_j · products · root_j
    z = (difference @ root.T) / (np.sqrt(variance) * prediction_factor(references))
    return float(np.quantile(np.abs(z).max(1), 1 - alpha))


def critical_value(means: np.ndarray, alpha: float) -> tuple[float, str]:
    """The critical |z| over the steps judged (`means`: [K, m], each reference's mean loss at each step), and how it
    was found."""
    references, steps = means.shape
    bonferroni = bonferroni_critical(references, steps, alpha)
    if steps == 1:
        return bonferroni, "one step: Student's t"
    if references < CALIBRATION_MIN_REFERENCES:
        return bonferroni, (f"Bonferroni over {steps} steps ({references} references are too few to estimate the "
                            "steps' correlation)")
    calibrated = calibrated_critical(step_correlation(means), references, alpha)
    return min(calibrated, bonferroni), (f"the largest |z| over {steps} steps, calibrated on the references' own "
                                         f"correlation between steps (Bonferroni's would be {bonferroni:.2f})")


@dataclass(frozen=True)
class StepJudgement:
    """One step's band and our place in it."""

    mean: float  # the references' mean loss
    spread: float | None  # the references' sample standard deviation (None: one reference)
    scoring_error: float | None  # the seed-by-sequence noise's share of one model's loss, from the references alone
    scale: float  # what z is measured in: spread · √(1 + 1/K); the tolerance for one reference
    critical: float  # |z| above this fails; 1 for one reference
    ours: float

    @property
    def z(self) -> float:
        if self.scale == 0:
            return 0.0 if self.ours == self.mean else math.copysign(math.inf, self.ours - self.mean)
        return (self.ours - self.mean) / self.scale

    @property
    def low(self) -> float:
        return self.mean - self.critical * self.scale

    @property
    def high(self) -> float:
        return self.mean + self.critical * self.scale

    @property
    def passed(self) -> bool:
        return abs(self.z) <= self.critical

    @property
    def detectable(self) -> float:
        """The smallest departure, in nats, that lies outside the band on average (caught about half the time)."""
        return self.critical * self.scale

    @property
    def detectable_spreads(self) -> float | None:
        """The same in seed spreads."""
        return None if not self.spread else self.detectable / self.spread


def scoring_error(references: torch.Tensor) -> float | None:
    """The standard error one model's mean loss carries from the sequences scored (`references`: [K, n], per
    sequence), from the references alone: the seed-by-sequence residual of a two-way layout, over √n."""
    count, sequences = references.shape
    if count < 2 or sequences < 2:
        return None
    losses = references.double()
    residual = losses - losses.mean(1, keepdim=True) - losses.mean(0, keepdim=True) + losses.mean()
    variance = residual.pow(2).sum().item() / ((count - 1) * (sequences - 1))
    return math.sqrt(variance / sequences)


def judge_steps(ours: list[torch.Tensor], references: list[torch.Tensor], alpha: float,
                tolerance: float) -> tuple[list[StepJudgement], str]:
    """Our per-sequence losses at each step (`ours[j]`: [n]) against the references' (`references[j]`: [K, n]),
    and how the critical value was found."""
    means = np.array([[losses.double().mean().item() for losses in step] for step in references]).T  # [K, m]
    count = means.shape[0]
    if count == 1:
        critical, method = 1.0, f"one reference: within ± {tolerance:g} nats of it"
    else:
        critical, method = critical_value(means, alpha)
    judgements = []
    for step, (our_losses, reference_losses) in enumerate(zip(ours, references, strict=True)):
        our_loss = our_losses.double().mean().item()
        mean = float(means[:, step].mean())
        if count == 1:
            judgements.append(StepJudgement(mean, None, None, tolerance, critical, our_loss))
            continue
        spread = float(means[:, step].std(ddof=1))
        judgements.append(StepJudgement(mean, spread, scoring_error(reference_losses),
                                        spread * prediction_factor(count), critical, our_loss))
    return judgements, method


def default_steps(shared: list[int]) -> list[int]:
    """The steps judged when none are asked for: of the steps both sides kept, those nearest DEFAULT_EARLY_STEPS
    (among the early ones) and the fractions DEFAULT_LATE_FRACTIONS of the last (among the late ones, or all where
    none is late)."""
    early = [step for step in shared if step <= EARLY_STEPS_END]
    late = [step for step in shared if step > EARLY_STEPS_END] or shared
    chosen = {min(early, key=lambda step: (abs(step - target), step)) for target in DEFAULT_EARLY_STEPS} if early \
        else set()
    last = late[-1]
    chosen |= {min(late, key=lambda step: (abs(step - fraction * last), step)) for fraction in DEFAULT_LATE_FRACTIONS}
    return sorted(chosen)
