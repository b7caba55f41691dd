"""From the sweep's rows to the plan: the leaders timed again side by side, the pick and its ties, the winner's
config pair and command, the days and cost said, the projection to other hardware and the verification run."""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from pathlib import Path

from cram.errors import UserError
from cram.plan.cost import SECONDS_PER_DAY, parse_target, project
from cram.plan.emit import launch_command, recipe_flags, write_atomically, write_pair
from cram.plan.launch import clear_launch_files, launch_probe
from cram.plan.models import CRAMMED_BERT_PRESETS, is_causal
from cram.plan.peak_memory import Shape
from cram.plan.rank import leading_candidates, time_side_by_side
from cram.plan.report import write_reports
from cram.plan.setting import Setting, probe_request
from cram.plan.space import Candidate
from cram.plan.sweep_length import LAUNCH_START_SECONDS, LaunchLimits
from cram.slurm import job_script, notice_seconds, requeued_jobs, slurm_time, time_limit_seconds

# What `days` does not include yet: labelled in the table and the printed estimate.
# The job's host memory over the peak the sweep measured: room for what its timed steps did not reach.
HOST_MEMORY_MARGIN = 1.25
LEFT_OUT_OF_DAYS = (
    "reading the run's own data: the probe reads the embedded corpus, prepared on disk (memory-mapped), with the "
    "run's loader workers; a Pythia run reads its --data, crammed-bert's default streams pile-readymade from the Hub",
    "the final model's export after the last step",
    "crammed BERT's ramp: a step of a micro-batches is taken as a × the final batch's time per micro-batch (the "
    "optimizer step's fixed cost weighs more in the ramp's small steps, so they are counted a little too many)",
)


def timing_request(setting: Setting, candidate: Candidate, row: dict, timed_steps: int, max_timed_steps: int,
                   spread_bound: float, result_file: Path) -> dict:
    """A probe that times `candidate` at the micro-batch `row` measured for it, without searching again."""
    return probe_request(setting, candidate, result_file, mode="time", memory_limit_bytes=row["memory_limit_bytes"],
                         micro_batch=row["micro_batch"], timed_steps=timed_steps, max_timed_steps=max_timed_steps,
                         spread_bound=spread_bound)


def time_leaders_again(rows: list[dict], candidates: list[Candidate], setting: Setting, rounds: int, work_dir: Path,
                       layer_class: str, shape: Shape, limits: LaunchLimits,
                       estimate: Callable[[list[dict]], list[dict]]) -> list[dict]:
    """The rows after the leaders' side-by-side timing (`cram.plan.rank.time_side_by_side`), estimated again: the
    pick comes from measurements of one sitting, not from timings taken under different loads."""
    leaders = leading_candidates(rows)
    if not leaders:
        return rows
    by_name = {candidate.name: candidate for candidate in candidates}
    folder = work_dir / "side-by-side"

    def time_again(row: dict) -> dict:
        candidate = by_name[row["candidate"]]
        accelerate_file = write_pair(candidate, folder / "pairs", setting.num_processes, setting.use_cpu, layer_class,
                                     shape.hidden, shape.zero_init)
        result_file = folder / f"{candidate.name}.json"
        clear_launch_files(result_file)
        request = timing_request(setting, candidate, row, setting.timed_steps, setting.timed_steps, 0.0, result_file)
        timeout = limits.timing_limit(row, setting.warmup_steps + setting.timed_steps)
        return launch_probe(accelerate_file, request, folder / f"{candidate.name}.request.json", timeout)

    time_side_by_side(leaders, rounds, time_again)
    return estimate(rows)


