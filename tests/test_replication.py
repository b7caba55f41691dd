"""The replication check's parts (one small process writes DeepSpeed's states; the rest in process): which steps a
run keeps as revisions and what they take on disk, training states read whole (DeepSpeed's and FSDP's, merged by
their own tools), the bounds and the verdict, the released seeds' names."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import launching
import pytest
import torch
from deepspeed_states import STATES as DEEPSPEED_STATES
from safetensors.torch import save_file
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from cram.errors import UserError
from cram.eval import replication
from cram.eval.replication import (
    DEFAULT_MARGIN,
    DEFAULT_TOLERANCE,
    judge,
    released_references,
    scoring_dtype,
    verdict,
)
from cram.eval.run_models import Revisions, read_training_state
from cram.models.pythia_recipe import pythia_checkpoint_steps
from cram.train.revisions import parse_revision_steps, revisions_disk_line


def test_revision_steps_default_to_pythias_154_and_keep_fewer_when_asked():
    schedule = pythia_checkpoint_steps()
    full = parse_revision_steps("pythia", schedule, 143_000)
    assert len(full) == 154 and full[:12] == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000] and full[-1] == 143_000
    assert parse_revision_steps("pythia", schedule, 5) == [0, 1, 2, 4]
    assert parse_revision_steps("none", schedule, 143_000) == []
    assert parse_revision_steps("0,512, every:1000", schedule, 3000) == [0, 512, 1000, 2000, 3000]
    for bad, message in [("every:0", "cannot read 'every:0'"), ("1k", "cannot read '1k'"), (",", "names no step"),
                         ("6000", "step 6000, past the run's 3000 steps")]:
        with pytest.raises(UserError, match=message):
            parse_revision_steps(bad, schedule, 3000)


def test_the_disk_the_revisions_take_is_saves_times_weights_times_bytes(tmp_path):
    steps = pythia_checkpoint_steps()
    line = revisions_disk_line(steps, 162_322_944, torch.float16, tmp_path / "revisions")  # pythia-160m
    each = 162_322_944 * 2
    assert f"the model at 154 steps (0, 1, 2, 4, 8, 16 … 143000), 162,322,944 weights in float16 = " \
           f"{each / 2**20:.1f} MiB each, {154 * each / 2**30:.1f} GiB in all in {tmp_path / 'revisions'}" in line
    assert revisions_disk_line([], 1, torch.float32, tmp_path) == "revisions: none kept (--revision-steps none)"
    huge = revisions_disk_line(steps, 12 * 10**12, torch.float16, tmp_path)
    assert "warning: the revisions will not fit in the free space" in huge


@pytest.fixture(scope="module")
def tiny_model() -> GPTNeoXForCausalLM:
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=32)
    return GPTNeoXForCausalLM(config)


def assert_same_weights(weights: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process saves, as intended
def test_fsdp_sharded_and_full_states_are_read_whole(tmp_path, tiny_model):
    """The folders Accelerate's save_state writes under FSDP (accelerate/utils/fsdp_utils.py: save_fsdp_model):
    SHARDED_STATE_DICT as a torch.distributed.checkpoint folder of {"model": state}, FULL_STATE_DICT torch.save'd."""
    import torch.distributed.checkpoint as dist_cp

    sharded = tmp_path / "step-00000002"
    dist_cp.save(state_dict={"model": tiny_model.state_dict()},
                 storage_writer=dist_cp.FileSystemWriter(str(sharded / "pytorch_model_fsdp_0")), no_dist=True)
    assert_same_weights(read_training_state(sharded), tiny_model)
    full = tmp_path / "step-00000004"
    full.mkdir()
    torch.save(tiny_model.state_dict(), full / "pytorch_model_fsdp.bin")
    assert_same_weights(read_training_state(full), tiny_model)
    local = tmp_path / "step-00000006"
    local.mkdir()
    torch.save(tiny_model.state_dict(), local / "pytorch_model_fsdp_rank0.bin")
    with pytest.raises(UserError, match="LOCAL_STATE_DICT is one shard per process"):
        read_training_state(local)


