"""Benchmark: the replication verdict's false fails and power, simulated with seeds whose truth is known.

    python -m cram.bench.replication_power [--trials 2000] [--output runs/bench-replication/simulated.json]

The seeds' mean held-out losses at six steps (as many as cram.eval.seed_band.default_steps picks from Pythia's 154),
at the loss scales of a trained run: a mean and a seed spread of its own at each step (SIMULATED_LOSSES,
SIMULATED_SPREADS), each pair of steps correlated 0.5, 0.9 or 0.99. K references and one more run are drawn alike;
the references' bands come from cram.eval.seed_band.reference_bands, as the check makes them, and the run is judged
by them as it is (`Band.passes`), moved by 0 (a faithful run), 2, 3, 4 or 6 seed spreads at every step, or 6 at the
last step alone. Besides Gaussian seeds:
- heavy tails: each run's whole curve scaled by √(3/χ²₃) (multivariate t, 3 degrees of freedom: a seed that is off
  is off at every step), or each step's deviation scaled by a draw of its own (per-step t, 3 degrees of freedom);
- one outlying reference: the first reference moved by 5 seed spreads at every step, the others and our run Gaussian.

Each rate is given for the verdict (the leave-one-out screening included), for the band of every reference (no
screening) and for the band without the far reference wherever one is named (the verdict's with 8 references or
more; with fewer, what leaving it out would give), from the same trials, with its Monte Carlo standard error
√(p (1 − p) / trials). K = 10 is PolyPythias'
ten seeds of a size; K = 4 pythia-160m's matched set (the original and three weight seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SIMULATED_STEPS = 6
# Loss scales like the trained part's (pythia-14m at steps 0, 16, 64, 512, 576 and 640, docs/benchmarks.md): wide
# and high at the init, narrow late, a spread of its own at each step.
SIMULATED_LOSSES = (7.13, 6.18, 5.67, 4.32, 4.28, 4.27)
SIMULATED_SPREADS = (0.036, 0.014, 0.019, 0.010, 0.010, 0.010)
SIMULATED_CORRELATIONS = (0.5, 0.9, 0.99)
SIMULATED_DEPARTURES = (2.0, 3.0, 4.0, 6.0)  # seed spreads, at every step judged
SIMULATED_REFERENCES = (10, 4)  # PolyPythias' ten seeds of a size; pythia-160m's matched set (original + 3)
HEAVY_TAIL_DEGREES = 3
OUTLIER_SPREADS = 5.0
LAST_STEP_ONLY = "6 at the last step only"


@dataclass(frozen=True)
class Scenario:
    """How the seeds are drawn."""

    references: int
    correlation: float
    tails: str = "gaussian"  # gaussian, multivariate-t or per-step-t
    outlier: float = 0.0  # seed spreads the first reference is moved by at every step

    @property
    def name(self) -> str:
        what = {"gaussian": "Gaussian", "multivariate-t": f"multivariate t ({HEAVY_TAIL_DEGREES} df)",
                "per-step-t": f"per-step t ({HEAVY_TAIL_DEGREES} df)"}[self.tails]
        if self.outlier:
            what += f", one reference {self.outlier:g} spreads off"
        return f"K={self.references}, correlation {self.correlation:g}, {what}"


def departures(steps: int = SIMULATED_STEPS, sizes: tuple[float, ...] = SIMULATED_DEPARTURES) -> dict[str, np.ndarray]:
    """Our run's shift from a faithful run, in seed spreads at each step, by column name."""
    shifts = {"faithful": np.zeros(steps)} | {f"{size:g}": np.full(steps, size) for size in sizes}
    last = np.zeros(steps)
    last[-1] = 6.0
    return shifts | {LAST_STEP_ONLY: last}


def draw_runs(scenario: Scenario, generator: np.random.Generator) -> np.ndarray:
    """K references and one more run, [K + 1, m] mean losses in nats, the last row ours (before any departure)."""
    steps, runs = SIMULATED_STEPS, scenario.references + 1
    correlation = np.full((steps, steps), scenario.correlation) + np.eye(steps) * (1 - scenario.correlation)
    deviations = generator.standard_normal((runs, steps)) @ np.linalg.cholesky(correlation).T
    if scenario.tails == "multivariate-t":
        deviations *= np.sqrt(HEAVY_TAIL_DEGREES / generator.chisquare(HEAVY_TAIL_DEGREES, (runs, 1)))
    elif scenario.tails == "per-step-t":
        deviations *= np.sqrt(HEAVY_TAIL_DEGREES / generator.chisquare(HEAVY_TAIL_DEGREES, (runs, steps)))
    deviations[0] += scenario.outlier
    return np.array(SIMULATED_LOSSES) + deviations * np.array(SIMULATED_SPREADS)


