"""The planner end to end on 2 CPU processes under DeepSpeed: one small sweep (two measured candidates, one FSDP
candidate the CPU cannot run) and --verify, shared by the tests; its emitted pair launching the recipe; and the cache
continuing a sweep that lost a result. Nothing here reads the clock's figures: the ranking and the leaders' side-by-side
timing are unit-tested (tests/test_plan_rank.py; --verify launches the same timing request as a side-by-side round)
and the prediction's accuracy is `make bench-plan`'s to measure."""

from __future__ import annotations

import json
import math
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from launching import ACCELERATE, accelerate_launch, run

from cram.plan.days import ramp_steps, saves_in_budget, training_seconds_in_budget
from cram.plan.launch import free_port
from cram.plan.pick import HOST_MEMORY_MARGIN
from cram.plan.sweep_length import LAUNCH_START_SECONDS
from cram.slurm import requeued_jobs, slurm_time, time_limit_seconds

REPO = Path(__file__).resolve().parents[1]
# Two processes, 8 sequences each per micro-step at most: the 2 GiB limit is not the binding one here.
SWEEP = ["--model", "crammed-bert-tiny", "--memory-limit", "2GiB", "--global-batch-size", "16",
         "--candidates", "zero1,zero2-offload,fsdp-full", "--warmup-steps", "1", "--timed-steps", "4",
         "--max-timed-steps", "4", "--paired-rounds", "0"]