def test_a_runs_steps_come_from_revisions_states_and_its_final_model(tmp_path, tiny_model):
    run = tmp_path / "run"
    tiny_model.save_pretrained(run / "revisions" / "step0")
    tiny_model.save_pretrained(run / "final")
    (run / "summary.json").write_text('{"optimizer_steps": 7}')
    (run / "checkpoints" / "step-00000006").mkdir(parents=True)
    weights = {name: tensor.contiguous() for name, tensor in tiny_model.state_dict().items()}
    save_file(weights, run / "checkpoints" / "step-00000006" / "model.safetensors")
    (run / "checkpoints" / "step-00000008").mkdir()  # no weights in it: not a step
    revisions = Revisions(str(run))
    assert {step: kind for step, (kind, _) in revisions.found().items()} == {0: "revision", 6: "state", 7: "revision"}
    assert_same_weights(revisions.load(6).state_dict(), tiny_model)


def test_a_revision_loads_in_the_precision_it_was_saved_in(tmp_path, tiny_model):
    """The released models are saved in float16 (config.json torch_dtype): read as saved, not upcast or halved."""
    halved = copy.deepcopy(tiny_model).half()
    halved.save_pretrained(tmp_path / "seed1" / "step0")
    model = Revisions(str(tmp_path / "seed1")).load(0)
    assert model.dtype == torch.float16
    assert_same_weights(model.state_dict(), halved)


def test_bounds_widen_several_references_by_the_margin_and_one_by_the_tolerance():
    assert judge([2.9, 3.1, 3.05], 0.05, 0.2) == pytest.approx((2.85, 3.15))
    assert judge([2.9], 0.05, 0.2) == pytest.approx((2.7, 3.1))
    assert (DEFAULT_MARGIN, DEFAULT_TOLERANCE) == (0.05, 0.1)


def test_the_verdict_names_the_first_step_out_and_which_side():
    rows = [{"step": 0, "ours": 7.0, "low": 6.9, "high": 7.1, "passed": True},
            {"step": 512, "ours": 4.0, "low": 3.5, "high": 3.8, "passed": False},
            {"step": 1000, "ours": 3.0, "low": 3.2, "high": 3.4, "passed": False}]
    text = verdict({"rows": rows, "passed": False, "bounds": "the references' min … max ± 0.05"})
    assert text.startswith("FAIL at step 512: our loss 4.0000 lies above 3.5000 … 3.8000")
    passed = verdict({"rows": rows[:1], "passed": True, "bounds": "the reference ± 0.1"})
    assert passed == "PASS: at every step compared (0) our loss lies within the reference ± 0.1 nats."


def test_released_names_every_seed_where_ten_were_released():
    assert released_references("pythia-160m") == ["EleutherAI/pythia-160m"] + [
        f"EleutherAI/pythia-160m-seed{seed}" for seed in range(1, 10)]
    assert released_references("pythia-1b") == ["EleutherAI/pythia-1b"]


def test_scoring_runs_in_the_recipes_precision_on_a_gpu_and_fp32_on_the_cpu():
    assert scoring_dtype("auto", torch.device("cuda"), "fp16") == torch.float16
    assert scoring_dtype("auto", torch.device("cuda"), "bf16") == torch.bfloat16
    assert scoring_dtype("auto", torch.device("cpu"), "fp16") == torch.float32
    assert scoring_dtype("bf16", torch.device("cpu"), "fp16") == torch.bfloat16


