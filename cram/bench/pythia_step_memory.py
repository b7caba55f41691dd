"""Benchmark: peak memory of one Pythia training step, cram's model against transformers' GPTNeoXForCausalLM.

    python -m cram.bench.pythia_step_memory [--size pythia-14m] [--batch 4] [--seq-len 2048] [--device cpu]

Each contender runs one forward and backward of a micro-batch in a fresh process (so the peak is its own), in fp32
and under bf16 autocast: cram's model (`build_pythia_model`: causal SDPA, the loss in chunks) and transformers'
`GPTNeoXForCausalLM` with the same weights, as a Hugging Face user trains it (`model(**batch).loss`, whose loss
keeps the fp32 logits for backward). The peak is the process's resident memory (RSS) on the CPU, allocated memory
on a GPU; the table also gives each loss, which must agree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys

import torch


def one_step(size: str, contender: str, precision: str, batch: int, seq_len: int, device: str) -> dict:
    import transformers

    from cram.models.pythia_model import build_pythia_model, pythia_config

    torch.manual_seed(0)
    model = build_pythia_model(size, pythia_config(size), device=device)
    if contender == "transformers":
        plain = transformers.GPTNeoXForCausalLM(model.config)
        plain.load_state_dict(model.state_dict())
        model = plain.to(device)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len + 1), device=device)
    inputs = {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1], "shift_labels": tokens[:, 1:].contiguous()}
    autocast = torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with autocast:
        loss = model(**inputs).loss
    loss.backward()
    if device == "cuda":
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    return {"contender": contender, "precision": precision, "loss": loss.item(), "peak_gib": peak_gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="pythia-14m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", nargs=2, metavar=("CONTENDER", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_step(args.size, *args.one, args.batch, args.seq_len, args.device)))
        return
    print(f"{args.size}, one step at {args.batch} x {args.seq_len} on {args.device}")
    print(f"{'model':<14}{'precision':<11}{'loss':>9}{'peak GiB':>10}")
    for precision in ("fp32", "bf16"):
        for contender in ("cram", "transformers"):
            command = [sys.executable, "-m", "cram.bench.pythia_step_memory", "--size", args.size, "--batch",
                       str(args.batch), "--seq-len", str(args.seq_len), "--device", args.device,
                       "--one", contender, precision]
            row = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            print(f"{contender:<14}{precision:<11}{row['loss']:>9.4f}{row['peak_gib']:>10.2f}")


if __name__ == "__main__":
    main()
