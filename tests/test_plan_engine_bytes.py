"""The memory model against the bytes DeepSpeed's engines really hold, and at their peak in the reduction at the end
of backward and in the optimizer step: every ZeRO candidate (stages 1, 2, 3, with and without offload), built from
the planner's emitted launch pair on 2 CPU ranks, in bf16 and in fp32, in one launch (tests/plan_engine_bytes.py).
On the CPU device and host are one memory, so a row compares all a rank holds with all the model puts on one
process, device and host parts together. FSDP2's accumulation under no_sync, and its peak in the last
micro-batch's reduction, are measured in the same launch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from launching import accelerate_launch, run

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.10
pytestmark = pytest.mark.launch  # every test reads the one 2-rank launch


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    output = tmp_path_factory.mktemp("engine-bytes") / "rows.json"
    command = [*accelerate_launch(REPO / "accel_configs" / "cpu-zero1.yaml"),
               REPO / "tests" / "plan_engine_bytes.py", output]
    done = run(command, cwd=REPO, env=os.environ)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(output.read_text())


@pytest.fixture(scope="module")
def rows(measured) -> list[dict]:
    return measured["zero"]


def table(rows: list[dict]) -> str:
    lines = ["| candidate | precision | DeepSpeed optimizer | held: predicted MiB | measured MiB | off by "
             "| peak: predicted MiB | measured MiB | off by |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        cells = []
        for key in ("total", "peak"):
            predicted, measured = row["predicted"][key], row["measured"][key]
            cells.append(f"{predicted / 2**20:.2f} | {measured / 2**20:.2f} | {measured / predicted - 1:+.1%}")
        lines.append(f"| {row['candidate']} | {row['precision']} | {row['optimizer']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def test_every_zero_row_holds_what_the_memory_model_predicts(rows):
    print("\n" + table(rows))
    assert [(row["candidate"], row["precision"]) for row in rows] == [
        (f"zero{stage}{'-offload' if offload else ''}", precision)
        for precision in ("bf16", "no") for stage in (1, 2, 3) for offload in (False, True)]
    for row in rows:
        predicted, measured = row["predicted"], row["measured"]
        assert measured["total"] == pytest.approx(predicted["total"], rel=TOLERANCE), row["candidate"]
        # fp32 state (gradients, master copies, moments) is where the stage-1 rows differed: checked on its own.
        assert measured["32-bit"] == pytest.approx(predicted["32-bit"], rel=TOLERANCE), row["candidate"]


def test_every_zero_rows_peak_in_the_reduction_and_the_step_is_what_the_memory_model_predicts(rows):
    # The held state plus the transient buffers of the reduction at the end of backward (BF16_Optimizer's
    # flattened and cast buckets, the offloaded ZeRO-1 partition) or of the step (ZeRO-3's fp32 copy of the
    # gradient partition, gloo's all-gather buffer), whichever phase holds more.
    for row in rows:
        predicted, measured = row["predicted"]["peak"], row["measured"]["peak"]
        assert predicted > row["predicted"]["total"], row["candidate"]  # every row has a transient
        assert measured == pytest.approx(predicted, rel=TOLERANCE), (row["candidate"], row["precision"])


def test_bf16_zero1_runs_deepspeeds_bf16_optimizer_and_zero3_builds_under_zero_init(rows):
    by_row = {(row["candidate"], row["precision"]): row for row in rows}
    assert by_row["zero1", "bf16"]["optimizer"] == "BF16_Optimizer"  # the fp32 accumulation the config asks for
    assert by_row["zero1", "no"]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert all(row["zero3_init_flag"] == row["candidate"].startswith("zero3") for row in rows)


def test_fsdp2_accumulating_under_no_sync_holds_every_unsharded_gradient_as_the_model_counts(measured):
    # FSDP2 runs on 2 CPU ranks over gloo: the fp32 shards, Adam's moments and, between micro-batches, each block's
    # unsharded gradient in the compute dtype (2 bytes a parameter in bf16, 4 in fp32).
    assert [row["precision"] for row in measured["fsdp2"]] == ["bf16", "no"]
    for row in measured["fsdp2"]:
        print(f"\nfsdp2 under no_sync, {row['precision']}: predicted {row['predicted']['total'] / 2**20:.2f} MiB, "
              f"measured {row['measured']['total'] / 2**20:.2f} MiB")
        element = 2 if row["precision"] == "bf16" else 4
        assert row["predicted"]["unsharded gradients"] == element * row["parameters"]
        assert row["measured"]["total"] == pytest.approx(row["predicted"]["total"], rel=TOLERANCE), row["precision"]


def test_fsdp2s_peak_in_the_last_micro_batchs_reduction_is_what_the_memory_model_predicts(measured):
    # Gradient sync on again: block by block, the unsharded gradients are copied into the reduce-scatter's input and
    # its output cast to the fp32 shard, beside the gradients not yet reduced, the shards reduced and the next block
    # gathered. In bf16 on 2 ranks the root module's reduction (both embeddings) holds most; in fp32 the first
    # block's.
    for row in measured["fsdp2"]:
        predicted, measured_ = row["predicted"], row["measured"]
        print(f"\nfsdp2 peak in the reduction, {row['precision']}: predicted {predicted['peak'] / 2**20:.2f} MiB, "
              f"measured {measured_['peak'] / 2**20:.2f} MiB")
        assert measured_["peak"] == pytest.approx(predicted["peak"], rel=TOLERANCE), row["precision"]
        # What the reduction adds to the sharded weights and moments, on its own.
        assert measured_["reduction peak"] - measured_["sharded"] == pytest.approx(predicted["reduction"],
                                                                                    rel=TOLERANCE), row["precision"]
