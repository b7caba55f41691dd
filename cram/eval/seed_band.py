"""The replication verdict's band: where one more faithful run's loss falls, judged from the seeds' own spread.

At each step the K references (seeds of one recipe) give a mean and a sample standard deviation s. One more run
drawn like them lies within mean ± t · s · √(1 + 1/K) with probability 1 − a, t Student's quantile with K − 1
degrees of freedom at 1 − a/2 (a prediction interval for one observation). Tested at m steps, a = alpha / m
(Bonferroni), so that a faithful run fails anywhere with probability at most alpha. The scale is never smaller than
the scoring's own standard error, paired over the scored sequences (every model scores the same ones): with few
sequences or seeds that agree closely, chance in the scoring would otherwise fail a faithful run. With one
reference there is no spread to judge by: the band is that reference ± a tolerance the user chooses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

# Pythia's checkpoints are log-spaced up to step 512 and every 1000 after (pythia-*.yml: `extra-save-iters`
# [0, 1, 2, 4, …, 512], `checkpoint-factor: 1000`): the early steps, where the seeds' spread is widest, are judged
# apart from the late ones.
EARLY_STEPS_END = 512


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


@dataclass(frozen=True)
class StepJudgement:
    """One step's band and our place in it."""

    mean: float  # the references' mean loss
    spread: float | None  # the references' sample standard deviation (None: one reference)
    standard_error: float  # the scoring's own, of our loss against the references' mean, paired over sequences
    scale: float  # what z is measured in: max(spread · √(1 + 1/K), standard_error); the tolerance for one reference
    critical: float  # |z| above this fails (t quantile, Bonferroni over the steps tested); 1 for one reference
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


def paired_standard_error(ours: torch.Tensor, references: torch.Tensor) -> float:
    """The standard error of our mean loss minus the references' mean loss, from per-sequence losses scored on the
    same sequences (`ours`: [n], `references`: [K, n]); 0 for a single sequence."""
    differences = ours.double() - references.double().mean(0)
    if differences.numel() < 2:
        return 0.0
    return differences.std().item() / math.sqrt(differences.numel())


def judge_step(ours: torch.Tensor, references: torch.Tensor, steps_tested: int, alpha: float,
               tolerance: float) -> StepJudgement:
    """Our per-sequence losses `ours` [n] against the references' [K, n] at one of `steps_tested` steps."""
    our_loss = ours.double().mean().item()
    per_reference = references.double().mean(1)
    mean = per_reference.mean().item()
    standard_error = paired_standard_error(ours, references)
    count = per_reference.numel()
    if count == 1:
        return StepJudgement(mean, None, standard_error, tolerance, 1.0, our_loss)
    spread = per_reference.std().item()
    scale = max(spread * math.sqrt(1 + 1 / count), standard_error)
    critical = t_quantile_two_sided(alpha / steps_tested, count - 1)
    return StepJudgement(mean, spread, standard_error, scale, critical, our_loss)