def fake_run(folder, model: GPTNeoXForCausalLM, steps: int = 4, **resolved) -> str:
    """A folder laid out as a Pythia run that finished after `steps` steps: its final model, options and summary."""
    model.save_pretrained(folder / "final")
    facts = {"seq_len": 32, "global_batch_size": 8, "max_steps": steps, "vocab_size": model.config.vocab_size,
             **resolved}
    options = {"resolved": facts, "training": {"size": "pythia-14m", "data": "pile/document", "tokenizer": None}}
    (folder / "final" / "cram_options.json").write_text(json.dumps(options))
    (folder / "summary.json").write_text(json.dumps({"optimizer_steps": steps}))
    return str(folder)


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 80}, "has a vocabulary of 80 tokens and our run 64"),
    ({"global_batch_size": 16}, "our run's global batch is 8 and the reference"),
    ({"max_steps": 6}, "schedule"),
    ({"seq_len": 16}, "sequence length is 32"),
])
def test_a_reference_of_another_recipe_or_vocabulary_is_refused_before_any_scoring(tmp_path, tiny_model, change,
                                                                                   message):
    ours = fake_run(tmp_path / "ours", tiny_model)
    other = copy.deepcopy(tiny_model)
    if "vocab_size" in change:
        other.resize_token_embeddings(change["vocab_size"])
    theirs = fake_run(tmp_path / "theirs", other, **{key: value for key, value in change.items()
                                                     if key != "max_steps"})
    if "max_steps" in change:  # the same step kept, of a longer schedule
        options = json.loads((tmp_path / "theirs" / "final" / "cram_options.json").read_text())
        options["resolved"]["max_steps"] = change["max_steps"]
        (tmp_path / "theirs" / "final" / "cram_options.json").write_text(json.dumps(options))
    with pytest.raises(UserError, match=f"cannot compare: .*{message}"):
        replication.main([ours, "--reference", theirs, "--data", "unread", "--output", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, message", [(["--sequences", "-5"], "--sequences -5 scores nothing"),
                                             (["--micro-batch-size", "0"], "--micro-batch-size 0")])
def test_a_count_that_scores_nothing_is_refused(tmp_path, tiny_model, option, message):
    ours = fake_run(tmp_path / "ours", tiny_model)
    with pytest.raises(UserError, match=message):
        replication.main([ours, "--reference", ours, "--data", "unread", *option])


def test_references_are_scored_with_the_activation_they_trained_with(tmp_path, tiny_model, monkeypatch):
    # The released config.json files say "gelu"; the references must run gelu_fast (bias_gelu), ours as it was built.
    ours = fake_run(tmp_path / "ours", tiny_model)
    theirs = fake_run(tmp_path / "theirs", tiny_model)
    scored = []
    monkeypatch.setattr(replication, "load_causal_data", lambda *args: SimpleNamespace(sequences=None))
    monkeypatch.setattr(replication, "batch_loss", lambda model, *args: scored.append(model.config.hidden_act) or 1.0)
    result = replication.compare(replication.read_run(Path(ours)), [Revisions(theirs)], [4], "unread", None, None)
    assert scored == ["gelu", "gelu_fast"]  # ours as saved, then the reference
    assert result["reference_activation"] == "gelu_fast"


@pytest.fixture(scope="module")
def deepspeed_states(tmp_path_factory) -> Path:
    """Every DeepSpeed state tests/deepspeed_states.py writes, from one process of its own (DeepSpeed's process group
    must not live in the test's)."""
    folder = tmp_path_factory.mktemp("deepspeed-states")
    launching.run([sys.executable, str(Path(__file__).with_name("deepspeed_states.py")), str(folder)], check=True)
    return folder


@pytest.mark.launch
@pytest.mark.parametrize("name", [name for name, _, _ in DEEPSPEED_STATES])
def test_every_deepspeed_state_is_read_as_the_engine_held_it(deepspeed_states, name):
    """bf16 at ZeRO-1 (DeepSpeed's BF16_Optimizer, whose states zero_to_fp32 calls "not a zero checkpoint"), bf16 at
    ZeRO-2 and 3, fp32 at ZeRO-1 and 2: the fp32 master weights read back, in the engine's precision, are the
    engine's weights after its step."""
    expected = torch.load(deepspeed_states / name / "expected.pt", weights_only=False)
    if name == "zero1-bf16":
        assert expected["optimizer"] == "BF16_Optimizer"
    weights = read_training_state(deepspeed_states / name)
    for parameter, tensor in expected["weights"].items():
        assert weights[parameter].dtype == torch.float32, parameter
        assert torch.equal(weights[parameter].to(tensor.dtype), tensor), parameter
