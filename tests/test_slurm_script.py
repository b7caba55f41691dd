"""What `python -m cram.slurm` writes, in this process (tests/test_slurm.py runs the scripts under a real Slurm): the
layout from the launch config, the notice sized from a run's measured state writes, the refusals, and the
Makefile's SLURM=1 form."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launching import REPO, run

from cram import slurm
from cram.errors import UserError
from cram.train.checkpoint import STATE_FILE, WRITE_SECONDS


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_the_script_asks_for_a_task_per_process_with_its_cpus_and_requeues_with_resume_auto(tmp_path):
    run_dir = tmp_path / "run"
    script = slurm.job_script("recipes/pythia.py", ["--size", "pythia-1b", "--output-dir", str(run_dir)],
                              "accel_configs/2node.yaml", time_limit="48:00:00", grace=300, memory="200G",
                              setup=["module load cuda/12.4", "source ~/venv/bin/activate"], python="python")
    asked = directives(script)
    for directive in ("--nodes=2", "--ntasks-per-node=8", "--cpus-per-task=4", "--gpus-per-node=8", "--mem=200G",
                      "--time=48:00:00", "--requeue", "--signal=USR1@300", "--dependency=singleton",
                      f"--job-name={slurm.job_name(run_dir)}", f"--output={run_dir}/slurm-%j.out"):
        assert directive in asked, asked
    # One task per process, each its rank through cram.slurm_rank: no launcher, no agent between Slurm and the rank.
    assert "srun --nodes=2 --ntasks-per-node=8 --cpus-per-task=4" in script and "accelerate launch" not in script
    assert "PYTHON=python\n" in script and '"$PYTHON" -m cram.slurm_rank --config_file accel_configs/2node.yaml' \
        in script
    assert "--output-dir " + str(run_dir) + " --resume auto 9>&- &" in script
    assert "module load cuda/12.4\nsource ~/venv/bin/activate\n" in script
    assert script.index("module load") < script.index("srun ")
    assert "MAIN_PORT=$(( 12000 + SLURM_JOB_ID % 20000 ))" in script and "getent ahostsv4" in script
    one_gpu = directives(slurm.job_script("recipes/cram.py", ["--output-dir", "runs/x", "--num-workers", "6"],
                                          "accel_configs/4xa100.yaml", time_limit=None, grace=90))
    assert {"--nodes=1", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=8"} <= set(one_gpu)
    assert not any(d.startswith(("--time", "--mem")) for d in one_gpu)
    cpu = directives(slurm.job_script("recipes/cram.py", ["--output-dir", "runs/x"], "accel_configs/cpu-ddp.yaml",
                                      time_limit=None, grace=90))
    assert "--exclusive" in cpu and not any("gpus" in directive or "cpus" in directive for directive in cpu)
    assert directives(slurm.job_script("recipes/cram.py", ["--output-dir", "runs/x"], "accel_configs/cpu-ddp.yaml",
                                       time_limit=None, grace=90, cpus=3))[3] == "--cpus-per-task=3"
    given = directives(slurm.job_script("recipes/cram.py", ["--output-dir", "runs/x"], "accel_configs/1gpu.yaml",
                                        time_limit=None, grace=90, sbatch_options=["--dependency=afterok:7"]))
    assert "--dependency=afterok:7,singleton" in given and given.count("--dependency=afterok:7,singleton") == 1


def test_paths_with_spaces_and_percent_signs_reach_sbatch_and_the_shell_whole(tmp_path):
    run_dir = tmp_path / "my run 50%"
    script = slurm.job_script("recipes/cram.py", ["--output-dir", str(run_dir)], "accel_configs/1gpu.yaml",
                              time_limit=None, grace=90, workdir=tmp_path / "work dir")
    asked = directives(script)
    assert f'--output="{tmp_path}/my run 50%%/slurm-%j.out"' in asked, asked
    assert f'--chdir="{tmp_path}/work dir"' in asked
    assert f"RUN='{run_dir}'" in script
    assert slurm.job_name(run_dir).startswith("cram-my-run-50-") and " " not in slurm.job_name(run_dir)
    # Two run folders of one name are two jobs' names: singleton holds back only a job of the same run.
    assert slurm.job_name(tmp_path / "a" / "run") != slurm.job_name(tmp_path / "b" / "run")


def write_state(run_dir: Path, step: int, write_seconds: float, seconds_per_micro_batch: float) -> None:
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    state = {"optimizer_steps": step, "elapsed": 100.0,
             "history": [{"step": step, "seconds_per_micro_batch": seconds_per_micro_batch}]}
    (folder / STATE_FILE).write_text(json.dumps({"state": state, "run": {}, WRITE_SECONDS: write_seconds}))


def test_the_notice_is_sized_from_the_runs_slowest_measured_state_write(tmp_path):
    seconds, reason = slurm.grace_seconds(tmp_path)
    assert seconds == math.ceil(2 * slurm.UNMEASURED_WRITE_BOUND_SECONDS + slurm.GRACE_MARGIN_SECONDS)
    assert "a stated bound" in reason
    assert slurm.grace_seconds(tmp_path, write_bound=40)[0] == 2 * 40 + slurm.GRACE_MARGIN_SECONDS
    assert slurm.measured_grace_seconds(tmp_path) is None
    write_state(tmp_path, 10, write_seconds=31.5, seconds_per_micro_batch=2.0)
    write_state(tmp_path, 20, write_seconds=12.25, seconds_per_micro_batch=2.5)
    seconds, reason = slurm.grace_seconds(tmp_path, write_bound=40)
    assert seconds == math.ceil(2 * 31.5 + 2.5 + slurm.GRACE_MARGIN_SECONDS)
    assert "31.5 s (the slowest measured" in reason
    assert slurm.measured_grace_seconds(tmp_path) == seconds  # what each start of the job sizes its notice from


def test_the_writer_refuses_in_one_sentence(tmp_path):
    refusals = {
        "no --output-dir": lambda: slurm.job_script("recipes/cram.py", ["--preset", "tiny"], "accel_configs/cpu.yaml",
                                                    time_limit=None, grace=90),
        "--resume none": lambda: slurm.job_script("recipes/cram.py", ["--output-dir", "x", "--resume", "none"],
                                                  "accel_configs/cpu.yaml", time_limit=None, grace=90),
        "uneven": lambda: slurm.read_layout(_config(tmp_path, "num_machines: 2\nnum_processes: 3\n")),
        "time limit under the notice": lambda: slurm.job_script(
            "recipes/cram.py", ["--output-dir", "x"], "accel_configs/cpu.yaml", time_limit="5", grace=300),
        "bad time limit": lambda: slurm.time_limit_seconds("two days"),
        "no config": lambda: slurm.read_layout(tmp_path / "missing.yaml"),
    }
    for case, refuse in refusals.items():
        with pytest.raises(UserError) as refused:
            refuse()
        message = str(refused.value)
        assert message.count(": ") >= 1 and message.endswith("."), (case, message)
    assert slurm.time_limit_seconds("2-00:00:00") == 2 * 86400 and slurm.time_limit_seconds("90") == 5400
    assert slurm.time_limit_seconds("1:30:00") == 5400 and slurm.time_limit_seconds("10:30") == 630


def _config(folder: Path, text: str) -> Path:
    path = folder / "config.yaml"
    path.write_text(text)
    return path


def test_make_slurm_1_writes_and_submits_the_job_instead_of_launching(tmp_path):
    completed = run(["make", "--no-print-directory", "-n", "pythia-1b-4xa100", "DATA=pile/document", "SLURM=1",
                     "TIME_LIMIT=48:00:00", "SBATCH=--partition=gpu --account=lab", "VENV=/nonexistent-venv"],
                    cwd=REPO, timeout=60)
    command = ("/nonexistent-venv/bin/python -m cram.slurm --submit --config accel_configs/4xa100.yaml --time-limit "
               "48:00:00 --sbatch=--partition=gpu --sbatch=--account=lab recipes/pythia.py --size pythia-1b")
    assert completed.returncode == 0 and completed.stdout.count(command) == 2, completed.stdout  # printed, then run
    assert "accelerate launch" not in completed.stdout
    cram = run(["make", "--no-print-directory", "-n", "cram-1gpu", "SLURM=1", "VENV=/nonexistent-venv",
                "SLURM_OPTIONS=--memory 64G --setup 'module load cuda'"], cwd=REPO, timeout=60).stdout
    assert "-m cram.slurm --submit --config accel_configs/1gpu.yaml" in cram and "--output-dir runs/cram" in cram
    assert "--memory 64G --setup 'module load cuda' recipes/cram.py" in cram  # SLURM_OPTIONS: cram.slurm's own
    # What the target runs, without --submit: the script for one node of four GPUs.
    arguments = completed.stdout.splitlines()[-1].split("-m cram.slurm ")[1].split()
    arguments = [argument for argument in arguments if argument != "--submit"]
    arguments[arguments.index("runs/pythia-1b-4xa100")] = str(tmp_path / "run")
    slurm.main(arguments)
    asked = directives((tmp_path / "run" / "slurm-job.sh").read_text())
    assert {"--nodes=1", "--gpus-per-node=4", "--time=48:00:00", "--partition=gpu", "--account=lab"} <= set(asked)


def test_a_run_longer_than_the_clusters_limit_is_split_into_even_requeued_jobs():
    day = 86400
    # Ten days under a 48-hour limit: each job trains at most 48 h less its start and notice, so 6 jobs of 40 h.
    limit, jobs = slurm.requeued_jobs(10 * day, 2 * day, grace=200, start_seconds=100)
    assert jobs == math.ceil(10 * day / (2 * day - 300)) == 6
    assert limit == math.ceil(10 * day / 6 + 300) <= 2 * day
    # A run shorter than the limit asks for what it needs, not for the cluster's longest.
    assert slurm.requeued_jobs(3600, 2 * day, grace=200, start_seconds=100) == (3900, 1)
    # At the edge: a run that fills one job's training time exactly takes one job, a second more takes two.
    assert slurm.requeued_jobs(day - 300, day, 200, 100) == (day, 1)
    assert slurm.requeued_jobs(day - 299, day, 200, 100)[1] == 2
    with pytest.raises(UserError, match=r"^a time limit of 0-00:05:00 leaves no time to train .* --time-limit\.$"):
        slurm.requeued_jobs(3600, 300, grace=250, start_seconds=100)
    assert slurm.slurm_time(2 * day) == "2-00:00:00" and slurm.slurm_time(90) == "0-00:02:00"
    assert slurm.time_limit_seconds(slurm.slurm_time(144301)) == 144360  # rounded up to the minute
