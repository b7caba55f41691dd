"""The replication check's parts (one small process writes DeepSpeed's states; the rest in process): which steps a
run keeps as revisions and what they take on disk, training states read whole (DeepSpeed's and FSDP's, merged by
their own tools), the band from the seeds' spread and the verdict, the time budget, the released seeds' names, and
what cannot be compared refused before any scoring."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import launching
import pytest
import torch
from deepspeed_states import STATES as DEEPSPEED_STATES
from hub_standin import HubStandIn, StoredRepo
from pile_standin import write_pile_split
from safetensors.torch import save_file
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from cram.errors import UserError
from cram.eval import replication
from cram.eval.reference_identity import weight_digest
from cram.eval.replication import DEFAULT_ALPHA, DEFAULT_TOLERANCE, compare, phase_verdict, verdict
from cram.eval.replication_runs import check_comparable, read_run, reference_set, released_references
from cram.eval.replication_scoring import parse_budget, plan_scoring, scoring_dtype, sequence_losses
from cram.eval.run_models import Revisions, read_training_state
from cram.eval.seed_band import t_quantile_two_sided
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


def test_students_quantile_is_the_tables():
    # Two-sided critical values of Student's t (any statistics table): 12.706 (1 degree, 5 %), 4.303 (2), 2.776 (4),
    # 3.250 (9 degrees, 1 %), 4.781 (9 degrees, 0.1 %).
    for tail, degrees, expected in ((0.05, 1, 12.706), (0.05, 2, 4.303), (0.05, 4, 2.776), (0.01, 9, 3.250),
                                    (0.001, 9, 4.781)):
        assert t_quantile_two_sided(tail, degrees) == pytest.approx(expected, abs=1e-3), (tail, degrees)
    assert (DEFAULT_ALPHA, DEFAULT_TOLERANCE) == (0.05, 0.1)


def test_the_verdict_names_the_first_step_out_which_side_and_each_phase():
    rows = [{"step": 0, "early": True, "ours": 7.0, "low": 6.9, "high": 7.1, "passed": True, "spread": 0.01,
             "z": 0.1, "critical": 3.0},
            {"step": 512, "early": True, "ours": 4.0, "low": 3.5, "high": 3.8, "passed": False, "spread": 0.05,
             "z": 5.2, "critical": 3.0},
            {"step": 1000, "early": False, "ours": 3.0, "low": 3.2, "high": 3.4, "passed": False, "spread": 0.05,
             "z": -4.1, "critical": 3.0}]
    phases = {"early": phase_verdict(rows[:2]), "late": phase_verdict(rows[2:])}
    text = verdict({"rows": rows, "passed": False, "bounds": "the band", "phases": phases})
    assert text.startswith("FAIL at step 512: our held-out loss 4.0000 lies above 3.5000 … 3.8000, the band, "
                           "z = +5.20 where |z| ≤ 3.00 passes (early steps (≤ 512): FAIL from step 512; late steps: "
                           "FAIL from step 1000)")
    passed = verdict({"rows": rows[:1], "passed": True, "bounds": "the reference ± 0.1 nats",
                      "phases": {"early": phase_verdict(rows[:1]), "late": phase_verdict([])}})
    assert passed == ("PASS: at every step compared (0) our held-out loss lies within the reference ± 0.1 nats "
                      "(early steps (≤ 512): pass).")


def test_a_budget_sizes_the_sequences_from_a_timed_load_and_scoring(tiny_model):
    assert [parse_budget(text) for text in ("10m", "90s", "1.5h", "30")] == [600, 90, 5400, 30]
    with pytest.raises(UserError, match="cannot read --budget 'soon'"):
        parse_budget("soon")
    probe = torch.randint(0, 64, (4, 9))
    plan = plan_scoring(lambda: tiny_model, probe, models=6, extra_sequences=2, budget_seconds=60.0, sequences=None,
                        micro_batch_size=2, device=torch.device("cpu"), dtype=torch.float32)
    per_sequence = plan.sequence_seconds * (6 + 2)
    assert plan.sequences >= 1 and plan.predicted_seconds() <= 60.0 + per_sequence
    assert plan.predicted_seconds() == pytest.approx(6 * plan.load_seconds + plan.sequences * per_sequence)
    assert 60.0 - plan.predicted_seconds() < per_sequence  # the budget is spent, not left over
    given = plan_scoring(lambda: tiny_model, probe, models=6, extra_sequences=2, budget_seconds=60.0, sequences=3,
                         micro_batch_size=2, device=torch.device("cpu"), dtype=torch.float32)
    assert given.sequences == 3


def test_released_names_the_matched_seeds_where_they_exist_else_every_seed_and_the_deduplicated_model():
    # pythia-160m: the original and the seeds of its data order (init alone differs), which our run pairs with.
    assert released_references("pythia-160m") == ["EleutherAI/pythia-160m"] + [
        f"EleutherAI/pythia-160m-weight-seed{seed}" for seed in range(1, 4)]
    assert released_references("pythia-70m") == ["EleutherAI/pythia-70m"] + [
        f"EleutherAI/pythia-70m-seed{seed}" for seed in range(1, 10)]
    assert released_references("pythia-1b") == ["EleutherAI/pythia-1b"]
    assert "matched set" in reference_set("pythia-160m", False)
    # What it is assumed to be, what EleutherAI/pythia#203 reports instead, and what the check does then.
    assert "That is assumed: EleutherAI/pythia#203 reports" in reference_set("pythia-160m", False)
    assert "refuses the set where fewer than two are left" in reference_set("pythia-160m", False)
    assert "differ from it in the init and the data order" in reference_set("pythia-70m", False)
    assert released_references("pythia-160m", deduped=True) == ["EleutherAI/pythia-160m-deduped"]


def test_scoring_runs_in_the_recipes_precision_on_a_gpu_and_fp32_on_the_cpu():
    assert scoring_dtype("auto", torch.device("cuda"), "fp16") == torch.float16
    assert scoring_dtype("auto", torch.device("cuda"), "bf16") == torch.bfloat16
    assert scoring_dtype("auto", torch.device("cpu"), "fp16") == torch.float32
    assert scoring_dtype("bf16", torch.device("cpu"), "fp16") == torch.bfloat16


def test_scoring_in_bf16_runs_under_autocast_and_keeps_the_weights_as_saved(tiny_model):
    # --precision bf16 (a GPU's auto for pythia-1b, or asked on a CPU with bf16 units): the matmuls in bf16, each
    # sequence's loss upcast, the weights left in fp32.
    tokens = torch.randint(0, 64, (6, 17), generator=torch.Generator().manual_seed(0))
    full = sequence_losses(copy.deepcopy(tiny_model), tokens, 4)
    model = copy.deepcopy(tiny_model)
    half = sequence_losses(model, tokens, 4, dtype=torch.bfloat16)
    assert half.dtype == full.dtype == torch.float64 and half.shape == full.shape == (6,)
    assert not torch.equal(half, full) and torch.allclose(half, full, atol=0.05)
    assert model.dtype == torch.float32


RECORDED = {"seq_len": 32, "global_batch_size": 8, "mixed_precision": "no", "peak_lr": 1e-3, "weight_decay": 0.1,
            "deduplicated": False}


def fake_run(folder, model: GPTNeoXForCausalLM | GPTNeoXConfig, steps: int = 4, data: str = "pile/document",
             tokenizer=None, seed: int | None = None, **resolved) -> str:
    """A folder laid out as a Pythia run that finished after `steps` steps: its final model (and `tokenizer`, saved
    beside it as the recipe does), options (`seed` recorded where given) and summary."""
    if isinstance(model, GPTNeoXConfig):  # a run whose facts alone are read: its config, no weights
        model.save_pretrained(folder / "final")
        model = SimpleNamespace(config=model)
    else:
        model.save_pretrained(folder / "final")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder / "final")
    facts = {**RECORDED, "max_steps": steps, "vocab_size": model.config.vocab_size, **resolved}
    options = {"resolved": facts, "training": {"size": "pythia-14m", "data": data,
                                               "tokenizer": None if tokenizer is None else str(folder / "final")}}
    if seed is not None:
        options["training"]["seed"] = seed
    (folder / "final" / "cram_options.json").write_text(json.dumps(options))
    (folder / "summary.json").write_text(json.dumps({"optimizer_steps": steps}))
    return str(folder)


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 80}, "has a vocabulary of 80 tokens and our run 64"),
    ({"global_batch_size": 16}, "our run's global batch is 8 and the reference"),
    ({"max_steps": 6}, "schedule"),
    ({"seq_len": 16}, "sequence length is 32"),
    ({"first_batch": "another-order"}, "trained on other data or in another order"),
])
def test_a_reference_of_another_recipe_or_vocabulary_is_refused_before_any_scoring(tmp_path, tiny_model, change,
                                                                                   message):
    ours = fake_run(tmp_path / "ours", tiny_model, first_batch="our-order")
    other = copy.deepcopy(tiny_model)
    if "vocab_size" in change:
        other.resize_token_embeddings(change["vocab_size"])
    # Another batch, sequence or schedule reads another first batch too: the sentence names the recipe's difference.
    theirs = fake_run(tmp_path / "theirs", other, **{"first_batch": "their-order",
                                                     **{key: value for key, value in change.items()
                                                        if key != "max_steps"}})
    if "max_steps" in change:  # the same step kept, of a longer schedule
        options = json.loads((tmp_path / "theirs" / "final" / "cram_options.json").read_text())
        options["resolved"]["max_steps"] = change["max_steps"]
        (tmp_path / "theirs" / "final" / "cram_options.json").write_text(json.dumps(options))
    with pytest.raises(UserError, match=f"cannot compare: .*{message}"):
        replication.main([ours, "--reference", theirs, "--data", "unread", "--heldout", "unread", "--output",
                          str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, message", [(["--sequences", "-5"], "--sequences -5 scores nothing"),
                                             (["--micro-batch-size", "0"], "--micro-batch-size 0"),
                                             (["--alpha", "1.5"], "--alpha 1.5"),
                                             (["--budget", "0m"], "cannot read --budget '0m'"),
                                             (["--tolerance", "nan"], "--tolerance nan"),
                                             (["--tolerance", "inf"], "--tolerance inf"),
                                             (["--device", "foo"], "--device 'foo' is not a device")])
def test_a_bad_number_or_device_is_refused(tmp_path, tiny_model, option, message):
    ours = fake_run(tmp_path / "ours", tiny_model)
    with pytest.raises(UserError, match=message):
        replication.main([ours, "--reference", ours, "--data", "unread", "--heldout", "unread", *option])


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, english_texts) -> SimpleNamespace:
    """A 300-token byte-level BPE, 40 documents of real English as a Megatron file, and 20 others as a held-out
    file laid out as the Pile's validation split (val.jsonl.zst)."""
    from cram.data.megatron import tokenized_documents, write_megatron
    from cram.data.tokenizer import train_byte_level_bpe

    folder = tmp_path_factory.mktemp("replication-data")
    tokenizer = train_byte_level_bpe(iter(english_texts[:60]), 300, lowercase=False, model_max_length=2048)
    write_megatron(folder / "document", tokenized_documents(english_texts[:40], tokenizer))
    write_pile_split(folder / "val.jsonl.zst", english_texts[40:60])
    other = train_byte_level_bpe(iter(english_texts[100:160]), 300, lowercase=False, model_max_length=2048)
    return SimpleNamespace(prefix=str(folder / "document"), heldout=str(folder / "val.jsonl.zst"),
                           tokenizer=tokenizer, other_tokenizer=other)


