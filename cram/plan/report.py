"""The plan as a markdown table, a JSON file and a chart (PNG), each written under a temporary name first."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cram.plan.emit import write_atomically


def _number(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def tie_note(rank: int, row: dict) -> str:
    if not row.get("tie"):
        return ""
    return ", tie: picked, lower median" if rank == 1 else ", tie with #1 (within the noise)"


def source_note(row: dict) -> str:
    source = row["source"]
    if source == "cache" and row.get("measured_at"):
        source = f"cache, measured {row['measured_at']}"
    return source + (", timed side by side" if row.get("paired") else "")


def failure_note(row: dict) -> str:
    """A row without a step time: infeasible (does not fit, or ruled out) or failed with another error, and for a
    failure from the cache, from when and how to measure it again."""
    what = "infeasible" if row["status"] == "infeasible" else "failed, not out of memory"
    cached = (f" (cached, measured {row.get('measured_at', 'in an earlier sweep')}: add --retry-failed to "
              "measure it again)" if row.get("source") == "cache" else "")
    return f"{what}: {row['reason']}{cached}"


def saves_note(row: dict) -> str:
    """The run's saves: training states × one save's seconds, and the revisions × theirs."""
    revisions = row.get("revisions", 0)
    note = f"{row['saves'] - revisions} × {row['save_seconds']:.2f}"
    return note + (f" + {revisions} revisions × {row['revision_seconds']:.2f}" if revisions else "")


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| # | candidate | micro-batch × accum. | step time (s) | tokens/s | MFU | peak memory (GiB) "
        "| saves × one save (s) | days | cost ($) | cloud ($) | analytic days | measured ÷ analytic | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, row in enumerate(rows, 1):
        if row["status"] != "ok":
            lines.append(f"| – | {row['candidate']} | | | | | | | | | | | | {failure_note(row)} |")
            continue
        time = row["step_time"]
        lines.append(
            f"| {rank} | {row['candidate']} | {row['micro_batch']} × {row['accumulation']} "
            f"| {time['median']:.3f} ± {time['spread']:.1%} | {row['tokens_per_second']:,.0f} "
            f"| {_number(row.get('mfu'), '.1%')} | {row['peak_memory_bytes'] / 2**30:.2f} "
            f"| {saves_note(row)} | {row['days']:.2f} "
            f"| {_number(row.get('cost_usd'), ',.0f')} "
            f"| {_number(row.get('cloud_cost_usd'), ',.0f')} "
            f"| {_number(row.get('analytic_days'), '.2f')} | {_number(row.get('measured_over_analytic'), '.2f')} "
            f"| {source_note(row)}{tie_note(rank, row)} |"
        )
    return "\n".join(lines) + "\n"


def write_chart(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["candidate"] for row in rows]
    seconds = [row["step_time"]["median"] if row["status"] == "ok" else 0.0 for row in rows]
    errors = [row["step_time"]["median"] * row["step_time"]["spread"] if row["status"] == "ok" else 0.0
              for row in rows]
    figure, axes = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    positions = range(len(rows))
    colours = ["tab:orange" if row.get("tie") else "tab:blue" if s else "lightgrey"
               for row, s in zip(rows, seconds, strict=True)]
    axes.barh(positions, seconds, xerr=errors, color=colours)
    for position, row in zip(positions, rows, strict=True):
        if row["status"] != "ok":
            label = "  infeasible" if row["status"] == "infeasible" else "  failed (not out of memory)"
            axes.text(0, position, label, va="center", fontsize=8, color="dimgrey")
        elif row.get("tie"):
            label = "  tie: picked (lower median)" if position == 0 else "  tie (within the noise)"
            axes.text(0, position, label, va="center", fontsize=8, color="black")
    axes.set_yticks(list(positions), names, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("optimizer step time (s), median ± half the interquartile range")
    axes.set_title(title, fontsize=10)
    figure.tight_layout()
    partial = path.with_name(path.stem + ".partial.png")
    figure.savefig(partial, dpi=100)
    plt.close(figure)
    os.replace(partial, path)


def write_reports(plan: dict, output_dir: Path) -> None:
    write_atomically(output_dir / "plan.json", json.dumps(plan, indent=2) + "\n")
    left_out = "".join(f"- {item}\n" for item in plan.get("left_out_of_days", []))
    write_atomically(output_dir / "plan.md", f"# {plan['title']}\n\n{markdown_table(plan['rows'])}"
                     + (f"\nLeft out of the days:\n{left_out}" if left_out else ""))
    write_chart(plan["rows"], output_dir / "plan.png", plan["title"])
