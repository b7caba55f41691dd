"""Benchmark: a preset's training speed per sequence at several micro-batch sizes, side by side.

    python -m cram.bench.micro_batch [--preset small] [--sizes 8 16 32 64] [--rounds 6] [--vocab 8192]

Each step is one micro-batch and one optimizer update (a short budget's steps, before the ramp accumulates):
forward and backward of crammed BERT on random 128-token blocks with a quarter of the positions masked, then
AdamW. The sizes alternate round by round, two steps each, after two warm-up steps each, so load on the machine
affects them alike; the table reports each size's median seconds per sequence and its speed per sequence
relative to the largest size. This is what `recipes/cram.py`'s CPU micro-batch for short budgets rests on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cram.models.crammed_bert import PRESETS, CrammedBertConfig, CrammedBertForMaskedLM
from cram.models.crammed_bert_recipe import crammed_bert_recipe
from cram.train.optim import build_adamw

SEQ_LEN = 128


def seconds_per_sequence(preset: str, sizes: list[int], rounds: int, vocab_size: int) -> dict[int, float]:
    """The median seconds per sequence of each micro-batch size, the sizes alternating round by round."""
    torch.manual_seed(0)
    config = CrammedBertConfig.from_preset(preset, vocab_size=vocab_size, max_position_embeddings=SEQ_LEN)
    model = CrammedBertForMaskedLM(config)
    optimizer = build_adamw(model, *crammed_bert_recipe(preset).adamw_settings)

    def step(size: int) -> None:
        input_ids = torch.randint(5, vocab_size, (size, SEQ_LEN))
        labels = torch.full_like(input_ids, -100)
        labels[:, ::4] = input_ids[:, ::4]
        # The count cram's collator guarantees, so the step predicts those positions only, as the recipe's does.
        model(input_ids=input_ids, labels=labels, masked_per_sequence=SEQ_LEN // 4).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for size in sizes:  # warm-up
        for _ in range(2):
            step(size)
    timings: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(rounds):
        for size in sizes:
            started = time.perf_counter()
            for _ in range(2):
                step(size)
            timings[size].append((time.perf_counter() - started) / (2 * size))
    return {size: statistics.median(values) for size, values in timings.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", choices=list(PRESETS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 16, 32, 64], help="micro-batch sizes to time")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds, two steps of each size per round")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size; unset means the preset's")
    options = parser.parse_args(argv)
    sizes = sorted(set(options.sizes))
    vocab_size = options.vocab or PRESETS[options.preset]["vocab_size"]
    medians = seconds_per_sequence(options.preset, sizes, options.rounds, vocab_size)
    largest = medians[sizes[-1]]
    print(f"{options.preset}, {torch.get_num_threads()} threads, one update per micro-batch of {SEQ_LEN}-token blocks")
    print(f"| micro-batch | ms per sequence | speed per sequence vs {sizes[-1]} |")
    print("|---:|---:|---:|")
    for size in sizes:
        print(f"| {size} | {1000 * medians[size]:.2f} | {largest / medians[size]:.2f}x |")


if __name__ == "__main__":
    main()
