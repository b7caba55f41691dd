"""The emitted launch config pair, read back by Accelerate's and DeepSpeed's own config classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.utils import DeepSpeedPlugin, DistributedType
from deepspeed.runtime.config import DeepSpeedConfig

from cram.plan.emit import accelerate_config, deepspeed_config, write_pair
from cram.plan.space import Candidate

REPO = Path(__file__).resolve().parents[1]
# What Accelerate fills from the model (its hidden size) when the JSON says "auto" (Accelerator._prepare_deepspeed).
HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")


@pytest.mark.parametrize("candidate", [Candidate("zero1"), Candidate("zero2", offload=True),
                                       Candidate("zero3", offload=True, checkpointing=True)])
def test_a_pair_under_a_folder_with_spaces_and_a_hash_reads_back_in_accelerate_and_deepspeed(tmp_path, candidate):
    folder = tmp_path / "runs" / "plan #2"
    accelerate_file = write_pair(candidate, folder, 4, False, "GPTNeoXLayer", hidden_size=768)
    launch = ClusterConfig.from_yaml_file(str(accelerate_file))
    assert launch.distributed_type == DistributedType.DEEPSPEED and launch.num_processes == 4
    deepspeed_file = Path(launch.deepspeed_config["deepspeed_config_file"])
    assert deepspeed_file == folder / "ds_configs" / f"plan-{candidate.name}.json" and deepspeed_file.exists()
    assert launch.deepspeed_config["zero3_init_flag"] is False
    plugin = DeepSpeedPlugin(hf_ds_config=str(deepspeed_file))
    assert plugin.zero_stage == candidate.zero_stage
    # The model-sized buckets are left to Accelerate, so none stays at DeepSpeed's 5e8-element default.
    assert plugin.is_auto("zero_optimization.reduce_bucket_size")
    if candidate.zero_stage == 3:
        assert all(plugin.is_auto(key) for key in HIDDEN_SIZE_KEYS)
    plugin.deepspeed_config_process(
        must_match=False, train_batch_size=8, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
        gradient_clipping=1.0, **{"bf16.enabled": True, "fp16.enabled": False},
        **{key: 768 * 768 for key in HIDDEN_SIZE_KEYS})
    parsed = DeepSpeedConfig(plugin.deepspeed_config)  # one process here: world size 1
    assert parsed.zero_config.stage == candidate.zero_stage
    assert parsed.zero_config.reduce_bucket_size == 768 * 768
    if candidate.zero_stage < 3:
        assert parsed.zero_config.allgather_bucket_size == 768 * 768
    # fp32 accumulation at stages 1 and 2; ZeRO-3 keeps the training dtype (fp32 there trains on NaN at deepspeed 0.16).
    assert parsed.grad_accum_dtype == ("fp32" if candidate.zero_stage < 3 else None)
    assert (parsed.zero_config.offload_optimizer is not None) == candidate.offload


def test_fsdp_and_plain_pairs_parse_as_the_launcher_reads_them(tmp_path):
    path = tmp_path / "a #b" / "fsdp.yaml"
    path.parent.mkdir()
    path.write_text(accelerate_config(Candidate("fsdp-grad-op"), 4, False, None, "GPTNeoXLayer"))
    fsdp = ClusterConfig.from_yaml_file(str(path))
    assert fsdp.distributed_type == DistributedType.FSDP
    assert fsdp.fsdp_config["fsdp_reshard_after_forward"] is False and fsdp.fsdp_config["fsdp_version"] == 2
    assert fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "GPTNeoXLayer"
    assert yaml.safe_load(accelerate_config(Candidate(), 1, False, None, "x"))["distributed_type"] == "NO"
    assert yaml.safe_load(accelerate_config(Candidate(), 2, True, None, "x"))["distributed_type"] == "MULTI_CPU"
    assert "offload_param" not in deepspeed_config(Candidate("zero2", offload=True), 64)["zero_optimization"]


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2-offload", "zero3", "zero3-offload"])
def test_the_repositorys_deepspeed_configs_are_the_planners_but_for_the_model_sized_all_gather_bucket(name):
    # The memory model counts what the emitted config allocates, so the recipes' own configs must allocate the same:
    # fp32 accumulation and model-sized buckets. Only the all-gather bucket, which Accelerate cannot fill from the
    # model, stays at DeepSpeed's default in the repository's files.
    emitted = deepspeed_config(Candidate(name.split("-")[0], offload=name.endswith("-offload")), 768)
    emitted["zero_optimization"].pop("allgather_bucket_size", None)
    assert json.loads((REPO / "ds_configs" / f"{name}.json").read_text()) == emitted


def test_zero3_asks_for_zero_init_where_the_recipe_builds_under_it():
    assert yaml.safe_load(accelerate_config(Candidate("zero3"), 8, False, Path("z.json"), "GPTNeoXLayer",
                                            zero_init=True))["deepspeed_config"]["zero3_init_flag"] is True
    assert yaml.safe_load(accelerate_config(Candidate("zero2"), 8, False, Path("z.json"), "GPTNeoXLayer",
                                            zero_init=True))["deepspeed_config"]["zero3_init_flag"] is False
    assert yaml.safe_load(accelerate_config(Candidate("zero3"), 8, False, Path("z.json"), "CrammedBertLayer",
                                            zero_init=False))["deepspeed_config"]["zero3_init_flag"] is False
    launch = yaml.safe_load((REPO / "accel_configs" / "8gpu-zero3-offload.yaml").read_text())
    assert launch["deepspeed_config"]["zero3_init_flag"] is True
