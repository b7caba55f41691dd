"""The Pythia size table and recipe: exact released parameter counts (on the meta device), the released init (also
under ZeRO-3's zero.Init and through save_pretrained), GPT-NeoX's fused bias GELU and AnnealingLR, the configs'
hyper-parameters and fp16 loss scaling, checkpoints."""

from __future__ import annotations

import math
import os
import sys
import textwrap

import pytest
import torch
from launching import run
from transformers import GPTNeoXForCausalLM

from cram.errors import UserError
from cram.models import gpt_neox_training
from cram.models.pythia_model import (
    PYTHIA_SIZES,
    build_pythia_model,
    embedding_parameters,
    gpt_neox_largest_module_parameters,
    gpt_neox_parameters,
    pythia_config,
    weight_type,
)
from cram.models.pythia_recipe import pythia_checkpoint_steps, pythia_recipe
from cram.plan.models import build_model, model_config

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
    # ZeRO-3 gathers one module's own parameters at a time: the memory check counts the largest without a model.
    largest = max(sum(param.numel() for param in module.parameters(recurse=False)) for module in model.modules())
    assert gpt_neox_largest_module_parameters(config) == largest


def test_the_architecture_is_gpt_neox_as_released():
    config = pythia_config("pythia-1b")
    rope = config.rope_parameters
    assert (rope["partial_rotary_factor"], rope["rope_theta"], config.use_parallel_residual) == (0.25, 10000, True)
    assert not config.tie_word_embeddings
    assert (config.layer_norm_eps, config.intermediate_size, config.max_position_embeddings) == (1e-5, 8192, 2048)


def gpt_neox_bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX v1.0 megatron/model/activations.py `bias_gelu` as written there: what `bias-gelu-fusion: true`
    (every pythia-*.yml) runs on dense_h_to_4h's output and bias."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def test_the_mlp_is_gpt_neox_s_fused_bias_gelu_the_tanh_approximation_also_once_saved(tmp_path):
    torch.manual_seed(0)
    model = build_pythia_model("pythia-14m")
    model.save_pretrained(tmp_path / "saved")
    hidden = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(1)) * 4
    for built in (model, GPTNeoXForCausalLM.from_pretrained(tmp_path / "saved")):
        mlp = built.gpt_neox.layers[0].mlp
        with torch.no_grad():
            product = torch.nn.functional.linear(hidden, mlp.dense_h_to_4h.weight)  # the bias is added in bias_gelu
            expected = mlp.dense_4h_to_h(gpt_neox_bias_gelu(mlp.dense_h_to_4h.bias, product))
            torch.testing.assert_close(mlp(hidden), expected, rtol=1e-6, atol=1e-6)
            # The activation itself, bit for bit, in each precision GPT-NeoX trained in.
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                x = (hidden * 2).to(dtype)
                assert torch.equal(mlp.act(x), gpt_neox_bias_gelu(torch.zeros((), dtype=dtype), x)), dtype
            # The exact erf GELU differs by far more than the tolerance above: the test tells the two apart.
            assert (torch.nn.functional.gelu(hidden * 2) - mlp.act(hidden * 2)).abs().max() > 1e-4


def neox_annealing_lr(k: int, peak: float, steps: int = 143_000) -> float:
    """GPT-NeoX v1.0's AnnealingLR (cosine, megatron/learning_rates.py) written out apart from cram's own, W = 1 % of
    the steps, E = the steps."""
    warmup, end = 0.01 * steps, steps
    if k <= warmup:
        return peak * k / warmup
    return max(peak / 10, peak / 2 * (1 + math.cos(math.pi * (min(k, end - warmup) - warmup) / end)))


LR_STEPS = [0, 1, 1430, 1431, 71_500, 115_000, 115_200, 142_999]


@pytest.mark.parametrize("name", ["pythia-160m", "pythia-1b"])
def test_the_lr_curve_is_gpt_neox_annealing_lr_to_1e_12(name):
    recipe = pythia_recipe(name)
    shape = recipe.lr_shape(143_000)  # what the loop multiplies the peak by, at progress k / 143,000
    for k in LR_STEPS:
        expected = neox_annealing_lr(k, recipe.peak_lr)
        assert recipe.lr_at(k) == pytest.approx(expected, rel=1e-12, abs=0.0), k
        assert recipe.peak_lr * shape(k / 143_000) == pytest.approx(expected, rel=1e-12, abs=0.0), k
    assert recipe.lr_at(0) == 0.0 and recipe.lr_at(1430) == recipe.peak_lr
    # It meets min_lr near step 115,139 and stays flat: today's published cosine-to-10 % would stay above it.
    assert recipe.lr_at(115_138) > recipe.peak_lr / 10 and recipe.lr_at(115_140) == recipe.peak_lr / 10


