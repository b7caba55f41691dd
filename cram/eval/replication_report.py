"""The replication check's report: the table (replication.md), the figures (replication.json) and the losses by step
(replication.png), each written whole and then renamed."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_report(result: dict, output: Path) -> None:
    """replication.json, replication.md and replication.png in `output`, each written whole, then renamed."""
    output.mkdir(parents=True, exist_ok=True)
    several = len(result["references"]) > 1
    heldout = result["heldout"]
    lines = [f"# Replication: {result['run']}", "",
             f"References: {', '.join(result['references'])}; the references run with the activation they trained "
             f"with ({result['reference_activation']}). Scored in {result['precision']} on {result['device']}: "
             f"{heldout['sequences']:,} held-out sequences of {heldout['tokens_per_sequence']} tokens from "
             f"{heldout['path']} (fingerprint {heldout['fingerprint']}). Bounds: {result['bounds']}."]
    if result.get("reference_set"):
        lines += ["", f"Judged by {result['reference_set']}."]
    lines += ["", "| step | ours | references: mean (spread) | scoring error | z | bounds | smallest departure caught "
                  f"| verdict | next batch: ours, {result['references'][0]} |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        references = (f"{row['mean']:.4f} ({row['spread']:.4f})" if several else f"{row['references'][0]:.4f}")
        z = f"{row['z']:+.2f}" if several else "—"
        next_batch = row["next_batch"]
        nearby = (f"{next_batch['ours']:.4f}, {next_batch['reference']:.4f} (sequences [{next_batch['first_sequence']}"
                  f", {next_batch['first_sequence'] + next_batch['sequences']}))" if next_batch else "past the data")
        error = "—" if row["scoring_error"] is None else f"{row['scoring_error']:.4f}"
        caught = f"{row['detectable']:.4f} nats" + (f" ({row['detectable_spreads']:.1f} spreads)"
                                                    if row["detectable_spreads"] is not None else "")
        lines.append(f"| {row['step']} | {row['ours']:.4f} | {references} | {error} | {z} | "
                     f"{row['low']:.4f} … {row['high']:.4f} | {caught} | {'pass' if row['passed'] else 'FAIL'} | "
                     f"{nearby} |")
    lines += _references_read(result)
    if result.get("skipped_steps"):
        lines += ["", f"Steps of our run not judged (--steps names those to judge; each reference must have them): "
                      f"{', '.join(map(str, result['skipped_steps']))}."]
    if "init_std" in result:
        lines += ["", "| weight type | our step-0 std | reference step-0 std |", "|---|---|---|"]
        ours, reference = result["init_std"]["ours"], result["init_std"]["reference"]
        lines += [f"| {kind} | {ours[kind]:.5f} | {reference.get(kind, float('nan')):.5f} |" for kind in ours]
    lines += ["", f"Power: {result['power']}.", "", result["verdict"]]
    _write(output / "replication.md", ("\n".join(lines) + "\n").encode())
    _write(output / "replication.json", (json.dumps(result, indent=2) + "\n").encode())

    import matplotlib  # imported here: seconds to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    steps = [row["step"] for row in result["rows"]]
    axis.fill_between(steps, [row["low"] for row in result["rows"]], [row["high"] for row in result["rows"]],
                      alpha=0.2, label="bounds")
    for index in range(len(result["references"])):
        axis.plot(steps, [row["references"][index] for row in result["rows"]], color="grey", alpha=0.6,
                  label="references" if index == 0 else None)
    axis.plot(steps, [row["ours"] for row in result["rows"]], marker="o", color="C1", label="ours")
    axis.set_xlabel("step")
    axis.set_ylabel("held-out loss")
    axis.set_title("pass" if result["passed"] else f"FAIL at step {result['first_failed_step']}")
    axis.legend()
    axis.grid(alpha=0.3)
    staging = output / f".replication.png.{os.getpid()}.tmp"
    try:
        figure.savefig(staging, format="png", dpi=80)
        os.replace(staging, output / "replication.png")
    finally:
        plt.close(figure)
        staging.unlink(missing_ok=True)


def _references_read(result: dict) -> list[str]:
    """The references by what they hold (the digest of their weights at each step read, what they recorded), those
    left out and why, and the leave-one-out screening."""
    records = result.get("references_read")
    lines = []
    if records:
        lines += ["", "| reference | recorded seed | weights read (step: digest) | verdict uses it |",
                  "|---|---|---|---|"]
        for record in records:
            weights = ", ".join(f"{step}: {digest}" for step, digest in record["weights"].items())
            if record["digests_from_cache"]:
                weights += f" (steps {', '.join(map(str, record['digests_from_cache']))} from the digest cache)"
            use = f"no: {record['left_out']}" if record["left_out"] else "yes"
            if record["note"]:
                use += f"; it {record['note']}"
            seed = "—" if record["seed"] is None else str(record["seed"])
            lines.append(f"| {record['location']} | {seed} | {weights} | {use} |")
    screening = result.get("screening")
    if screening:
        largest = ", ".join(f"{location} {value:.2f}" for location, value in screening["largest_z"].items())
        lines += ["", f"Leave-one-out screening (each reference's largest |z| against the others; "
                      f"{screening['bound']:.2f} bounds the farthest of {len(screening['largest_z'])} faithful "
                      f"references with probability 1 − alpha): {largest}."]
    return lines


def _write(path: Path, content: bytes) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_bytes(content)
    staging.replace(path)
