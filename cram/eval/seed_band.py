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
mean are (shrunk towards independence, since K seeds estimate that correlation roughly). With fewer references their
correlation is too rough to lean on, and c is Bonferroni's. With one reference there is no spread to judge by: the
band is that reference ± a tolerance the user chooses.

One odd reference (a seed far from the others, or a revision that is not what its name says) would widen s at every
step and take the verdict's power with it. So each reference is screened against the others, leave-one-out: its
largest |z| over the steps against the other K − 1's band. With K ≥ CALIBRATION_MIN_REFERENCES, the farthest one is
left out of the band where that |z| is beyond what the farthest of K faithful references reaches with probability
alpha; the simulation that calibrates c runs the same screening on every simulated set of references, so a faithful
run still fails with probability alpha, the screening included. With fewer references the farthest one is named when
it is beyond Bonferroni's bound for K references, and the verdict without it is reported, but the band keeps it:
leaving one of so few out, uncalibrated, fails faithful runs more often than alpha, for little power
(docs/benchmarks.md).
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
# simulations in docs/benchmarks.md fail a faithful run more often than alpha with 5): Bonferroni, and no reference
# is left out of the band.
CALIBRATION_MIN_REFERENCES = 8
# The estimated correlations, times this: a few seeds overstate how much the steps move together, which would lower
# the critical value below what alpha allows.
CORRELATION_SHRINK = 0.8
CALIBRATION_DRAWS = 20_000  # simulated faithful runs: enough that the quantile's own error is small next to z
CALIBRATION_SEED = 0  # the simulation is seeded: the same losses always give the same verdict
# The simulation runs in chunks of about this many values per array (draws × runs × steps), so its memory is bounded
# whatever the number of steps judged.
CALIBRATION_CHUNK_VALUES = 1 << 19


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
    CORRELATION_SHRINK towards independence. Each step's deviations are divided by their own spread first: the
    seeds' spread differs from step to step (wide at the init, narrow late), and z is measured in it."""
    deviations = means - means.mean(0)
    spread = deviations.std(0, ddof=1)
    spread[spread == 0] = 1.0
    deviations = deviations / spread
    correlation = deviations.T @ deviations / (len(means) - 1)
    correlation = CORRELATION_SHRINK * correlation + (1 - CORRELATION_SHRINK) * np.eye(len(correlation))
    np.fill_diagonal(correlation, 1.0)
    return correlation


