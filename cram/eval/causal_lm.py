"""Evaluate a causal language model (a Pythia checkpoint): held-out loss and perplexity on a slice of data, and
EleutherAI's lm-eval harness on the tasks the Pythia paper reports.

    python -m cram.eval.causal_lm runs/pythia/final --data pile/val --first 0 --count 1000
    python -m cram.eval.causal_lm runs/pythia/final --tasks lambada_openai,piqa --limit 200
    python -m cram.eval.causal_lm runs/pythia/final --tasks my_task --include-path my_tasks/

The held-out slice is sequences [first, first + count) of any source recipes/pythia.py trains on (a Megatron
.bin/.idx prefix, a prepared set, pre-tokenized or raw text), read exactly as training reads them. lm-eval loads
each task's data from the Hub (or its local cache); `--include-path` adds task YAML files of your own.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from cram.cli import summary
from cram.data.causal import load_causal_data
from cram.data.collator import causal_lm_batch
from cram.errors import UserError, run_cli
from cram.optional import import_optional

# The zero-shot tasks of the Pythia paper's evaluation table.
PYTHIA_TASKS = ("lambada_openai", "piqa", "winogrande", "wsc", "arc_easy", "arc_challenge", "sciq", "logiqa")


def load_model(checkpoint: str | Path) -> PreTrainedModel:
    try:
        return AutoModelForCausalLM.from_pretrained(checkpoint)
    except (OSError, ValueError) as err:
        raise UserError(f"could not load a causal language model from {checkpoint} ({type(err).__name__}): give a "
                        "checkpoint folder a training run wrote, e.g. runs/pythia/final.") from None


@torch.no_grad()
def heldout_loss(
    model: PreTrainedModel, data: str, *, first: int = 0, count: int = 100, seq_len: int | None = None,
    batch_size: int = 8, tokenizer: str | None = None, cache_dir: str | None = None,
) -> dict[str, float]:
    """Mean next-token loss and its perplexity over sequences [first, first + count) of `data`, each seq_len + 1
    tokens (seq_len defaults to the model's context), every position predicted as in training."""
    seq_len = seq_len or model.config.max_position_embeddings
    source = load_causal_data(data, seq_len, model.config.vocab_size, tokenizer, cache_dir)
    if first < 0 or count <= 0 or first + count > len(source.sequences):
        raise UserError(f"the slice [{first}, {first + count}) is not within the {len(source.sequences):,} sequences "
                        f"of {seq_len + 1} tokens in {data}: give --first and --count inside it.")
    model.eval()
    device = next(model.parameters()).device
    total_loss, total_tokens = 0.0, 0
    for start in range(first, first + count, batch_size):
        serials = list(range(start, min(start + batch_size, first + count)))
        batch = causal_lm_batch(source.sequences.__getitems__(serials))
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        loss = model(**batch).loss.item()
        tokens = batch["shift_labels"].numel()
        total_loss += loss * tokens
        total_tokens += tokens
    mean = total_loss / total_tokens
    return {"loss": mean, "perplexity": math.exp(mean), "sequences": count, "tokens": total_tokens}


@functools.cache
def task_manager(include_path: str | None, registry: bool = True):
    """lm-eval's task index, with the tasks in `include_path` and, with `registry`, lm-eval's own: built once a
    process, as indexing the registry reads every task's YAML in it (the slow part of a call)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=registry)


def tasks_index(tasks: list[str], include_path: str | None):
    """The index that `tasks` are looked up in: `include_path`'s alone where it holds each of them as a task of its
    own (a group there may list the registry's tasks), else with lm-eval's registry as well."""
    if include_path:
        own = task_manager(include_path, registry=False)
        if set(tasks) <= set(own.all_subtasks):  # tasks, not groups or tags
            return own
    return task_manager(include_path)


def run_lm_eval(
    checkpoint: str | Path, tasks: list[str], *, include_path: str | Path | None = None, limit: int | None = None,
    batch_size: int = 8, device: str | None = None,
) -> dict[str, dict[str, float]]:
    """Score `checkpoint` on lm-eval `tasks` (zero-shot); {task: {metric: value}} with lm-eval's metric names."""
    lm_eval = import_optional("lm_eval", package="lm-eval", extra="lm-eval", purpose="scoring lm-eval --tasks")
    manager = tasks_index(tasks, str(include_path) if include_path else None)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise UserError(f"lm-eval knows no task {', '.join(unknown)}: check the name, or give the folder of its YAML "
                        "with --include-path.")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(checkpoint), "dtype": "float32" if device == "cpu" else "auto"},
        tasks=tasks, task_manager=manager, limit=limit, batch_size=batch_size, device=device, log_samples=False,
        num_fewshot=0,
    )
    return {
        task: {metric: value for metric, value in scores.items() if isinstance(value, int | float)}
        for task, scores in results["results"].items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cram.eval.causal_lm", description=summary(__doc__))
    parser.add_argument("checkpoint", help="a checkpoint folder a training run wrote, e.g. runs/pythia/final")
    parser.add_argument("--data", help="held-out data: any source recipes/pythia.py reads")
    parser.add_argument("--first", type=int, default=0, help="first sequence of the held-out slice")
    parser.add_argument("--count", type=int, default=100, help="sequences in the held-out slice")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence; unset means the model's")
    parser.add_argument("--tokenizer", default=None, help="tokenizer of Megatron data (unset: the checkpoint's)")
    parser.add_argument("--tasks", default=None,
                        help=f"lm-eval tasks, comma-separated (Pythia's: {','.join(PYTHIA_TASKS)})")
    parser.add_argument("--include-path", default=None, help="a folder of lm-eval task YAML files of your own")
    parser.add_argument("--limit", type=int, default=None, help="at most this many examples per task")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    args = parser.parse_args(argv)
    if args.data is None and args.tasks is None:
        raise UserError("nothing to evaluate: pass --data for the held-out loss, --tasks for lm-eval, or both.")
    results: dict[str, object] = {}
    if args.data is not None:
        model = load_model(args.checkpoint)
        results["heldout"] = heldout_loss(
            model, args.data, first=args.first, count=args.count, seq_len=args.seq_len, batch_size=args.batch_size,
            tokenizer=args.tokenizer or args.checkpoint)
    if args.tasks is not None:
        results["lm_eval"] = run_lm_eval(args.checkpoint, args.tasks.split(","), include_path=args.include_path,
                                         limit=args.limit, batch_size=args.batch_size)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_cli(main)