def pick(rows: list[dict], candidates: list[Candidate], plan: dict, work_dir: Path) -> tuple[dict, Candidate]:
    """The ranked first row that ran, and its candidate; with none, the reports are written and the reason said."""
    winner = next((row for row in rows if row["status"] == "ok"), None)
    if winner is None:
        write_reports(plan, work_dir)
        failed = [row["candidate"] for row in rows if row["status"] == "error"]
        if failed:
            raise UserError(f"no candidate ran, and {', '.join(failed)} failed with an error that is not out of "
                            f"memory: see {work_dir / 'plan.md'} for each cause, fix it, then plan again with "
                            "--retry-failed.")
        raise UserError(f"no candidate fits: see {work_dir / 'plan.md'} for each reason, then give more memory "
                        "(--memory-limit), more devices, or a shorter --seq-len.")
    return winner, next(candidate for candidate in candidates if candidate.name == winner["candidate"])


def recipe_command_parts(model: str) -> tuple[str, list[str]]:
    """The recipe script that trains `model` and the flags that name it."""
    if model in CRAMMED_BERT_PRESETS:
        return "recipes/cram.py", [f"--preset {CRAMMED_BERT_PRESETS[model]}"]
    return "recipes/pythia.py", [f"--size {model}", "--data DATA"]  # DATA: the user's, e.g. the Pile's prefix


def emit_winner(winner: dict, winning: Candidate, setting: Setting, shape: Shape, layer_class: str, work_dir: Path,
                extra_flags: list[str]) -> tuple[Path, str, list[str]]:
    """The winner's Accelerate (and DeepSpeed) config pair in `work_dir`, the command that runs the recipe with it at
    the measured micro-batch, and that command's recipe script and arguments."""
    accelerate_file = write_pair(winning, work_dir, setting.num_processes, setting.use_cpu, layer_class,
                                 shape.hidden, shape.zero_init)
    script, model_flags = recipe_command_parts(setting.model)
    flags = recipe_flags(winning, winner["micro_batch"], setting.global_batch_size, is_causal(setting.model))
    command = launch_command(accelerate_file, script, model_flags, flags + extra_flags)
    return accelerate_file, command, [script, *shlex.split(" ".join(model_flags + flags + extra_flags))]


def job_memory(winner: dict) -> str | None:
    """The host memory a node of the pick's job asks for (sbatch --mem): its measured peak with a margin for what the
    timed steps did not reach (the data loader's workers, a larger state to resume), in whole GiB."""
    peak = winner.get("host_peak_bytes_per_node")
    return None if not peak else f"{math.ceil(peak * HOST_MEMORY_MARGIN / 2**30)}G"


def emit_job_script(winner: dict, accelerate_file: Path, recipe_words: list[str], run_dir: str, work_dir: Path,
                    time_limit: str) -> dict:
    """The Slurm batch script that runs the pick in `run_dir` (`work_dir/slurm-job.sh`): its notice before the time
    limit sized from the pick's measured training-state save, and its time limit from the predicted length, split
    into requeued jobs where the run is longer than `time_limit` (the longest the user's cluster allows)."""
    micro_batch_seconds = winner["step_time"]["median"] / winner["accumulation"]
    grace, notice = notice_seconds(winner["save_seconds"], micro_batch_seconds,
                                   "the pick's training-state save, measured by the sweep")
    # A start pays the launch and reading the state back, which takes about as long as writing it.
    start_seconds = LAUNCH_START_SECONDS + winner["save_seconds"]
    limit, jobs = requeued_jobs(winner["days"] * SECONDS_PER_DAY, time_limit_seconds(time_limit), grace,
                                start_seconds)
    recipe, *arguments = recipe_words
    text = job_script(recipe, [*arguments, "--output-dir", run_dir], str(accelerate_file),
                      time_limit=slurm_time(limit), grace=grace, grace_reason=notice, memory=job_memory(winner))
    script = work_dir / "slurm-job.sh"
    write_atomically(script, text)
    return {"script": str(script), "time_limit": slurm_time(limit), "jobs": jobs, "grace_seconds": grace,
            "start_seconds": start_seconds, "cluster_time_limit": time_limit}


def describe_saves(row: dict) -> str:
    if row["saves"] == 0:
        return "no training-state saves"
    revisions = row.get("revisions", 0)
    states = f"{row['saves'] - revisions} training-state saves of {row['save_seconds']:.2f} s"
    if revisions:
        states += f" and {revisions} revisions of the model of {row['revision_seconds']:.2f} s"
    return f"{states} ({row['save_days'] * 24:.2f} h)"