def small_model(seed: int) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=320, hidden_size=16, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=32, max_position_embeddings=64))


def test_data_that_is_not_the_runs_and_another_tokenizer_are_refused(tmp_path, small_data):
    from cram.data.causal import first_batch_fingerprint, load_causal_data

    ours = fake_run(tmp_path / "ours", small_model(0), tokenizer=small_data.tokenizer, first_batch="not-this-data")
    seed = fake_run(tmp_path / "seed", small_model(1), tokenizer=small_data.tokenizer, first_batch="not-this-data")
    with pytest.raises(UserError, match="is not the data our run trained on, in its order"):
        replication.main([ours, "--reference", seed, "--data", small_data.prefix, "--heldout", small_data.heldout])
    digest = first_batch_fingerprint(load_causal_data(small_data.prefix, 32, 320, str(tmp_path / "ours" / "final"),
                                                      None, 4 * 8).sequences, 8)
    ours = fake_run(tmp_path / "ours-2", small_model(0), tokenizer=small_data.tokenizer, first_batch=digest)
    theirs = fake_run(tmp_path / "theirs", small_model(1), tokenizer=small_data.other_tokenizer, first_batch=digest)
    with pytest.raises(UserError, match="tokenizer maps text to other ids than our run's"):
        replication.main([ours, "--reference", theirs, "--data", small_data.prefix, "--heldout", small_data.heldout])


