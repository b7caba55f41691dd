"""Pythia: pretrain a GPT-NeoX model of the Pythia suite with the published recipe.

    accelerate launch --config_file accel_configs/4xa100.yaml recipes/pythia.py --size pythia-1b \\
        --data pile/document --tokenizer EleutherAI/gpt-neox-20b --micro-batch-size 16

The recipe is EleutherAI's training configs' (models/*/pythia-*.yml at GPT-NeoX v1.0): 143,000 steps of
1024 sequences × 2048 tokens, Adam betas (0.9, 0.95), eps 1e-8, weight decay 0.1, GPT-NeoX's AnnealingLR (warm-up
over 1 % of the steps, then cosine until it meets 10 % of the peak near step 115,139), clipping 1.0, the released
init (small_init / wang_init; GPT-NeoX's defaults for 6.9b and 12b), fp16 with dynamic loss scaling from 2^12
(pythia-1b: bf16). pythia-1b's peak lr is its config's 2.5e-4, not the 3e-4 of the Pythia README's table. The global
batch is reached by accumulation over whatever processes the launch config starts (DeepSpeed's own under ZeRO).
The model is kept at Pythia's 154 checkpoint steps (0, 1, 2, 4 … 512, then every 1000) as plain Hugging Face
checkpoints in OUTPUT_DIR/revisions/stepN, pushed with --push-checkpoints as the Hub revisions stepN the released
models use (--revision-steps keeps fewer); training states are saved by time, and a preempted run continues with
--resume auto. On the pre-shuffled Pile, step k trains on exactly the sequences the released model saw at step k;
on a document-level Megatron file (the *_idxmaps release) it trains on the samples GPT-NeoX's own index gives
(built once and cached beside the file).
--stop-at-step N trains Pythia's first N steps: the schedule and the index stay those of the full run, so step k here
is step k there; --max-steps M is another, shorter recipe (warm-up, cosine and index scaled to M steps).
--continue-from NAME@stepN goes on from a kept model (a released revision, a run's, a GPT-NeoX checkpoint) at step N's
schedule and step N + 1's data, with GPT-NeoX's optimizer state where EleutherAI published it and zero Adam moments
where not.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# This script's folder must not shadow the `cram` package on the import path (recipes/cram.py lives there).
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

from accelerate.utils import set_seed

from cram.cli import OptionParser, option, parse_strictly, summary
from cram.data.causal import causal_data_ready, first_batch_fingerprint, load_causal_data
from cram.data.collator import causal_lm_batch
from cram.data.megatron import recorded_data_seed, recorded_deduplication
from cram.data.sampling import stream_loader
from cram.errors import UserError, run_cli
from cram.models.pythia_model import (
    PYTHIA_SIZES,
    build_pythia_model,
    check_size,
    embedding_parameters,
    gpt_neox_largest_module_parameters,
    gpt_neox_parameters,
    pythia_config,
)
from cram.models.pythia_recipe import (
    GLOBAL_BATCH,
    SEQUENCE_LENGTH,
    TRAIN_STEPS,
    PythiaRecipe,
    pythia_checkpoint_steps,
    pythia_recipe,
)
from cram.train.accelerator import launch_device_type, local_main_first
from cram.train.activation_checkpointing import enable_activation_checkpointing
from cram.train.budget import StepClock
from cram.train.checkpoint import STATE_FILE, read_checkpoint, state_folder_name
from cram.train.continuation import (
    ContinuingRun,
    check_continuation,
    continued_state_record,
    describe_continuation,
    describe_gpt_neox_continuation,
    load_revision_weights,
    resolve_revision,
    revision_ready,
    write_gpt_neox_continuation,
)
from cram.train.data_agreement import check_same_data
from cram.train.deepspeed_setup import configure_deepspeed
from cram.train.loss_scaling import fp16_loss_scaling
from cram.train.optim import build_adamw
from cram.train.precision import Precision, enable_tf32, gpu_has_bf16_units
from cram.train.revisions import parse_revision_steps
from cram.train.run import RecipeRun
from cram.train.run_options import RunOptions, check_run_options
from cram.train.state import TrainState
from cram.train.state_memory import check_model_fits
from cram.train.throughput import gpt_neox_flops_per_token

PythiaSizeName = Literal[tuple(PYTHIA_SIZES)]
PythiaPrecision = Literal["released", Precision]


@dataclass
class TrainingOptions:
    """Options that change the result; unset ones take the published recipe's value."""

    size: PythiaSizeName = option("pythia-1b", "model size")
    data: str | None = option(
        None, "a Megatron .bin/.idx prefix (e.g. the pre-shuffled Pile), a set made by prepare_data.py, "
              "pre-tokenized input_ids, or raw text files")
    tokenizer: str | None = option(
        None, "tokenizer folder or Hub name (needed for Megatron files: EleutherAI/gpt-neox-20b); unset for raw "
              "text trains a byte-level BPE on it")
    max_steps: int | None = option(
        None, "the schedule's length in optimizer steps: warm-up, cosine and GPT-NeoX's index of a document-level "
              "file all scale to it, so it is a shorter recipe, not Pythia's first steps (for those: --stop-at-step); "
              f"unset means the recipe's {TRAIN_STEPS}")
    stop_at_step: int | None = option(
        None, "stop after this step of the schedule, which stays full length (with the index): the run is the first "
              "N steps of Pythia's, its state saved at N to go on from with a later --stop-at-step and --resume auto")
    seq_len: int | None = option(None, f"tokens per sequence; unset means {SEQUENCE_LENGTH}")
    global_batch_size: int | None = option(None, f"sequences per optimizer step; unset means {GLOBAL_BATCH}")
    micro_batch_size: int = option(
        8, "sequences per forward pass per process (resumed on another number of processes: the largest up to this "
           "that splits the global batch evenly)")
    vocab_size: int | None = option(
        None, "embedding rows; unset means the size's (50304 for most); smaller fits a small local BPE")
    lr: float | None = option(
        None, "peak learning rate; unset means the size's config's (pythia-1b: 2.5e-4 per pythia-1b.yml, where the "
              "Pythia README's table says 3e-4)")
    seed: int = option(1234, "random seed (of the initial weights; the data order is the data's)")
    continue_from: str | None = option(
        None, "go on from a model kept at step N, at step N's schedule and step N + 1's data: a Hub name with its "
              "branch (EleutherAI/pythia-160m@step50000), a folder of revisions with the step (runs/pythia@step4), "
              "a stepN folder, or a GPT-NeoX checkpoint folder (neox-ckpt-…, the original suite's -v1 too); "
              "GPT-NeoX's optimizer state or a pushed training state is continued where there is one, else Adam's "
              "moments start at zero")


