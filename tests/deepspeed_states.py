"""Writes the DeepSpeed training states the recipe can leave behind, one process each, with the weights the engine
held: `python tests/deepspeed_states.py FOLDER` makes FOLDER/NAME/pytorch_model (the tag Accelerate's save_state
gives) and FOLDER/NAME/expected.pt for each configuration in STATES. One process for them all: DeepSpeed's import
and its process group are the cost, not the tiny model's step."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# (name, ZeRO stage, precision): bf16 at stage 1 with fp32 accumulation is DeepSpeed's BF16_Optimizer, as the
# recipe's and the planner's configurations ask for (data_types.grad_accum_dtype fp32 at stages 1 and 2).
# DeepSpeed's CPU accelerator refuses fp16, so fp16 states are not among them.
STATES = [("zero1-bf16", 1, "bf16"), ("zero2-bf16", 2, "bf16"), ("zero1-fp32", 1, "fp32"),
          ("zero2-fp32", 2, "fp32"), ("zero3-bf16", 3, "bf16")]


def write_state(folder: Path, stage: int, precision: str) -> None:
    import deepspeed
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(stage)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, max_position_embeddings=16))
    config = {"train_batch_size": 1, "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if stage in (1, 2):
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    # torch's AdamW handed in, as the recipes hand theirs: DeepSpeed's own "AdamW" would build its fused op first.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    tokens = torch.randint(0, 64, (1, 8))
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(str(folder), tag="pytorch_model")
    weights = engine._zero3_consolidated_16bit_state_dict() if stage == 3 else engine.module.state_dict()
    torch.save({"optimizer": type(engine.optimizer).__name__,
                "weights": {name: tensor.detach().clone() for name, tensor in weights.items()}},
               folder / "expected.pt")


if __name__ == "__main__":
    import socket

    with socket.socket() as probe:  # a free port, as other tests' process groups may run beside this one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from cram.train.deepspeed_setup import skip_deepspeed_shared_memory_op

    skip_deepspeed_shared_memory_op()  # as the recipes' DeepSpeed launches on the CPU do: no op built on start
    for name, stage, precision in STATES:
        write_state(Path(sys.argv[1]) / name, stage, precision)
