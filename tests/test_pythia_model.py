"""The Pythia size table and recipe: exact released parameter counts (on the meta device), schedule, checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXForCausalLM

from cram.errors import UserError
from cram.models.pythia import (
    PYTHIA_SIZES,
    embedding_parameters,
    gpt_neox_parameters,
    pythia_checkpoint_steps,
    pythia_config,
    pythia_recipe,
)

# The released models' counts (EleutherAI/pythia README): total, and without the input and output embeddings.
RELEASED = {
    "pythia-14m": (14_067_712, 1_189_888),
    "pythia-31m": (30_494_720, 4_739_072),
    "pythia-70m": (70_426_624, 18_915_328),
    "pythia-160m": (162_322_944, 85_056_000),
    "pythia-410m": (405_334_016, 302_311_424),
    "pythia-1b": (1_011_781_632, 805_736_448),
    "pythia-1.4b": (1_414_647_808, 1_208_602_624),
    "pythia-2.8b": (2_775_208_960, 2_517_652_480),
    "pythia-6.9b": (6_857_302_016, 6_444_163_072),
    "pythia-12b": (11_846_072_320, 11_327_027_200),
}


def test_the_table_holds_the_ten_sizes():
    assert list(PYTHIA_SIZES) == list(RELEASED)


@pytest.mark.parametrize("name", RELEASED)
def test_parameter_counts_equal_the_released_models(name):
    config = pythia_config(name)
    with torch.device("meta"):  # no weights allocated, even for 12b
        model = GPTNeoXForCausalLM(config)
    total = sum(param.numel() for param in model.parameters())
    assert (total, total - embedding_parameters(config)) == RELEASED[name]
    assert gpt_neox_parameters(config) == total  # the count the memory check makes without building a model


def test_the_architecture_is_gpt_neox_as_released():
    config = pythia_config("pythia-1b")
    rope = config.rope_parameters
    assert (rope["partial_rotary_factor"], rope["rope_theta"], config.use_parallel_residual) == (0.25, 10000, True)
    assert not config.tie_word_embeddings
    assert (config.layer_norm_eps, config.intermediate_size, config.max_position_embeddings) == (1e-5, 8192, 2048)


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    recipe = pythia_recipe("pythia-1b")
    assert recipe.warmup_steps == 1430
    assert recipe.lr_at(0) == 0.0
    assert recipe.lr_at(715) == pytest.approx(1.5e-4)
    assert recipe.lr_at(1430) == pytest.approx(3e-4)
    assert recipe.lr_at(72_215) == pytest.approx(0.55 * 3e-4)  # half-way through the cosine
    assert recipe.lr_at(143_000) == pytest.approx(3e-5)


def test_the_recipe_is_the_published_one():
    recipe = pythia_recipe("pythia-160m")
    assert (recipe.peak_lr, recipe.global_batch_size, recipe.seq_len, recipe.train_steps) == (6e-4, 1024, 2048, 143_000)
    assert (recipe.betas, recipe.eps, recipe.weight_decay, recipe.max_grad_norm) == ((0.9, 0.95), 1e-8, 0.01, 1.0)
    assert recipe.precision == "fp16" and pythia_recipe("pythia-1b").precision == "bf16"


def test_the_154_checkpoint_steps():
    steps = pythia_checkpoint_steps()
    assert len(steps) == 154
    assert steps[:12] == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
    assert steps[-1] == 143_000 and all(b - a == 1000 for a, b in zip(steps[11:], steps[12:], strict=False))
    assert pythia_checkpoint_steps(20) == [0, 1, 2, 4, 8, 16]


def test_an_unknown_size_is_refused_by_name():
    with pytest.raises(UserError, match="unknown Pythia size 'pythia-7b': choose one of pythia-14m"):
        pythia_config("pythia-7b")