def launch_plan(output_dir: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    command = [*accelerate_launch(REPO / "accel_configs" / "cpu-ddp.yaml"),
               REPO / "recipes" / "plan.py", *SWEEP, "--output-dir", output_dir, *extra]
    return run(command, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def swept(tmp_path_factory, recipe_env) -> tuple[Path, subprocess.CompletedProcess]:
    output_dir = tmp_path_factory.mktemp("plan") / "out"
    completed = launch_plan(output_dir, recipe_env, "--verify", "--verify-steps", "4", "--time-limit", "0-02:00:00",
                            "--run-dir", "runs/planned")
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return output_dir, completed


@pytest.mark.slow
def test_sweep_tables_candidates_fastest_first_with_infeasible_ones_and_their_reasons(swept):
    output_dir, completed = swept
    plan = json.loads((output_dir / "plan.json").read_text())
    rows = {row["candidate"]: row for row in plan["rows"]}
    assert [row["candidate"] for row in plan["rows"]][2] == "fsdp-full"
    run_seconds = [row["step_seconds_with_saves"] for row in plan["rows"][:2]]  # per step, saves included
    assert run_seconds == sorted(run_seconds)  # a tie goes to the lower median too (test_plan_rank.py)
    # The sweep's length, said before the first launch.
    assert completed.stdout.index("sweep: 2 candidate(s) to launch") < completed.stdout.index("measuring")
    assert rows["fsdp-full"]["status"] == "infeasible" and "FSDP needs GPUs" in rows["fsdp-full"]["reason"]
    for name in ("zero1", "zero2-offload"):
        row = rows[name]
        assert row["status"] == "ok" and row["source"] == "measured", row
        assert row["num_processes"] == 2 and row["distributed_type"] == "DistributedType.DEEPSPEED"
        assert row["micro_batch"] * row["accumulation"] * 2 == 16 and row["micro_batch"] == 8
        assert len(row["step_time"]["steps"]) == 4 and row["step_time"]["median"] > 0
        assert 0 < row["peak_memory_bytes"] <= 2 * 2**30
        assert row["probes"][-1]["fits"] and row["days"] == pytest.approx(1.0)  # crammed BERT: a 24-hour budget
        # One training-state save, measured through the engine's Checkpointer; one every 30 minutes of the budget.
        assert row["save_seconds"] > 0
        assert row["saves"] == saves_in_budget(24 * 3600, 30 * 60, row["save_seconds"]) >= 47
        # The ramp to the final batch of `accumulation` micro-batches, in what the saves leave of the budget.
        assert row["steps_in_budget"] == ramp_steps(
            training_seconds_in_budget(24 * 3600, 30 * 60, row["save_seconds"]),
            row["step_time"]["median"] / row["accumulation"], row["accumulation"], 0.6)
    table = (output_dir / "plan.md").read_text()
    assert "| fsdp-full |" in table and "infeasible: FSDP needs GPUs" in table
    assert f"| {rows['zero1']['saves']} × {rows['zero1']['save_seconds']:.2f} |" in table
    assert not any("checkpoint" in item or "ramp (only" in item for item in plan["left_out_of_days"])
    assert (output_dir / "plan.png").read_bytes().startswith(b"\x89PNG")
    assert "run it with:" in completed.stdout and plan["winner"]["command"] in completed.stdout


@pytest.mark.slow
def test_verify_reports_predicted_against_observed_step_time(swept):
    output_dir, completed = swept
    verify = json.loads((output_dir / "plan.json").read_text())["verify"]
    assert len(verify["observed"]["steps"]) == 4
    assert verify["error"] == pytest.approx(
        (verify["predicted_seconds"] - verify["observed_seconds"]) / verify["observed_seconds"])
    # How close the prediction is depends on the machine's load: `make bench-plan` measures it on a quiet one.
    assert "verify: " in completed.stdout and "error " in completed.stdout


@pytest.mark.slow
def test_the_emitted_config_pair_launches_the_recipe(swept, tmp_path, recipe_env):
    output_dir, _ = swept
    winner = json.loads((output_dir / "plan.json").read_text())["winner"]
    accelerate_file = Path(winner["accelerate_config"])
    assert accelerate_file.parent == output_dir / "accel_configs"
    assert (output_dir / "ds_configs" / f"plan-{winner['candidate']}.json").exists()
    command = shlex.split(winner["command"])
    assert command[:2] == ["accelerate", "launch"] and "recipes/cram.py" in command
    completed = run([ACCELERATE, "launch", "--main_process_port", str(free_port()), *command[2:], "--max-steps", "2",
         "--log-every", "1", "--output-dir", tmp_path / "run"],
                    cwd=REPO, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    resolved = json.loads((tmp_path / "run" / "final" / "cram_options.json").read_text())["resolved"]
    assert summary["optimizer_steps"] == 2 and summary["sequences"] == 2 * 16
    assert resolved["num_processes"] == 2 and resolved["distributed_type"] == "DistributedType.DEEPSPEED"


@pytest.mark.slow
def test_an_interrupted_sweep_continues_from_its_cache(swept, tmp_path, recipe_env):
    output_dir, _ = swept
    resumed = tmp_path / "out"
    shutil.copytree(output_dir, resumed)
    (cache,) = (resumed / "cache").iterdir()
    kept = (cache / "zero2-offload.json").read_text()
    (cache / "zero1.json").unlink()  # as if the sweep had stopped while measuring it
    completed = launch_plan(resumed, recipe_env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    rows = {row["candidate"]: row for row in json.loads((resumed / "plan.json").read_text())["rows"]}
    assert rows["zero2-offload"]["source"] == "cache" and (cache / "zero2-offload.json").read_text() == kept
    assert rows["zero1"]["source"] == "measured" and rows["zero1"]["status"] == "ok"
    assert "measuring zero1" in completed.stdout and "measuring zero2-offload" not in completed.stdout


@pytest.mark.slow
def test_the_pick_comes_with_a_slurm_job_script_split_under_the_clusters_time_limit(swept):
    output_dir, completed = swept
    plan = json.loads((output_dir / "plan.json").read_text())
    job, winner = plan["winner"]["slurm"], next(row for row in plan["rows"] if row["candidate"] == plan["winner"][
        "candidate"])
    # The notice from the pick's measured save; 24 hours of crammed BERT under a 2-hour limit, in even jobs.
    micro_batch = winner["step_time"]["median"] / winner["accumulation"]
    assert job["grace_seconds"] == math.ceil(2 * winner["save_seconds"] + micro_batch + 60)
    assert job["start_seconds"] == LAUNCH_START_SECONDS + winner["save_seconds"]
    limit, jobs = requeued_jobs(winner["days"] * 86400, 7200, job["grace_seconds"], job["start_seconds"])
    assert (job["time_limit"], job["jobs"]) == (slurm_time(limit), jobs) and jobs >= 13
    assert time_limit_seconds(job["time_limit"]) <= 7200
    script = Path(job["script"]).read_text()
    assert f"#SBATCH --time={job['time_limit']}" in script
    assert f"#SBATCH --signal=USR1@{job['grace_seconds']}" in script
    # The node's memory from the pick's measured host peak, with the margin.
    peak = winner["host_peak_bytes_per_node"]
    assert peak > 0 and f"#SBATCH --mem={math.ceil(peak * HOST_MEMORY_MARGIN / 2**30)}G" in script
    assert f"--config_file {plan['winner']['accelerate_config']}" in script
    assert "recipes/cram.py --preset tiny --micro-batch-size 8" in script
    assert "--output-dir runs/planned --resume auto 9>&- &" in script
    assert f"sbatch {job['script']}" in completed.stdout and f"{jobs} requeued job(s)" in completed.stdout
    assert run(["bash", "-n", job["script"]], timeout=60).returncode == 0