def test_the_check_scores_held_out_text_and_the_next_batch_and_says_its_time_first(tmp_path, small_data, capsys):
    from cram.data.causal import first_batch_fingerprint, load_causal_data

    tokenizer_folder = tmp_path / "tokenizer"
    small_data.tokenizer.save_pretrained(tokenizer_folder)
    digest = first_batch_fingerprint(load_causal_data(small_data.prefix, 32, 320, str(tokenizer_folder), None,
                                                      4 * 8).sequences, 8)
    runs = [fake_run(tmp_path / f"seed{seed}", small_model(seed), tokenizer=small_data.tokenizer, first_batch=digest)
            for seed in range(4)]
    references = [argument for run in runs[1:] for argument in ("--reference", run)]
    status = replication.main([runs[0], *references, "--data", small_data.prefix, "--heldout", small_data.heldout,
                               "--sequences", "12", "--output", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert printed.index("scoring 12 held-out sequences of 33 tokens") < printed.index("# Replication")
    assert "predicted" in printed.split("# Replication")[0]
    result = json.loads((tmp_path / "out" / "replication.json").read_text())
    assert status == (0 if result["passed"] else 1)
    (row,) = result["rows"]
    assert row["step"] == 4 and len(row["references"]) == 3 and row["spread"] > 0 and row["scoring_error"] > 0
    assert row["z"] == pytest.approx((row["ours"] - row["mean"]) / (row["spread"] * (1 + 1 / 3) ** 0.5))
    # Three references: Student's t with 2 degrees of freedom at one step (4.303), and the verdict says it is weak.
    assert row["critical"] == pytest.approx(4.303, abs=1e-3)
    assert row["detectable"] == pytest.approx(4.303 * row["spread"] * (1 + 1 / 3) ** 0.5, rel=1e-3)
    assert "weak: 3 references" in result["verdict"] and "seed spreads" in result["power"]
    assert result["heldout"]["sequences"] == 12 and result["heldout"]["tokens_per_sequence"] == 33
    # The next batch of step 4 is sequences [32, 40), past the 4 × 8 the run read: the index is the run's own, so
    # it is not scored as if it were the next batch.
    assert row["next_batch"] is None or row["next_batch"]["first_sequence"] == 32
    assert result["phases"]["early"]["steps"] == [4] and result["phases"]["late"]["passed"] is None


def test_the_check_reads_the_data_through_the_index_the_run_built(tmp_path, small_data):
    # GPT-NeoX's index of a document-level file depends on the sequences asked for: its epochs, and whether the last
    # is shuffled apart. A run of one sequence a step whose schedule ends just before the order changes: an index
    # sized one sequence longer (the step after the last) reads another first batch, which the check must not build.
    from cram.data.causal import first_batch_fingerprint, load_causal_data

    tokenizer_folder = tmp_path / "tokenizer"
    small_data.tokenizer.save_pretrained(tokenizer_folder)

    def first_batch(sequences: int) -> str:
        data = load_causal_data(small_data.prefix, 32, 320, str(tokenizer_folder), None, sequences)
        return first_batch_fingerprint(data.sequences, 1)

    one_epoch = len(load_causal_data(small_data.prefix, 32, 320, str(tokenizer_folder), None, 1).sequences)
    low, high = one_epoch, 2 * one_epoch
    assert first_batch(low) != first_batch(high)
    while high - low > 1:  # the last length of the first order
        middle = (low + high) // 2
        low, high = (middle, high) if first_batch(middle) == first_batch(low) else (low, middle)
    ours = fake_run(tmp_path / "ours", small_model(0), steps=low, tokenizer=small_data.tokenizer,
                    global_batch_size=1, first_batch=first_batch(low))
    seed = fake_run(tmp_path / "seed", small_model(1), steps=low, tokenizer=small_data.tokenizer,
                    global_batch_size=1, first_batch=first_batch(low))
    status = replication.main([ours, "--reference", seed, "--data", small_data.prefix, "--heldout",
                               small_data.heldout, "--sequences", "2", "--tolerance", "100", "--output",
                               str(tmp_path / "out")])
    assert status == 0


def test_references_are_scored_with_the_activation_they_trained_with(tmp_path, tiny_model, monkeypatch):
    # The released config.json files say "gelu"; the references must run gelu_fast (bias_gelu), ours as it was built.
    ours = fake_run(tmp_path / "ours", tiny_model)
    theirs = fake_run(tmp_path / "theirs", tiny_model)
    scored = []

    def losses(model, tokens, *args):
        scored.append(model.config.hidden_act)
        return torch.ones(len(tokens), dtype=torch.float64)

    monkeypatch.setattr(replication, "sequence_losses", losses)
    heldout = SimpleNamespace(sequences=torch.zeros(2, 9, dtype=torch.int64), path=Path("unread"), documents=1,
                              fingerprint="none")
    result = compare(replication.read_run(Path(ours)), [Revisions(theirs)], [4], heldout, {})
    assert scored == ["gelu", "gelu_fast"]  # ours as saved, then the reference
    assert result["reference_activation"] == "gelu_fast"


@pytest.fixture(scope="module")
def deepspeed_states(tmp_path_factory) -> Path:
    """Every DeepSpeed state tests/deepspeed_states.py writes, from one process of its own (DeepSpeed's process group
    must not live in the test's)."""
    folder = tmp_path_factory.mktemp("deepspeed-states")
    extensions = tmp_path_factory.mktemp("torch-extensions")  # where DeepSpeed would build an op: minutes of g++
    launching.run([sys.executable, str(Path(__file__).with_name("deepspeed_states.py")), str(folder)], check=True,
                  env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert not list(extensions.rglob("*.so")), sorted(extensions.rglob("*"))
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


def stand_in(location: str, config: GPTNeoXConfig, folder=None):
    """A reference as check_comparable sees one, without the Hub: its config and no tokenizer or options kept."""
    return SimpleNamespace(location=location, folder=folder, config=lambda step: config,
                           tokenizer_digest=lambda step: None, options_file=lambda step: None)


def pythia_config(hidden: int, layers: int, heads: int) -> GPTNeoXConfig:
    return GPTNeoXConfig(vocab_size=50304, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * hidden)


PYTHIA_14M_RUN = {**RECORDED, "seq_len": 2048, "global_batch_size": 1024, "max_steps": 143_000,
                  "mixed_precision": "fp16", "peak_lr": 1e-3}


@pytest.mark.parametrize("location, config, recorded, message", [
    # pythia-70m's seeds as references of a pythia-14m run, by an explicit Hub name: another size.
    ("EleutherAI/pythia-70m-seed3", pythia_config(512, 6, 8), {}, "model of width 512, 6 layers, 8 heads"),
    # The released pythia-14m trained in fp16 at lr 1e-3: a run in fp32, at another lr or weight decay is refused.
    ("EleutherAI/pythia-14m", pythia_config(128, 6, 4), {"mixed_precision": "no"}, "arithmetic is fp32"),
    ("EleutherAI/pythia-14m-seed2", pythia_config(128, 6, 4), {"peak_lr": 0.1}, "peak learning rate is 0.1"),
    ("EleutherAI/pythia-14m", pythia_config(128, 6, 4), {"weight_decay": 0.0}, "weight decay is 0.0"),
    ("EleutherAI/pythia-14m", pythia_config(128, 6, 4), {"max_steps": 1000}, r"schedule \(steps\) is 1000"),
    # Deduplication as the data recorded it, not guessed from a path: deduplicated data against the standard Pile,
    # the standard Pile against the deduplicated model, and data that recorded nothing.
    ("EleutherAI/pythia-14m", pythia_config(128, 6, 4), {"deduplicated": True}, "give --reference released-deduped"),
    ("EleutherAI/pythia-14m-deduped", pythia_config(128, 6, 4), {}, "give --reference released[.]"),
    ("EleutherAI/pythia-14m", pythia_config(128, 6, 4), {"deduplicated": None}, "records no deduplication"),
    # A Hub repository that is no released model and records nothing of its training: refused, not scored.
    ("someone/pythia-14m-copy", pythia_config(128, 6, 4), {}, "records no training facts"),
])
def test_every_reference_goes_through_one_comparability_check(tmp_path, location, config, recorded, message):
    model = pythia_config(128, 6, 4)  # pythia-14m's shape; the facts alone are compared, no weights read
    ours = fake_run(tmp_path / "ours", model, data="/scratch/dedup-study/pile/document",
                    **{**PYTHIA_14M_RUN, "max_steps": 143_000, **recorded})
    run = read_run(Path(ours))
    with pytest.raises(UserError, match=f"cannot compare: .*{message}"):
        check_comparable(run, [location], [stand_in(location, config)], 4, Revisions(ours))
    # The released model of the run's own size and recipe, on the standard Pile as recorded, is comparable, whatever
    # the data's path says.
    if not recorded and location != "EleutherAI/pythia-14m-deduped":
        return
    check_comparable(read_run(Path(fake_run(tmp_path / "faithful", model, data="/scratch/dedup-study/document",
                                            **PYTHIA_14M_RUN))),
                     ["EleutherAI/pythia-14m"], [stand_in("EleutherAI/pythia-14m", pythia_config(128, 6, 4))], 4,
                     Revisions(str(tmp_path / "faithful")))


def test_the_run_itself_or_a_seed_given_twice_is_refused(tmp_path, tiny_model):
    ours = fake_run(tmp_path / "ours", tiny_model)
    seed = fake_run(tmp_path / "seed", tiny_model)
    for references, message in (([ours, ours, ours], "is our run itself"), ([seed, str(tmp_path / "." / "seed")],
                                                                               "is given twice")):
        arguments = [part for reference in references for part in ("--reference", reference)]
        with pytest.raises(UserError, match=message):
            replication.main([ours, *arguments, "--data", "unread", "--heldout", "unread"])


@pytest.mark.parametrize("damage, message", [
    (lambda options: options.write_text(options.read_text()[:40]), "is not the record of a run of recipes/pythia.py"),
    (lambda options: options.write_text('{"run": "crammed-bert"}'), "is not the record of a run of recipes/pythia.py"),
    (lambda options: (options.parent / "model.safetensors").unlink(), "seed2 keeps no weights at step4"),
])
def test_a_damaged_reference_is_refused_in_one_sentence(tmp_path, small_data, damage, message):
    ours = fake_run(tmp_path / "ours", small_model(0), tokenizer=small_data.tokenizer)
    seeds = [fake_run(tmp_path / f"seed{seed}", small_model(seed), tokenizer=small_data.tokenizer)
             for seed in (1, 2)]
    damage(tmp_path / "seed2" / "final" / "cram_options.json")
    with pytest.raises(UserError, match=message):
        replication.main([ours, "--reference", seeds[0], "--reference", seeds[1], "--data", small_data.prefix,
                          "--heldout", small_data.heldout, "--sequences", "2", "--output", str(tmp_path / "out")])


def test_bad_held_out_text_is_refused_in_one_sentence(tmp_path, small_data):
    from cram.data.heldout import heldout_sequences

    corrupt = tmp_path / "val.jsonl.zst"
    corrupt.write_bytes(Path(small_data.heldout).read_bytes()[:-30] + b"\x00" * 30)
    with pytest.raises(UserError, match="cannot read the held-out file"):
        heldout_sequences(corrupt, small_data.tokenizer, 32, 1000)
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"text": "fine"}\n{"text": "broken \\ud800 half"}\n')
    with pytest.raises(UserError, match="document 2 of the held-out file .* is not text"):
        heldout_sequences(surrogate, small_data.tokenizer, 4, 100)


def test_a_step_named_twice_is_one_test():
    assert replication.parse_steps("4,4,0") == [0, 4]


def test_another_tokenizer_than_the_runs_own_is_refused(tmp_path, small_data):
    ours = fake_run(tmp_path / "ours", small_model(0), tokenizer=small_data.tokenizer)
    seed = fake_run(tmp_path / "seed", small_model(1), tokenizer=small_data.tokenizer)
    other = tmp_path / "other-tokenizer"
    small_data.other_tokenizer.save_pretrained(other)
    with pytest.raises(UserError, match="maps text to other ids than the tokenizer our run kept"):
        replication.main([ours, "--reference", seed, "--data", small_data.prefix, "--heldout", small_data.heldout,
                          "--tokenizer", str(other)])


def test_a_budget_that_affords_too_few_sequences_is_refused_naming_the_budget_needed(tmp_path, small_data):
    ours = fake_run(tmp_path / "ours", small_model(0), tokenizer=small_data.tokenizer)
    seed = fake_run(tmp_path / "seed", small_model(1), tokenizer=small_data.tokenizer)
    with pytest.raises(UserError, match=r"--budget 0.001s affords 0 held-out sequences after \d+ s reading the "
                                        r"references' weights, fewer than the 32 .* give --budget \d+s or more"):
        replication.main([ours, "--reference", seed, "--data", small_data.prefix, "--heldout", small_data.heldout,
                          "--budget", "0.001s"])


def test_deduplication_is_recorded_where_the_data_is_prepared(tmp_path):
    from cram.data.megatron import main as megatron_main
    from cram.data.megatron import recorded_deduplication, write_megatron

    prefix = write_megatron(tmp_path / "pile" / "document", [[1, 2, 3], [4, 5]])
    assert recorded_deduplication(prefix) is None  # nothing recorded: unknown, whatever the path says
    megatron_main(["--output", str(prefix), "--deduplicated", "yes"])
    assert recorded_deduplication(prefix) is True and recorded_deduplication(str(prefix) + ".bin") is True
    megatron_main(["--output", str(prefix), "--deduplicated", "no"])
    assert recorded_deduplication(prefix) is False
    with pytest.raises(UserError, match="nothing to do"):
        megatron_main(["--output", str(tmp_path / "absent" / "document"), "--deduplicated", "no"])


def test_a_hub_repository_of_runs_is_compared_by_its_recorded_facts_not_as_a_released_model(tmp_path, tiny_model):
    # A run pushed with --push-checkpoints: its revisions keep cram_options.json, which the check reads from the Hub.
    ours = fake_run(tmp_path / "ours", tiny_model, deduplicated=None)
    pushed = fake_run(tmp_path / "pushed", tiny_model, deduplicated=None)
    hub = SimpleNamespace(location="lab/pythia-tiny", folder=None, config=lambda step: tiny_model.config,
                          tokenizer_digest=lambda step: None,
                          options_file=lambda step: tmp_path / "pushed" / "final" / "cram_options.json")
    check_comparable(read_run(Path(ours)), ["lab/pythia-tiny"], [hub], 4, Revisions(ours))
    other = fake_run(tmp_path / "other", tiny_model, weight_decay=0.0)
    hub.options_file = lambda step: Path(other) / "final" / "cram_options.json"
    with pytest.raises(UserError, match="cannot compare: our run's weight decay is 0.1 and the reference "
                                        "lab/pythia-tiny's 0.0"):
        check_comparable(read_run(Path(ours)), ["lab/pythia-tiny"], [hub], 4, Revisions(ours))
    assert pushed


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch) -> Path:
    """Each test's own digest cache ($CRAM_CACHE/replication), not the user's."""
    monkeypatch.setenv("CRAM_CACHE", str(tmp_path / "cram-cache"))
    return tmp_path / "cram-cache" / "replication" / "weight-digests.json"


def revision_run(folder: Path, tokenizer, init: int, moves: int, steps=(0, 1, 8), seed: int | None = None,
                 noise: float = 0.01, **recorded) -> str:
    """A run that kept revisions at `steps`: the init small_model(`init`) at steps 0 and 1 (the first update at learning
    rate 0), each later step moved from it by noise drawn from `moves` and the step; its final model the last."""
    revisions = []
    for step in steps:
        model = small_model(init)
        if step > 1:
            generator = torch.Generator().manual_seed(1000 * moves + step)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn(parameter.shape, generator=generator) * noise)
        revisions.append(model)
    fake_run(folder, revisions[-1], steps=steps[-1], tokenizer=tokenizer, seed=seed, **recorded)
    for step, model in zip(steps, revisions, strict=True):
        model.save_pretrained(folder / "revisions" / f"step{step}")
        shutil.copy(folder / "final" / "cram_options.json", folder / "revisions" / f"step{step}")
    return str(folder)