def _ratio(difference: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """difference / scale, where a zero scale gives 0 for no difference and ±inf for any."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = difference / scale
    return np.where(scale > 0, ratio, np.where(difference == 0, 0.0, np.copysign(np.inf, difference)))


def band_z(ours: np.ndarray, references: np.ndarray) -> np.ndarray:
    """The z of `ours` ([..., m]: a mean loss at each step) against the band of `references` ([..., K, m]) at each
    step: (ours − mean) / (s · √(1 + 1/K))."""
    spread = references.std(-2, ddof=1)
    return _ratio(ours - references.mean(-2), spread * prediction_factor(references.shape[-2]))


def leave_one_out_z(means: np.ndarray) -> np.ndarray:
    """Each reference's z at each step against the band of the other K − 1 (`means`: [..., K, m], K ≥ 3)."""
    centred = means - means.mean(-2, keepdims=True)  # z ignores a shift; centring keeps small spreads exact
    return _leave_one_out(centred, (centred ** 2).sum(-2, keepdims=True))[0]


def _leave_one_out(centred: np.ndarray, squares: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From the references' deviations from their mean (`centred`, [..., K, m]) and their sum of squares
    ([..., 1, m]): each one's leave-one-out z, and the others' mean (as a deviation) and scale, in closed form (the
    deviations sum to 0, so the others' mean is −d/(K − 1) and their sum of squares S − d² · K/(K − 1))."""
    count = centred.shape[-2]
    others_mean = -centred / (count - 1)
    variance = np.clip((squares - centred ** 2 * count / (count - 1)) / (count - 2), 0, None)
    scale = np.sqrt(variance) * prediction_factor(count - 1)
    return _ratio(centred - others_mean, scale), others_mean, scale


@dataclass(frozen=True)
class Calibration:
    """What K faithful references and one more faithful run reach, in simulation, with probability alpha."""

    plain: float  # the largest |z| of one more run over the steps, against all K
    screen: float  # the farthest reference's largest leave-one-out |z|
    screened: float  # the largest |z| of one more run against the K − 1 others where the farthest is beyond `screen`,
    # against all K where it is not


def calibrate(correlation: np.ndarray, references: int, alpha: float, draws: int | None = None) -> Calibration:
    """The 1 − alpha quantiles of the verdict's statistics, for `references` seeds and one more run all drawn with
    the steps correlated as `correlation` says, z computed as the verdict computes it. The draws come in chunks of
    about CALIBRATION_CHUNK_VALUES values, so memory does not grow with the draws or with the square of the steps."""
    steps = len(correlation)
    values, vectors = np.linalg.eigh(correlation)
    root = vectors * np.sqrt(np.clip(values, 0, None))  # root @ root.T == correlation
    draws = draws or CALIBRATION_DRAWS
    chunk = max(1, CALIBRATION_CHUNK_VALUES // ((references + 1) * steps))
    generator = np.random.default_rng(CALIBRATION_SEED)
    plain, farthest, screened = [], [], []
    for start in range(0, draws, chunk):
        size = min(chunk, draws - start)
        runs = generator.standard_normal((size, references + 1, steps)) @ root.T
        seeds = runs[:, :references]
        mean = seeds.mean(1)
        centred = seeds - mean[:, None]
        squares = (centred ** 2).sum(1, keepdims=True)
        ours = runs[:, references] - mean
        spread = np.sqrt(squares[:, 0] / (references - 1))
        plain.append(np.abs(_ratio(ours, spread * prediction_factor(references))).max(-1))
        z, others_mean, others_scale = _leave_one_out(centred, squares)
        distances = np.abs(z).max(-1)  # [size, K]
        far = distances.argmax(-1)
        rows = np.arange(size)
        farthest.append(distances[rows, far])
        screened.append(np.abs(_ratio(ours - others_mean[rows, far], others_scale[rows, far])).max(-1))
    plain_z, farthest_z, screened_z = (np.concatenate(parts) for parts in (plain, farthest, screened))
    screen = float(np.quantile(farthest_z, 1 - alpha))
    verdict_z = np.where(farthest_z > screen, screened_z, plain_z)
    return Calibration(float(np.quantile(plain_z, 1 - alpha)), screen, float(np.quantile(verdict_z, 1 - alpha)))


def calibrated_critical(correlation: np.ndarray, references: int, alpha: float, draws: int | None = None) -> float:
    """The 1 − alpha quantile of the largest |z| over the steps of one more faithful run against `references` others,
    with no screening: the critical value of a band of every reference."""
    return calibrate(correlation, references, alpha, draws).plain


@dataclass(frozen=True)
class Screening:
    """Each reference against the others, leave-one-out, at the steps judged."""

    z: np.ndarray  # [K, m]: each reference's z against the band of the others
    bound: float  # a reference whose largest |z| is beyond this is far
    far: int | None  # the farthest reference, where it is beyond the bound
    left_out: bool  # whether the band leaves the far reference out (with enough references) or only names it

    @property
    def largest(self) -> list[float]:
        """Each reference's largest |z| over the steps."""
        return [float(value) for value in np.abs(self.z).max(1)]


@dataclass(frozen=True)
class Band:
    """Where one more faithful run's mean loss lies at each step, from the references `kept` of `means` ([K, m])."""

    means: np.ndarray
    kept: tuple[int, ...]
    critical: float
    method: str

    @property
    def mean(self) -> np.ndarray:
        return self.means[list(self.kept)].mean(0)

    @property
    def spread(self) -> np.ndarray:
        return self.means[list(self.kept)].std(0, ddof=1)

    def z(self, ours: np.ndarray) -> np.ndarray:
        """The z of `ours` ([..., m]) at each step."""
        return band_z(ours, self.means[list(self.kept)])

    def passes(self, ours: np.ndarray) -> np.ndarray:
        """Whether `ours` ([..., m]) lies within the band at every step."""
        return np.abs(self.z(ours)).max(-1) <= self.critical


@dataclass(frozen=True)
class Bands:
    """The band the verdict judges by; the band of every reference without any screening (the verdict's where no
    reference is far, or with fewer than CALIBRATION_MIN_REFERENCES); the band without the far reference (None where
    none is far); and the screening (None below 3 references)."""

    verdict: Band
    every: Band
    without_far: Band | None
    screening: Screening | None


def reference_bands(means: np.ndarray, alpha: float) -> Bands:
    """The bands of `means` ([K, m], each reference's mean loss at each step, K ≥ 2) at `alpha`: the screening, and
    the critical value calibrated (K ≥ CALIBRATION_MIN_REFERENCES) or Bonferroni's."""
    references, steps = means.shape
    everyone = tuple(range(references))
    bonferroni = bonferroni_critical(references, steps, alpha)
    few = (f"Bonferroni over {steps} steps ({references} references are too few to estimate the steps' "
           "correlation)")
    if references < 3:
        every = Band(means, everyone, bonferroni, few)
        return Bands(every, every, None, None)
    z = leave_one_out_z(means)
    largest = np.abs(z).max(1)
    farthest = int(largest.argmax())
    without = tuple(index for index in everyone if index != farthest)
    if references < CALIBRATION_MIN_REFERENCES:
        bound = t_quantile_two_sided(alpha / (steps * references), references - 2)
        screening = Screening(z, bound, farthest if largest[farthest] > bound else None, False)
        every = Band(means, everyone, bonferroni, few)
        without_far = None if screening.far is None else Band(
            means, without, bonferroni_critical(references - 1, steps, alpha),
            f"Bonferroni over {steps} steps, without the far reference")
        return Bands(every, every, without_far, screening)
    # The correlation from the others than the farthest: an odd reference alone would make the steps look as one.
    calibration = calibrate(step_correlation(means[list(without)]), references, alpha)
    screening = Screening(z, calibration.screen, farthest if largest[farthest] > calibration.screen else None, True)
    critical = min(calibration.screened, bonferroni_critical(references - 1, steps, alpha))
    method = (f"the largest |z| over {steps} steps, calibrated on the references' own correlation between steps, "
              f"the leave-one-out screening included (Bonferroni's would be {bonferroni:.2f})")
    every = Band(means, everyone, min(calibration.plain, bonferroni),
                 f"the largest |z| over {steps} steps, calibrated on the references' own correlation between steps, "
                 f"every reference kept (Bonferroni's would be {bonferroni:.2f})")
    if screening.far is None:
        return Bands(Band(means, everyone, critical, method), every, None, screening)
    without_far = Band(means, without, critical, method)
    return Bands(without_far, every, without_far, screening)


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


@dataclass(frozen=True)
class Judged:
    """Our run judged at every step by the verdict's band, and by the other band where a reference is far."""

    judgements: list[StepJudgement]
    method: str
    kept: tuple[int, ...]  # the references the verdict's band is made of
    screening: Screening | None
    other: list[StepJudgement] | None = None  # judged with the far reference where the band left it out, else without
    other_kept: tuple[int, ...] | None = None

    @property
    def passed(self) -> bool:
        return all(judgement.passed for judgement in self.judgements)


def _judged_by(band: Band, ours: list[torch.Tensor], references: list[torch.Tensor]) -> list[StepJudgement]:
    kept = list(band.kept)
    return [StepJudgement(float(band.mean[step]), float(band.spread[step]), scoring_error(losses[kept]),
                          float(band.spread[step]) * prediction_factor(len(kept)), band.critical,
                          our_losses.double().mean().item())
            for step, (our_losses, losses) in enumerate(zip(ours, references, strict=True))]


def judge_steps(ours: list[torch.Tensor], references: list[torch.Tensor], alpha: float, tolerance: float) -> Judged:
    """Our per-sequence losses at each step (`ours[j]`: [n]) against the references' (`references[j]`: [K, n])."""
    means = np.array([[losses.double().mean().item() for losses in step] for step in references]).T  # [K, m]
    if means.shape[0] == 1:
        return Judged([StepJudgement(float(means[0, step]), None, None, tolerance, 1.0,
                                     our_losses.double().mean().item()) for step, our_losses in enumerate(ours)],
                      f"one reference: within ± {tolerance:g} nats of it", (0,), None)
    bands = reference_bands(means, alpha)
    other = None
    if bands.without_far is not None:
        other = bands.every if bands.verdict is bands.without_far else bands.without_far
    return Judged(_judged_by(bands.verdict, ours, references), bands.verdict.method, bands.verdict.kept,
                  bands.screening, None if other is None else _judged_by(other, ours, references),
                  None if other is None else other.kept)


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