def test_the_recipe_is_the_training_configs():
    recipe = pythia_recipe("pythia-160m")
    assert (recipe.peak_lr, recipe.global_batch_size, recipe.seq_len, recipe.train_steps) == (6e-4, 1024, 2048, 143_000)
    assert (recipe.betas, recipe.eps, recipe.weight_decay, recipe.max_grad_norm) == ((0.9, 0.95), 1e-8, 0.1, 1.0)
    assert recipe.precision == "fp16" and pythia_recipe("pythia-1b").precision == "bf16"
    assert pythia_recipe("pythia-1b").peak_lr == 2.5e-4  # pythia-1b.yml, not the README table's 3e-4
    scaling = recipe.loss_scaling
    assert (scaling.initial_scale_power, scaling.window, scaling.hysteresis, scaling.min_scale) == (12, 1000, 2, 1)


def type_stds(model: torch.nn.Module) -> dict[str, float]:
    """The std of each weight type, over all layers; LayerNorm gains and all biases checked exact."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        kind = weight_type(name)
        if kind is None:
            start = torch.ones_like(param) if name.endswith("norm.weight") else torch.zeros_like(param)
            assert torch.equal(param, start), name
        else:
            groups.setdefault(kind, []).append(param.detach().float().flatten())
    return {kind: torch.cat(values).std().item() for kind, values in groups.items()}


def small_and_wang(width: int, depth: int) -> dict[str, float]:
    small, wang = math.sqrt(2 / (5 * width)), 2 / (depth * math.sqrt(width))
    return {"embed_in": small, "query_key_value": small, "dense_h_to_4h": small, "lm_head": small,
            "attention.dense": wang, "dense_4h_to_h": wang}


def assert_stds(measured: dict[str, float], expected: dict[str, float]) -> None:
    assert measured.keys() == expected.keys()
    for kind, std in expected.items():
        assert measured[kind] == pytest.approx(std, rel=0.03), kind


@pytest.mark.parametrize("name, width, depth", [("pythia-14m", 128, 6), ("pythia-70m", 512, 6)])
def test_a_fresh_model_has_the_released_init(name, width, depth):
    torch.manual_seed(0)
    assert_stds(type_stds(build_pythia_model(name)), small_and_wang(width, depth))


def test_the_6_9b_and_12b_rule_is_gpt_neox_s_default():
    """Their configs name no init method: normal(0.02), and 0.02/sqrt(2L) for the two output projections."""
    for name in ("pythia-6.9b", "pythia-12b"):
        torch.manual_seed(0)
        shrunk = pythia_config(name, hidden_size=160, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=640, vocab_size=2000)
        scaled = 0.02 / math.sqrt(2 * 3)
        assert_stds(type_stds(build_pythia_model(name, shrunk)), {
            "embed_in": 0.02, "query_key_value": 0.02, "dense_h_to_4h": 0.02, "lm_head": 0.02,
            "attention.dense": scaled, "dense_4h_to_h": scaled})
    torch.manual_seed(0)  # the same shrunk config under a small_init size's rule is another init
    shrunk = pythia_config("pythia-14m", hidden_size=160, num_hidden_layers=3, num_attention_heads=4,
                           intermediate_size=640, vocab_size=2000)
    assert_stds(type_stds(build_pythia_model("pythia-14m", shrunk)), small_and_wang(160, 3))


def test_save_pretrained_at_step_0_holds_the_init_and_the_model_works(tmp_path):
    torch.manual_seed(0)
    model = build_pythia_model("pythia-14m")
    model.save_pretrained(tmp_path / "step0")
    loaded = GPTNeoXForCausalLM.from_pretrained(tmp_path / "step0")
    for (name, saved), (_, original) in zip(loaded.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(saved, original), name
    assert_stds(type_stds(loaded), small_and_wang(128, 6))
    reference = GPTNeoXForCausalLM(pythia_config("pythia-14m"))  # the rotary tables, rebuilt after the meta device
    assert torch.equal(model.gpt_neox.rotary_emb.inv_freq, reference.gpt_neox.rotary_emb.inv_freq)
    ids = torch.randint(0, 50_000, (1, 12))
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_the_planner_builds_the_released_init():
    torch.manual_seed(0)
    assert_stds(type_stds(build_model(model_config("pythia-14m", 2048))), small_and_wang(128, 6))


ZERO3_BUILD = textwrap.dedent("""
    import os, sys, torch, deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    from cram.train.deepspeed_setup import skip_deepspeed_shared_memory_op
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    skip_deepspeed_shared_memory_op()  # as the recipes' DeepSpeed launches on the CPU do
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    deepspeed.init_distributed("gloo")
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    from cram.models.pythia_model import build_pythia_model
    torch.manual_seed(0)
    model = build_pythia_model("pythia-14m")
    assert all(param.ds_tensor is not None and param.numel() == 0 for param in model.parameters())  # partitioned
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    torch.manual_seed(0)
    plain = build_pythia_model("pythia-14m", zero_init=False)  # the meta-device path, as without ZeRO-3
    assert all(torch.equal(weights[name], param) for name, param in plain.named_parameters())  # the same draws
    torch.save(weights, sys.argv[2])
    # A revision's weights (--continue-from), named as saved files name them, written into the partitions.
    from cram.models.pythia_model import load_pythia_weights
    saved_name = lambda name: "embed_out.weight" if name == "lm_head.weight" else name
    kept = {saved_name(name): (2 * param.detach()).half() for name, param in plain.named_parameters()}
    load_pythia_weights(model, kept)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        assert all(torch.equal(param, kept[saved_name(name)].float()) for name, param in model.named_parameters())