def check(ours: str, references: list[str], small_data, output: Path, *options: str) -> tuple[int, dict]:
    arguments = [ours, *(part for reference in references for part in ("--reference", reference)),
                 "--data", small_data.prefix, "--heldout", small_data.heldout, "--sequences", "8",
                 "--tolerance", "100", "--output", str(output), *options]
    status = replication.main(arguments)
    return status, json.loads((output / "replication.json").read_text())


def test_our_run_under_any_other_path_is_refused_by_what_it_holds(tmp_path, small_data):
    ours = revision_run(tmp_path / "ours", small_data.tokenizer, 0, 0)
    seed = revision_run(tmp_path / "seed", small_data.tokenizer, 1, 1)
    copy = shutil.copytree(ours, tmp_path / "copy")  # a copy of the run folder: another path, the same weights
    for reference in (str(copy), f"{ours}/revisions"):
        with pytest.raises(UserError, match=f"the reference {reference} holds our run's weights at step 8 "):
            check(ours, [reference], small_data, tmp_path / "out")
    # A seed given twice, as its run and as its revisions: the same weights at every step read.
    with pytest.raises(UserError, match=f"the references {seed} and {seed}/revisions hold the same weights at every "
                                        r"step read \(0, 1, 8\): a reference given twice"):
        check(ours, [seed, f"{seed}/revisions"], small_data, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_run_of_our_seed_is_refused_among_several_references_and_noted_as_the_one(tmp_path, small_data):
    ours = revision_run(tmp_path / "ours", small_data.tokenizer, 0, 0)
    seed = revision_run(tmp_path / "seed", small_data.tokenizer, 1, 1)
    twin = revision_run(tmp_path / "twin", small_data.tokenizer, 0, 5)  # our init, trained otherwise
    with pytest.raises(UserError, match=f"the reference {twin} starts from our run's init \\(it holds our run's "
                                        r"weights at step 0, 1\)"):
        check(ours, [seed, twin], small_data, tmp_path / "out")
    status, result = check(ours, [twin], small_data, tmp_path / "one")
    assert status == 0 and "starts from our run's init" in result["references_read"][0]["note"]
    # Another init that records our seed and first batch is a run of our seed too, among several.
    from cram.data.causal import first_batch_fingerprint, load_causal_data

    small_data.tokenizer.save_pretrained(tmp_path / "tokenizer")
    digest = first_batch_fingerprint(load_causal_data(small_data.prefix, 32, 320, str(tmp_path / "tokenizer"), None,
                                                      8 * 8).sequences, 8)
    ours = revision_run(tmp_path / "ours-seeded", small_data.tokenizer, 0, 0, seed=7, first_batch=digest)
    others = [revision_run(tmp_path / f"seeded{init}", small_data.tokenizer, init, init, seed=seed,
                           first_batch=digest) for init, seed in ((1, 8), (2, 7))]
    with pytest.raises(UserError, match=rf"the reference {others[1]} starts from our run's init \(it records our "
                                        r"seed \(7\) and first batch\)"):
        check(ours, others, small_data, tmp_path / "out")


def test_a_reference_holding_anothers_weights_is_left_out_naming_why(tmp_path, small_data):
    ours = revision_run(tmp_path / "ours", small_data.tokenizer, 0, 0)
    first = revision_run(tmp_path / "first", small_data.tokenizer, 1, 1)
    second = revision_run(tmp_path / "second", small_data.tokenizer, 2, 2)
    # EleutherAI/pythia#203's pattern: an init of its own at step 0, the first reference's weights at step 1.
    odd = revision_run(tmp_path / "odd", small_data.tokenizer, 3, 3)
    shutil.rmtree(Path(odd) / "revisions" / "step1")
    shutil.copytree(Path(first) / "revisions" / "step1", Path(odd) / "revisions" / "step1")
    status, result = check(ours, [first, second, odd], small_data, tmp_path / "out", "--steps", "8")
    assert result["references"] == [first, second] and len(result["rows"][0]["references"]) == 2
    (left_out,) = [record for record in result["references_read"] if record["left_out"]]
    assert left_out["location"] == odd and left_out["left_out"] == f"holds the same weights as {first} at step 1"
    assert f"| {odd} | — |" in (tmp_path / "out" / "replication.md").read_text()
    # Two of three left out: too few to judge by.
    with pytest.raises(UserError, match=r"cannot judge: 1 of the 2 references hold weights of their own"):
        check(ours, [first, odd], small_data, tmp_path / "too-few", "--steps", "8")


@pytest.mark.parametrize("whole", [True, False])
def test_a_revision_holding_another_steps_weights_is_left_out(tmp_path, small_data, whole):
    # EleutherAI/pythia#205 (a branch serving the final model whole) and #206 (its first shard alone).
    steps = (0, 1, 8, 16)
    ours = revision_run(tmp_path / "ours", small_data.tokenizer, 0, 0, steps)
    seeds = [revision_run(tmp_path / f"seed{seed}", small_data.tokenizer, seed, seed, steps) for seed in (1, 2, 3)]
    served = Path(seeds[2]) / "revisions"
    if whole:
        shutil.rmtree(served / "step8")
        shutil.copytree(served / "step16", served / "step8")
    else:
        model = GPTNeoXForCausalLM.from_pretrained(served / "step8")
        final = GPTNeoXForCausalLM.from_pretrained(served / "step16")
        model.gpt_neox.embed_in.weight.data.copy_(final.gpt_neox.embed_in.weight.data)
        model.save_pretrained(served / "step8")
    status, result = check(ours, seeds, small_data, tmp_path / "out", "--steps", "0,8,16")
    (left_out,) = [record for record in result["references_read"] if record["left_out"]]
    expected = ("its revisions step8 and step16 hold the same weights" if whole
                else "its revision step16 holds 1 of step8's 10 weight matrices")
    assert left_out["location"] == seeds[2] and left_out["left_out"].startswith(expected), left_out
    # Step 0 and step 1 of one run hold the same weights, as expected: nothing is left out for that.
    assert all(not record["left_out"] for record in result["references_read"][:2])
    with pytest.raises(UserError, match=f"cannot judge: 0 of the 1 references .*{seeds[2]} its revision"):
        check(ours, [seeds[2]], small_data, tmp_path / "alone", "--steps", "0,8,16")


@pytest.mark.parametrize("summary, message", [
    ('{"optimizer_steps": ', r"cannot read .*summary.json \(JSONDecodeError\)"),
    ('{"optimizer_steps": "8"}', r"summary.json records optimizer_steps '8', not a count of steps"),
    ('[8]', r"cannot read .*summary.json \(TypeError\)"),
])
@pytest.mark.parametrize("whose", ["ours", "seed"])
def test_a_damaged_summary_anywhere_is_refused_in_one_sentence(tmp_path, small_data, summary, message, whose):
    runs = {name: revision_run(tmp_path / name, small_data.tokenizer, seed, seed)
            for seed, name in enumerate(("ours", "seed"))}
    (Path(runs[whose]) / "summary.json").write_text(summary)
    with pytest.raises(UserError, match=message):
        check(runs["ours"], [runs["seed"]], small_data, tmp_path / "out")


@pytest.mark.parametrize("reference", ["", "  "])
def test_an_empty_reference_is_refused_naming_it(tmp_path, tiny_model, reference):
    ours = fake_run(tmp_path / "ours", tiny_model)
    with pytest.raises(UserError, match=f"--reference {reference!r} names nothing"):
        replication.main([ours, "--reference", reference, "--data", "unread", "--heldout", "unread"])


def test_held_out_text_shorter_than_the_sequences_needed_is_refused_naming_how_many(tmp_path, small_data,
                                                                                  english_texts):
    ours = revision_run(tmp_path / "ours", small_data.tokenizer, 0, 0)
    seed = revision_run(tmp_path / "seed", small_data.tokenizer, 1, 1)
    document = english_texts[40][:240]  # one document of a few sequences
    short = write_pile_split(tmp_path / "one.jsonl.zst", [document])
    tokens = len(small_data.tokenizer(document)["input_ids"]) + 1  # and <|endoftext|>
    held = tokens // 33
    assert 0 < held < 8
    for budget in (["--budget", "1h"], ["--sequences", "8"]):
        needed = 32 if budget[0] == "--budget" else 8
        with pytest.raises(UserError, match=f"{short} holds {held} held-out sequences of 33 tokens \\(1 documents\\), "
                                            f"fewer than the {needed} the scoring needs"):
            replication.main([ours, "--reference", seed, "--data", small_data.prefix, "--heldout", str(short),
                              "--output", str(tmp_path / "out"), *budget])
    assert not (tmp_path / "out").exists()


def test_a_revisions_digest_is_of_its_weight_values_as_read():
    weights = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    weights[0, 0] = 0.0
    flipped = weights.clone()
    flipped[0, 0] = -0.0  # EleutherAI/pythia#203: branches that differ in signed zeros alone
    digest = weight_digest([("gpt_neox.embed_in.weight", weights), ("gpt_neox.final_layer_norm.bias", torch.zeros(3))])
    assert list(digest.matrices) == ["gpt_neox.embed_in.weight"]  # the matrices, not the 1-D weights
    assert digest.same(weight_digest([("module.gpt_neox.embed_in.weight", flipped)]))  # DDP's name, −0
    half = weights.half()
    assert weight_digest([("w", half)]).same(weight_digest([("w", half.float())]))  # fp16 read as its values
    assert not weight_digest([("w", half)]).same(weight_digest([("w", weights)]))  # rounded: other values
    assert weight_digest([("w", weights), ("v", weights + 1)]).shared(weight_digest([("x", weights)])) == 1


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A Hub stand-in the check's process talks to, with a Hub cache of the test's own."""
    from huggingface_hub import constants, hf_api

    with HubStandIn() as stand_in:
        monkeypatch.setattr(constants, "ENDPOINT", stand_in.endpoint)  # what HF_ENDPOINT sets as it loads
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            stand_in.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(hf_api.api, "endpoint", stand_in.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        yield stand_in


def pushed(hub: HubStandIn, repo: str, run: str) -> None:
    """`run`'s revisions as the Hub repository `repo`'s stepN branches."""
    revisions = sorted((Path(run) / "revisions").iterdir())
    hub.repos[repo] = StoredRepo(private=False, branches={"main": {}} | {
        revision.name: {file.name: file.read_bytes() for file in revision.iterdir()} for revision in revisions},
        commits={"main": []} | {revision.name: [f"{revision.name}"] for revision in revisions})


def test_the_digests_of_hub_revisions_found_good_are_kept_for_the_next_check(tmp_path, small_data, hub,
                                                                           digest_cache):
    ours = revision_run(tmp_path / "ours", small_data.tokenizer, 0, 0)
    for seed in (1, 2):
        pushed(hub, f"lab/seed{seed}", revision_run(tmp_path / f"seed{seed}", small_data.tokenizer, seed, seed))
    references = ["lab/seed1", "lab/seed2"]
    status, result = check(ours, references, small_data, tmp_path / "first", "--steps", "8")
    assert status == 0 and [record["digests_from_cache"] for record in result["references_read"]] == [[], []]
    assert [list(record["weights"]) for record in result["references_read"]] == [["0", "1", "8"]] * 2
    assert len(json.loads(digest_cache.read_text())) == 6  # two references, three revisions each
    requests = len(hub.requests)
    status, again = check(ours, references, small_data, tmp_path / "second", "--steps", "8")
    assert [record["digests_from_cache"] for record in again["references_read"]] == [[0, 1, 8], [0, 1, 8]]
    assert again["references_read"] == [{**record, "digests_from_cache": [0, 1, 8]}
                                        for record in result["references_read"]]
    # Steps 0 and 1, read only to verify, are not asked for again; step 8, scored, is.
    asked = [request.path for request in hub.requests[requests:] if "/resolve/" in request.path]
    commits = {step: {hub.head(reference, f"step{step}") for reference in references} for step in (0, 1, 8)}
    assert not [path for path in asked if path.split("/")[4] in commits[0] | commits[1]], asked
    assert [path for path in asked if path.split("/")[4] in commits[8]], asked
    # A reference left out is not remembered: its digests are read again next time.
    pushed(hub, "lab/odd", revision_run(tmp_path / "odd", small_data.tokenizer, 3, 3))
    hub.repos["lab/odd"].branches["step1"] = dict(hub.repos["lab/seed1"].branches["step1"])
    hub.repos["lab/odd"].commits["step1"].append("step1 of lab/seed1")
    status, result = check(ours, [*references, "lab/odd"], small_data, tmp_path / "third", "--steps", "8")
    assert result["references_read"][2]["left_out"] == "holds the same weights as lab/seed1 at step 1"
    assert not [key for key in json.loads(digest_cache.read_text()) if key.startswith("lab/odd@")]


def test_a_far_reference_is_named_in_the_report_with_the_verdict_without_it(tmp_path, small_data):
    ours = revision_run(tmp_path / "ours", small_data.tokenizer, 0, 0)
    seeds = [revision_run(tmp_path / f"seed{seed}", small_data.tokenizer, seed, seed) for seed in (1, 2, 3)]
    far = revision_run(tmp_path / "far", small_data.tokenizer, 4, 4, noise=0.5)  # trained far from the others
    status, result = check(ours, [*seeds, far], small_data, tmp_path / "out", "--steps", "8")
    screening = result["screening"]
    assert screening["far"] == far and screening["largest_z"][far] > screening["bound"] > max(
        screening["largest_z"][seed] for seed in seeds)
    # Four references: named, kept in the band, and the verdict without it given beside.
    assert not screening["left_out"] and screening["other"]["references"] == seeds
    assert result["band_references"] == [*seeds, far]
    assert f"{far} is far from the other references" in result["verdict"]
    assert "the band keeps it" in result["verdict"] and "without it, the verdict would be" in result["verdict"]
    assert "Leave-one-out screening" in (tmp_path / "out" / "replication.md").read_text()
