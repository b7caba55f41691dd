"""The crammed-BERT training recipe of each preset, in one place, as `pythia_recipe` is for Pythia.

`crammed-bert` is the paper's run: cramming's `python pretrain.py arch=crammed-bert train=bert-o4
data=pile-readymade` (its README.md), for the budget of cfg_pretrain.yaml. Every published value names the file
under cramming/config/ and the key it comes from. `small` and `tiny` are this toolkit's smoke-run and demo sizes,
with the paper's optimizer and schedule at smaller batches. Kept apart from `cram.models.crammed_bert`, which is
copied beside every checkpoint and must not import `cram`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cram.data.readymade import READYMADE
from cram.errors import UserError
from cram.models.crammed_bert import CrammedBertConfig

RAMP_END = 0.6  # train/bert-o4.yaml: batch_size_ramp 0.60 (the target batch is reached at 60 % of the budget)


@dataclass(frozen=True)
class CrammedBertRecipe:
    """How one preset pretrains: its data, batch shape, budget, optimizer and schedule."""

    preset: str
    data: str  # the preset's data unless --data names other
    target_batch_size: int  # sequences per optimizer step once the ramp is done
    micro_batch_size: int  # sequences per forward pass per process
    # Under a wall-clock budget the ramp aims at the largest batch up to target_batch_size that still leaves enough
    # optimizer steps at the measured speed: a small model on small hardware would otherwise take too few steps.
    follows_budget: bool = False
    # The micro-batch on the CPU where the ramp follows the budget: a CPU step costs about its sequences, so smaller
    # micro-batches give the ramp more, smaller steps to choose from at little cost in speed.
    cpu_micro_batch_size: int | None = None
    min_steps: int = 300  # the optimizer steps a budget-following ramp leaves at least
    budget_hours: float = 24.0  # cfg_pretrain.yaml: budget
    seq_len: int = 128  # data/pile-readymade.yaml: seq_length
    ramp_end: float = RAMP_END
    lr: float = 1e-3  # train/bert-o4.yaml: optim.lr
    betas: tuple[float, float] = (0.9, 0.98)  # train/optim/adam.yaml: betas
    eps: float = 1e-12  # train/optim/adam.yaml: eps
    weight_decay: float = 0.01  # train/bert-o4.yaml: optim.weight_decay (limited_decay_keys: none on biases, norms)
    max_grad_norm: float = 0.5  # train/bert-o4.yaml: gradient_clipping

    @property
    def adamw_settings(self) -> tuple[float, tuple[float, float], float, float]:
        """(lr, betas, eps, weight_decay), in `cram.train.optim.build_adamw`'s order."""
        return self.lr, self.betas, self.eps, self.weight_decay

    def model_config(self, **overrides) -> CrammedBertConfig:
        """The preset's model as pretraining builds it: dropout off (train/bert-o4.yaml: pretrain_in_train_mode
        False), any field overridden."""
        return CrammedBertConfig.from_preset(
            self.preset, **{"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **overrides})


CRAMMED_BERT_RECIPES: dict[str, CrammedBertRecipe] = {
    # train/bert-o4.yaml: batch_size 8192; impl/_default.yaml: microbatch_size 128; data/pile-readymade.yaml.
    "crammed-bert": CrammedBertRecipe("crammed-bert", data=READYMADE, target_batch_size=8192, micro_batch_size=128),
    "small": CrammedBertRecipe("small", data="embedded", target_batch_size=1024, micro_batch_size=64,
                               follows_budget=True, cpu_micro_batch_size=16),
    "tiny": CrammedBertRecipe("tiny", data="embedded", target_batch_size=256, micro_batch_size=32,
                              follows_budget=True, cpu_micro_batch_size=16),
}


def crammed_bert_recipe(preset: str) -> CrammedBertRecipe:
    """The recipe of `preset` (crammed-bert, small or tiny)."""
    if preset not in CRAMMED_BERT_RECIPES:
        raise UserError(f"unknown preset {preset!r}: choose one of {', '.join(CRAMMED_BERT_RECIPES)}.")
    return CRAMMED_BERT_RECIPES[preset]