@dataclass
class ImplementationOptions(RunOptions):
    """Options that change only speed, memory and bookkeeping."""

    output_dir: str = option(
        "runs/pythia", "where the run writes: the model lands in OUTPUT_DIR/final, training states in checkpoints/")
    precision: PythiaPrecision = option(
        "released", "released: fp16 with loss scaling from 2^12 (bf16 for pythia-1b, where pythia-1b-deduped trained "
                    "in fp16), or the nearest the device can do, said in the log")
    push_checkpoints: bool = option(
        False, "also push each revision (--revision-steps) to the Hub, as the revision stepN")
    push_training_states: bool = option(
        False, "with --push-checkpoints, also push the training state of each revision's step (saved there for it: "
               "at least 12 bytes per weight, said before step 0) beside its weights, as training_state/, which "
               "--continue-from NAME@stepN and --resume NAME@stepN resume from on another machine")
    revision_steps: str = option(
        "pythia", "the steps whose model is kept in OUTPUT_DIR/revisions/stepN for the replication check: pythia "
                  "(Pythia's checkpoint steps 0, 1, 2, 4 … 512, then every 1000, within the run), none, or steps and "
                  "every:N separated by commas, e.g. 0,512,every:10000")
    device_memory_gib: float | None = option(
        None, "memory per accelerator to check the size against; unset means the GPU's own (no check on the CPU)")


