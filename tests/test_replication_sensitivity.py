"""The replication verdict on runs whose truth is known: cram/bench/replication_sensitivity.py's own parts at a small
scale, every command in this process. Five pythia-14m seeds and a run with GPT-NeoX's default init (a departure the
recipe has no flag for) trained by recipes/pythia.py; each seed is judged against the other four, and at most one of
the five fails, and the departure fails against seeds 1 … 4. The benchmark's figures at its own scale are in
docs/benchmarks.md."""

from __future__ import annotations

import json
import math

import pytest

from cram.bench.replication_sensitivity import (
    SIZE,
    Scale,
    check_command,
    check_outcome,
    corpus_split,
    departures,
    false_fail_rate,
    recipe_command,
    run_command,
    write_data,
)
from cram.models.pythia_model import PYTHIA_SIZES, SMALL_AND_WANG

# 8 steps of 8 × 32 tokens, judged at the init and at the end: the init departure shows at step 0, and the seeds'
# spread there and after training is what a faithful seed is judged by.
SCALE = Scale(train_documents=300, heldout_documents=40, tokenizer_vocab=1000, seq_len=32, global_batch_size=8,
              max_steps=8, steps=(0, 8), heldout_sequences=64)
SEEDS = 5


@pytest.mark.slow
def test_faithful_seeds_pass_against_each_other_and_gpt_neox_default_init_fails(tmp_path):
    data = write_data(tmp_path / "data", SCALE, *corpus_split(SCALE.train_documents, SCALE.heldout_documents))
    neox_init = departures(SCALE)["neox-init"]
    # The departure from the fifth seed's init, which its references (seeds 1 … 4) do not share.
    runs = {f"seed{seed}": (seed, None) for seed in range(1, SEEDS + 1)} | {neox_init.name: (SEEDS, neox_init)}
    for name, (seed, departure) in runs.items():
        log = tmp_path / "logs" / f"train-{name}.log"
        status = run_command(recipe_command(data, SCALE, seed, tmp_path / "runs" / name, departure), log, departure)
        assert status == 0, log.read_text()[-3000:]
    assert PYTHIA_SIZES[SIZE].init == SMALL_AND_WANG  # the departure's change did not outlive its run

    def check(name: str, references: list[int]) -> dict:
        output, log = tmp_path / "checks" / name, tmp_path / "logs" / f"check-{name}.log"
        command = check_command(tmp_path / "runs" / name, [tmp_path / "runs" / f"seed{seed}" for seed in references],
                                data, SCALE, output)
        return check_outcome(run_command(command, log), output, log)

    # Each seed against the other four, as the bench's leave-one-out table: one draw of a faithful seed fails with
    # probability up to alpha, and more where the seeds' losses are not Gaussian, as at the init, where they are
    # skewed (docs/benchmarks.md, Replication verdict: sensitivity); so one faithful seed may fail here, not two.
    seeds = range(1, SEEDS + 1)
    leave_one_out = {f"seed{seed}": check(f"seed{seed}", [other for other in seeds if other != seed])
                     for seed in seeds}
    assert all(outcome["status"] in (0, 1) for outcome in leave_one_out.values()), leave_one_out
    assert false_fail_rate(leave_one_out) <= 1 / SEEDS, leave_one_out
    outcomes = {neox_init.name: check(neox_init.name, list(range(1, SEEDS)))}

    departed = outcomes[neox_init.name]
    assert departed["status"] == 1 and departed["first_failed_step"] == 0, departed
    assert departed["z"][0] < -departed["critical"]  # GPT-NeoX's smaller init starts nearer the uniform loss
    # The departure is the init alone: attention.dense drawn at scaled_normal, 0.02 / √(2L), where the seeds drew
    # wang_init, 2 / (L √d) (cram.models.pythia_model.init_stds).
    init = json.loads((tmp_path / "checks" / neox_init.name / "replication.json").read_text())["init_std"]
    layers, width = 6, 128
    assert init["ours"]["attention.dense"] == pytest.approx(0.02 / math.sqrt(2 * layers), rel=0.05)
    assert init["reference"]["attention.dense"] == pytest.approx(2 / (layers * math.sqrt(width)), rel=0.05)
