"""Run on several processes (torchrun): three optimizer steps of the shared loop at an accumulation of 8 on a small
crammed BERT, counting the collectives each step calls; rank N writes rank-N.json to the folder given as the
argument: per step, the micro-batches drawn, the blocking collectives on the default (training-device) process
group, and those on any other group.

A step's count runs from the end of the step before (or the loop's start) to the end of its own optimizer update,
so it holds the reading before the step, the readings between its micro-batches and the log row of the step before.
"""

import inspect
import json
import sys
from pathlib import Path

import torch
import torch.distributed

from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.train.accelerator import build_accelerator
from cram.train.budget import StepClock
from cram.train.loop import train
from cram.train.preemption import Preemption
from cram.train.state import TrainState

ACCUMULATION = 8
STEPS = 3
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "barrier", "gather",
               "scatter", "all_to_all", "all_to_all_single")
events: list[str] = []


def counted(collective):
    signature = inspect.signature(collective)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if not bound.arguments.get("async_op", False):
            default = group is None or group is torch.distributed.group.WORLD
            events.append("default" if default else "other")
        return collective(*args, **kwargs)

    return call


for name in COLLECTIVES:  # as the loop and Accelerate call them: through the `torch.distributed` namespace
    setattr(torch.distributed, name, counted(getattr(torch.distributed, name)))


def micro_batches(vocab_size: int, seq_len: int, masked_per_sequence: int):
    """Micro-batches of 2 sequences, each with the count of masked positions the model's sparse prediction takes."""
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    while True:
        events.append("micro_batches")
        input_ids = torch.randint(5, vocab_size, (2, seq_len), generator=generator)
        masked = torch.rand(2, seq_len, generator=generator).argsort(dim=1)[:, :masked_per_sequence]
        labels = torch.full_like(input_ids, -100).scatter(1, masked, input_ids.gather(1, masked))
        yield {"input_ids": input_ids, "labels": labels, "masked_per_sequence": masked_per_sequence}


def per_step() -> list[dict]:
    steps, current = [], {"micro_batches": 0, "default": 0, "other": 0}
    for event in events:
        if event == "step":
            steps.append(current)
            current = {"micro_batches": 0, "default": 0, "other": 0}
        else:
            current[event] += 1
    return [*steps, {**current, "after_the_last_step": True}]


def main(folder: Path) -> None:
    accelerator = build_accelerator("fp32", "false", None, str(folder))
    config = CrammedBertConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=16, hidden_size=32,
                                           num_hidden_layers=1, intermediate_size=64, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0)
    model = CrammedBertForMaskedLM(config)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    optimizer_step = optimizer.step

    def step(*args, **kwargs):
        result = optimizer_step(*args, **kwargs)
        events.append("step")
        return result

    optimizer.step = step
    events.clear()
    batches = micro_batches(config.vocab_size, 16, round(config.sparse_prediction * 16))
    train(model, optimizer, batches, accelerator, StepClock(STEPS), TrainState(),
          peak_lr=1e-3, lr_shape=lambda progress: 1.0, accumulation_at=lambda pace: ACCUMULATION,
          max_grad_norm=0.5, log_every=1, show_progress=False, preemption=Preemption())
    record = folder / f"rank-{accelerator.process_index}.json"
    record.write_text(json.dumps({"steps": per_step(), "num_processes": accelerator.num_processes}))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