""")


@pytest.mark.launch
@pytest.mark.slow
def test_the_init_holds_under_zero3_zero_init(tmp_path):
    """Built under deepspeed.zero.Init (one gloo process), the gathered weights have the released init, drawn
    exactly as the meta-device build draws them from the same seed; a revision's float16 weights loaded into the
    partitions (`load_pythia_weights`, as --continue-from does) are what gathering them gives back."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    extensions = tmp_path / "torch-extensions"  # where DeepSpeed would build an op
    completed = run([sys.executable, "-c", ZERO3_BUILD, str(port), str(tmp_path / "weights.pt")],
                    env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert not list(extensions.glob("**/*shm*")), sorted(extensions.rglob("*"))  # nothing built: no g++ run
    weights = torch.load(tmp_path / "weights.pt")
    model = GPTNeoXForCausalLM(pythia_config("pythia-14m"))
    model.load_state_dict(weights, strict=False)
    assert set(weights) == {name for name, _ in model.named_parameters()}
    assert_stds(type_stds(model), small_and_wang(128, 6))


def test_the_154_checkpoint_steps():
    steps = pythia_checkpoint_steps()
    assert len(steps) == 154
    assert steps[:12] == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
    assert steps[-1] == 143_000 and all(b - a == 1000 for a, b in zip(steps[11:], steps[12:], strict=False))
    assert pythia_checkpoint_steps(20) == [0, 1, 2, 4, 8, 16]


def test_an_unknown_size_is_refused_by_name():
    with pytest.raises(UserError, match="unknown Pythia size 'pythia-7b': choose one of pythia-14m"):
        pythia_config("pythia-7b")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_output_layer_is_tied_as_transformers_ties_it(tied):
    config = pythia_config("pythia-14m", num_hidden_layers=2, vocab_size=512, tie_word_embeddings=tied)
    model = build_pythia_model("pythia-14m", config, device="cpu")
    plain = GPTNeoXForCausalLM(pythia_config("pythia-14m", num_hidden_layers=2, vocab_size=512,
                                             tie_word_embeddings=tied))
    count = sum(param.numel() for param in model.parameters())
    assert count == sum(param.numel() for param in plain.parameters()) == gpt_neox_parameters(config)
    # Built directly, as from_pretrained builds it: on the meta device transformers 5.0 ties only later, in
    # from_pretrained, where 5.17 ties at once, so ours must do what transformers' own class does in that release.
    with torch.device("meta"):
        direct = gpt_neox_training.GPTNeoXForCausalLM(config)
        plain_direct = GPTNeoXForCausalLM(pythia_config("pythia-14m", num_hidden_layers=2, vocab_size=512,
                                                        tie_word_embeddings=tied))
    assert sum(param.numel() for param in direct.parameters()) == sum(param.numel() for param in
                                                                      plain_direct.parameters())
    with torch.device("meta"):  # counted as the planner counts it
        assert sum(param.numel() for param in build_pythia_model("pythia-14m", config).parameters()) == count
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) is tied
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    model(input_ids=tokens, labels=tokens).loss.backward()  # the chunked loss
    plain(input_ids=tokens, labels=tokens).loss.backward()
    for (name, param), reference in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(param.grad, reference.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_forward_takes_transformers_arguments_in_transformers_order():
    config = pythia_config("pythia-14m", num_hidden_layers=2, vocab_size=512)
    model = build_pythia_model("pythia-14m", config, device="cpu")
    plain = GPTNeoXForCausalLM(pythia_config("pythia-14m", num_hidden_layers=2, vocab_size=512))
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[1, 10:] = 0
    with torch.no_grad():  # the second argument is the padding mask, as in transformers
        torch.testing.assert_close(model(tokens, mask).logits[mask.bool()], plain(tokens, mask).logits[mask.bool()])
        # labels where transformers has them: after input_ids, attention_mask, position_ids, inputs_embeds, cache
        torch.testing.assert_close(model(tokens, None, None, None, None, tokens).loss,
                                   plain(tokens, None, None, None, None, tokens).loss)
        torch.testing.assert_close(model(tokens, mask, labels=tokens).loss, plain(tokens, mask, labels=tokens).loss)
    with pytest.raises(TypeError, match="multiple values for argument 'attention_mask'"):
        model(tokens, mask, attention_mask=mask)
    with pytest.raises(TypeError, match="positional arguments"):
        model(*[None] * 20)