def parse_options() -> tuple[TrainingOptions, ImplementationOptions]:
    parser = OptionParser((TrainingOptions, ImplementationOptions), description=summary(__doc__))
    training, implementation = parse_strictly(parser)
    check_size(training.size)
    if training.data is None:
        raise UserError("no training data: pass --data with a Megatron .bin/.idx prefix, a prepared set or text files.")
    if not Path(training.data).exists() and not Path(training.data + ".bin").exists():
        raise UserError(f"the data path {training.data} does not exist: give an existing file, folder or .bin/.idx "
                        "prefix.")
    for name in ("max_steps", "stop_at_step", "seq_len", "global_batch_size", "vocab_size"):
        value = getattr(training, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name.replace('_', '-')} {value} is not positive: give a positive number.")
    schedule = training.max_steps or pythia_recipe(training.size).train_steps
    if training.stop_at_step is not None and training.stop_at_step > schedule:
        raise UserError(f"--stop-at-step {training.stop_at_step} is past the schedule's last step {schedule}: give a "
                        f"step up to {schedule}{' or a longer --max-steps' if training.max_steps else ''}.")
    check_run_options(implementation)
    if implementation.push_training_states and not implementation.push_checkpoints:
        raise UserError("--push-training-states pushes each state beside its revision: add --push-checkpoints "
                        "(and --push-to-hub ORG/NAME).")
    return training, implementation


def choose_precision(recipe: PythiaRecipe, asked: str, device_type: str) -> tuple[str, str | None]:
    """The --precision value to launch with, and a sentence for the log when it is not the released precision."""
    released = recipe.precision
    if asked == "released":
        if device_type != "cuda":
            return "auto", f"{recipe.name} trained in {released}; the CPU cannot, so this run uses --precision auto"
        if released == "bf16" and not gpu_has_bf16_units():
            return "fp16", f"{recipe.name} trained in bf16, which this GPU lacks; this run uses fp16"
        return released, None
    if asked != released:
        return asked, f"{recipe.name} trained in {released}; this run uses --precision {asked} as asked"
    return asked, None


def describe_schedule(
    max_steps: int, stop_at: int, pythia_steps: int, global_batch: int, seq_len: int | None = None
) -> str:
    """The run's steps in words: Pythia's schedule whole or its first steps, or a shorter recipe of --max-steps."""
    batch = f"{global_batch} × {seq_len} tokens" if seq_len else f"{global_batch} sequences"
    if max_steps == pythia_steps:
        schedule = f"Pythia's {max_steps} optimizer steps of {batch}"
    else:
        schedule = (f"{max_steps} optimizer steps of {batch} (--max-steps: warm-up, cosine and data order scaled to "
                    f"them, not Pythia's {pythia_steps})")
    if stop_at == max_steps:
        return schedule
    return f"the first {stop_at} of {schedule}, stopped there by --stop-at-step"