def say_pick(winner: dict, rows: list[dict], price_per_gpu_hour: float | None, work_dir: Path, say=print) -> None:
    """The pick with its days and cost, what the days leave out, the ties and the candidates that failed."""
    say(f"picked: {winner['candidate']}, {winner['step_time']['median']:.3f} s per step "
        f"± {winner['step_time']['spread']:.1%}, {describe_saves(winner)} -> {winner['days']:.2f} days"
        + (f" ({winner['steps_in_budget']:,} steps in the budget, the batch ramp integrated)"
           if "steps_in_budget" in winner else "")
        + (f", ${winner['cost_usd']:,.0f} amortised" if winner.get("cost_usd") is not None else
           " (no price: this hardware is not in the price table)")
        + (f", ${winner['cloud_cost_usd']:,.0f} at ${price_per_gpu_hour:g} per GPU-hour"
           if winner.get("cloud_cost_usd") is not None else ""))
    say(f"days leave out: {'; '.join(LEFT_OUT_OF_DAYS)}")
    tied = [row["candidate"] for row in rows if row.get("tie") and row is not winner]
    if tied:
        say(f"a tie: {', '.join(tied)} time within the noise of {winner['candidate']}, timed side by side (their "
            f"median ± half the interquartile range overlap); picked the lower median")
    failed = [row for row in rows if row["status"] == "error"]
    if failed:
        say(f"failed, not out of memory (see {work_dir / 'plan.md'}): "
            + "; ".join(f"{row['candidate']}: {row['reason']}" for row in failed))


def report_projection(target: str, winner: dict, steps: int | None, device: str) -> dict:
    count, gpu = parse_target(target)
    tokens_per_step = winner["tokens_per_second"] * winner["step_time"]["median"]
    projection = project(winner["mfu"], tokens_per_step, winner["flops_per_token"], steps, count, gpu, device)
    assumptions = [*projection.assumptions, "the training-state saves are left out of the projected days (a "
                   "save's time depends on the target's storage, which nothing here measures)"]
    print(f"\nPROJECTION (not measured) to {count} × {gpu.key}: {projection.step_seconds:.3f} s per step"
          + (f", {projection.days:.2f} days" if projection.days is not None else "")
          + (f", ${projection.cost_usd:,.0f} amortised" if projection.cost_usd is not None else "")
          + "\nassuming:\n" + "\n".join(f"  - {line}" for line in assumptions))
    return {"target": target, "label": "projection", "step_seconds": projection.step_seconds,
            "days": projection.days, "cost_usd": projection.cost_usd, "assumptions": assumptions}


def verify(winner: dict, winning: Candidate, setting: Setting, verify_steps: int, accelerate_file: Path,
           work_dir: Path, limits: LaunchLimits) -> dict:
    """Launch the emitted pair again for `verify_steps` steps at the winner's micro-batch: predicted against
    observed."""
    result_file = work_dir / "verify" / "result.json"
    clear_launch_files(result_file)
    most_steps = max(setting.max_timed_steps or 0, verify_steps)
    request = timing_request(setting, winning, winner, verify_steps, most_steps, setting.spread_bound, result_file)
    timeout = limits.timing_limit(winner, setting.warmup_steps + most_steps)
    result = launch_probe(accelerate_file, request, work_dir / "verify" / "request.json", timeout)
    if result["status"] != "ok":
        raise UserError(f"the --verify run of {winning.name} failed ({result['reason']}): see "
                        f"{result_file.with_suffix('.log')}.")
    predicted, observed = winner["step_time"]["median"], result["step_time"]["median"]
    error = (predicted - observed) / observed
    print(f"\nverify: {winning.name}, {verify_steps} steps: predicted {predicted:.4f} s per step, observed "
          f"{observed:.4f} s ± {result['step_time']['spread']:.1%}: error {error:+.1%}")
    return {"predicted_seconds": predicted, "observed_seconds": observed, "error": error,
            "observed": result["step_time"]}