def simulate(scenario: Scenario, trials: int, alpha: float = 0.05, seed: int = 0,
             shifts: dict[str, np.ndarray] | None = None) -> dict:
    """Fail rates over `trials` draws of `scenario`: per column of `shifts` (default: every departure), the verdict's
    and the band of every reference's, each with its Monte Carlo error; and how often a reference was left out."""
    from cram.eval.seed_band import reference_bands

    shifts = departures() if shifts is None else shifts
    moved = np.stack(list(shifts.values())) * np.array(SIMULATED_SPREADS)  # [columns, m], nats
    generator = np.random.default_rng(seed)
    verdict_fails, every_fails, without_fails = np.zeros(len(shifts)), np.zeros(len(shifts)), np.zeros(len(shifts))
    left_out = named = 0
    for _ in range(trials):
        runs = draw_runs(scenario, generator)
        bands = reference_bands(runs[:-1], alpha)
        ours = runs[-1] + moved
        verdict_fails += ~bands.verdict.passes(ours)
        every_fails += ~bands.every.passes(ours)
        without_fails += ~(bands.without_far or bands.verdict).passes(ours)
        left_out += bands.verdict.kept != bands.every.kept
        named += bands.without_far is not None

    def rate(fails: float) -> dict:
        share = fails / trials
        return {"rate": share, "error": math.sqrt(share * (1 - share) / trials)}

    return {"scenario": asdict(scenario), "name": scenario.name, "trials": trials,
            "named": rate(named), "left_out": rate(left_out),
            "columns": {name: {"verdict": rate(verdict), "every": rate(every), "without_far": rate(without)}
                        for name, verdict, every, without in zip(shifts, verdict_fails, every_fails, without_fails,
                                                                 strict=True)}}


def scenarios() -> list[tuple[Scenario, tuple[str, ...] | None]]:
    """Every scenario the benchmark simulates, with the columns it reports (None: all)."""
    chosen: list[tuple[Scenario, tuple[str, ...] | None]] = []
    for references in SIMULATED_REFERENCES:
        for correlation in SIMULATED_CORRELATIONS:
            chosen.append((Scenario(references, correlation), None))
        for correlation in SIMULATED_CORRELATIONS:
            for tails in ("multivariate-t", "per-step-t"):
                chosen.append((Scenario(references, correlation, tails), ("faithful", "4")))
            chosen.append((Scenario(references, correlation, outlier=OUTLIER_SPREADS), ("faithful", "4")))
    return chosen


def simulated_rates(trials: int, alpha: float = 0.05) -> list[dict]:
    """Every scenario's rates, each from its own seeded draws (a rerun gives the same figures)."""
    results = []
    every_shift = departures()
    for seed, (scenario, columns) in enumerate(scenarios()):
        shifts = every_shift if columns is None else {name: every_shift[name] for name in columns}
        started = time.perf_counter()
        result = simulate(scenario, trials, alpha, seed=seed, shifts=shifts)
        result["seconds"] = time.perf_counter() - started
        print(format_result(result), flush=True)
        results.append(result)
    return results


def format_result(result: dict) -> str:
    """One line: each column's fail rate, the verdict's ± its error, and in brackets every reference's band's and the
    band's without the far reference."""
    cells = "; ".join(f"{name}: {cell['verdict']['rate']:.3f} ± {cell['verdict']['error']:.3f} "
                      f"[{cell['every']['rate']:.3f}, {cell['without_far']['rate']:.3f}]"
                      for name, cell in result["columns"].items())
    return (f"{result['name']} ({result['trials']} trials, a reference named far in {result['named']['rate']:.3f}, "
            f"left out in {result['left_out']['rate']:.3f}, {result['seconds']:.0f} s): {cells}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=2000, help="draws of each scenario")
    parser.add_argument("--output", type=Path, default=Path("runs/bench-replication/simulated.json"),
                        help="where the figures go (JSON)")
    args = parser.parse_args(argv)
    print(f"simulated: fail rate of a faithful run and of one departing by this many seed spreads, the verdict's ± "
          f"its Monte Carlo error [the band of every reference's, the band's without a far one], {SIMULATED_STEPS} "
          "steps, alpha 0.05")
    results = simulated_rates(args.trials)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