def main() -> None:
    # Parse: everything a user can get wrong is checked before any step runs.
    training, implementation = parse_options()
    recipe = pythia_recipe(training.size)
    precision, departure = choose_precision(recipe, implementation.precision, launch_device_type())
    max_steps = training.max_steps or recipe.train_steps  # the schedule's length, which sizes the index too
    stop_at = training.stop_at_step or max_steps
    revision_steps = parse_revision_steps(implementation.revision_steps, pythia_checkpoint_steps(), stop_at)
    seq_len = training.seq_len or recipe.seq_len
    global_batch = training.global_batch_size or recipe.global_batch_size
    peak_lr = training.lr or recipe.peak_lr
    config = pythia_config(training.size, max_position_embeddings=max(seq_len, recipe.seq_len))
    config.vocab_size = training.vocab_size or config.vocab_size
    run = RecipeRun("pythia", implementation, precision=precision, continue_from=training.continue_from)
    accelerator = run.accelerator
    # The global batch split over this launch's processes (again, where a saved run resumes on another count).
    split = run.split(global_batch, training.micro_batch_size)
    micro_batch, accumulation = split.micro_batch_size, split.micro_batches
    configure_deepspeed(accelerator, micro_batch, global_batch, recipe.max_grad_norm)
    scaling = recipe.loss_scaling
    replaced = fp16_loss_scaling(accelerator, scaling.initial_scale_power, scaling.window, scaling.hysteresis,
                                 scaling.min_scale)
    if run.is_main_process:
        print(f"schedule: {describe_schedule(max_steps, stop_at, recipe.train_steps, global_batch)}")
        if departure:
            print(f"precision: {departure} (mixed precision {accelerator.mixed_precision})")
        if replaced:
            print(f"fp16 loss scaling as released, replacing the DeepSpeed JSON's {', '.join(replaced)}")
    parameters, root = gpt_neox_parameters(config), embedding_parameters(config) + 2 * config.hidden_size
    check_model_fits(parameters, accelerator, implementation.device_memory_gib, training.size,
                     largest_layer_parameters=gpt_neox_largest_module_parameters(config),
                     block_parameters=(parameters - root) // config.num_hidden_layers, root_parameters=root)
    set_seed(training.seed)
    enable_tf32()

    # Build: data, model, optimizer.
    # The last argument: the sequences the run reads, which GPT-NeoX's index of a document-level file must cover.
    data_arguments = (training.data, seq_len, config.vocab_size, training.tokenizer, implementation.cache_dir,
                      max_steps * global_batch)
    # Other processes poll for the prepared data or index: no collective timeout while one process builds it.
    data = local_main_first(accelerator, lambda: load_causal_data(*data_arguments),
                            ready=lambda: causal_data_ready(*data_arguments))
    check_same_data(accelerator, data.identity)  # every machine's data, prepared or found there, is rank 0's
    if run.is_main_process:
        print(f"data: {data.description}")
    if run.resume_from is not None and (resumed_at := read_checkpoint(run.resume_from)[0].optimizer_steps) > stop_at:
        raise UserError(f"{run.resume_from} is at step {resumed_at}, past --stop-at-step {stop_at}: give a later step "
                        "to go on to, or start a new run in another --output-dir.")
    source = None  # the kept model a fresh run goes on from (a resumed one has its state)
    if training.continue_from is not None and run.resume_from is None:
        source = local_main_first(accelerator, lambda: resolve_revision(training.continue_from),
                                  ready=lambda: revision_ready(training.continue_from))
        check_continuation(source, ContinuingRun(
            size=training.size, shape=(config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                                       config.intermediate_size),
            vocab_size=config.vocab_size, tokenizer_vocabulary=data.tokenizer.get_vocab(), seq_len=seq_len,
            global_batch_size=global_batch, max_steps=max_steps, stop_at=stop_at,
            first_batch=first_batch_fingerprint(data.sequences, global_batch),
            deduplicated=recorded_deduplication(training.data), data_seed=recorded_data_seed(training.data),
            pythia_steps=recipe.train_steps,
            pythia_batch=recipe.global_batch_size, pythia_seq_len=recipe.seq_len))
    plugin = accelerator.state.deepspeed_plugin  # zero.Init only where the launch config asks for it
    model = build_pythia_model(training.size, config, zero_init=plugin is not None and plugin.is_zero3_init_enabled())
    if implementation.activation_checkpointing:
        enable_activation_checkpointing(model)
    optimizer = build_adamw(model, peak_lr, recipe.betas, recipe.eps, recipe.weight_decay)
    continued = None
    if source is not None and source.gpt_neox is not None:
        # GPT-NeoX's own training state, written as this run's state at its step, which the run resumes from.
        checkpoints = run.output_dir / "checkpoints"
        run.resume_from_state(local_main_first(
            accelerator, lambda: write_gpt_neox_continuation(source, model, optimizer, run.layout, checkpoints,
                                                             global_batch, seq_len),
            ready=lambda: (checkpoints / state_folder_name(source.step) / STATE_FILE).is_file()))
        if run.is_main_process:
            continued_from = read_checkpoint(run.resume_from)[0].continued_from
            print(describe_gpt_neox_continuation(continued_from, source.step * global_batch))
    elif source is not None:
        record = continued_state_record(source, load_revision_weights(model, source))
        # Step N's update done: the schedule stands at N less the updates fp16 overflows skipped (as our run
        # recorded them; a released revision records none), and the data at step N + 1's batch.
        skipped = source.progress.get("skipped_steps", 0)
        continued = TrainState(optimizer_steps=source.step, skipped_steps=skipped,
                               sequences=source.step * global_batch, tokens=source.step * global_batch * seq_len,
                               continued_from=record)
        if run.is_main_process:
            print(describe_continuation(source, record, continued.sequences))
    session = run.start(model, optimizer, training, facts={  # what a resumed run must share with the saved one
        # --stop-at-step may differ: a run stopped early goes on to a later step of the same schedule; and
        # --continue-from: a run goes on from another's state it pushed (or a continued run from its own).
        "training": {key: value for key, value in dataclasses.asdict(training).items()
                     if key not in ("stop_at_step", "continue_from")},
        "data": {"set": data.name, "sequences": len(data.sequences)},
    }, resolved={
        "max_steps": max_steps, "micro_batch_size": micro_batch, "stop_at_step": stop_at, "seq_len": seq_len,
        "global_batch_size": global_batch,
        "peak_lr": peak_lr,
        "accumulation": accumulation, "warmup_steps": recipe.warmup_fraction * max_steps,
        # The replication check compares this with the data it is given and with other runs'.
        "first_batch": first_batch_fingerprint(data.sequences, global_batch),
        "weight_decay": recipe.weight_decay, "vocab_size": config.vocab_size, "data": data.name,
        "deduplicated": recorded_deduplication(training.data),  # as its preparation recorded it, or None
        "released_precision": recipe.precision, "precision_departure": departure,
        "deepspeed_fp16": (accelerator.state.deepspeed_plugin.deepspeed_config.get("fp16")
                           if accelerator.state.deepspeed_plugin is not None else None),
    }, continued=continued)
    batches = iter(stream_loader(
        data.sequences, causal_lm_batch, start=session.state.sequences, micro_batch_size=micro_batch,
        process_index=accelerator.process_index, num_processes=accelerator.num_processes,
        num_workers=run.num_workers, pin_memory=run.device_type == "cuda",
    ))
    flops_per_token = gpt_neox_flops_per_token(
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size, seq_len)

    # Run: the step-based schedule, keeping the model at Pythia's checkpoint steps up to the stop; then report:
    # checkpoint, summary, curves, model card, Hub.
    card = dict(
        model=f"GPT-NeoX ({training.size})", config=config, auto_class="AutoModelForCausalLM",
        data=f"{training.data} ({len(data.sequences):,} sequences of {seq_len + 1} tokens)",
        budget=describe_schedule(max_steps, stop_at, recipe.train_steps, global_batch, seq_len),
        trust_remote_code=False,
    )
    go_on_from = [stop_at] if training.stop_at_step else []  # a run stopped early keeps its state to continue
    session.train(
        batches, StepClock(max_steps, stop_at=stop_at), tokenizer=data.tokenizer, card=card, peak_lr=peak_lr,
        lr_shape=recipe.lr_shape(max_steps), accumulation_at=lambda progress: accumulation,
        max_grad_norm=recipe.max_grad_norm, flops_per_token=flops_per_token, blocks=len(data.sequences),
        load_hint=LOAD_HINT.format(checkpoint=str(run.output_dir / "final")), revisions_at=revision_steps,
        states_at=go_on_from, push_states=implementation.push_training_states,
    )


LOAD_HINT = """    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained({checkpoint!r})
    tokenizer = AutoTokenizer.from_pretrained({checkpoint!r})"""


if __name__ == "__main__":
    run_cli(main)
