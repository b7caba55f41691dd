"""GLUE fine-tuning and evaluation of any encoder checkpoint: one fresh copy per task and seed, through `Trainer`.

The protocol defaults are the "GLUE-sane" ones of the cramming paper, from cramming/config/eval/GLUE_sane.yaml
(optim.lr 4e-5, batch_size 16, scheduler cosine-decay, warmup_steps 0.1, epochs 5, max_seq_length 128,
eval_in_train_mode True: dropout on, gradient_clipping empty: none) and eval/optim/adam.yaml (betas 0.9, 0.98, eps
1e-6, weight_decay 0); dropout 0.1 is arch/crammed-bert.yaml's hidden_dropout_prob. Batches are padded to their
longest member (a multiple of 8), not to the max length.

Each finished (task, seed) writes `OUTPUT_DIR/results/TASK-seedN.json`; an evaluation started again of the same
checkpoint (by the digest of its files, not its path) with the same protocol skips those and runs only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

import cram  # noqa: F401 - registers the crammed-BERT Auto classes
from cram.cli import option
from cram.errors import UserError
from cram.eval.glue_data import (
    GlueTask,
    TaskData,
    check_classification_token_first,
    encode_texts,
    load_task,
    parse_tasks,
)
from cram.eval.glue_report import (
    bar_chart,
    eval_results,
    headline,
    markdown_report,
    seed_zero,
    summarize,
    task_metrics,
    write_json,
)
from cram.model_card import add_eval_results_to_card
from cram.optional import require_installed
from cram.train.accelerator import launch_device_type, use_cpu_cores
from cram.train.compilation import CompileChoice, resolve_compile_mode
from cram.train.precision import Precision, enable_tf32, resolve_precision
from cram.versions import check_installed_versions

# Small dev sets give noisy scores; these get --seeds fine-tunings, the large tasks --large-task-seeds.
SMALL_TASKS = ("cola", "mrpc", "stsb", "rte")
# The Linear layers LoRA adapts in crammed BERT (peft knows the names for Hugging Face's own architectures).
CRAMMED_LORA_TARGETS = ["qkv", "out", "up", "down"]
RESULTS_DIR = "results"
OPTIONS_FILE = "glue_options.json"


@dataclass
class GlueOptions:
    """What to evaluate, and the fine-tuning protocol (every value changes the result)."""

    model: str = option("runs/cram/final", "checkpoint folder or Hub name of an encoder (crammed BERT, BERT, …)")
    glue_dir: str | None = option(
        None, "the original GLUE download (DIR/CoLA/train.tsv, …); unset loads nyu-mll/glue from the Hub")
    tasks: str = option("all", "comma-separated: cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, or all")
    seeds: int = option(5, "fine-tuning seeds for the small, noisy tasks (CoLA, MRPC, STS-B, RTE); the median counts")
    large_task_seeds: int = option(1, "fine-tuning seeds for SST-2, QQP, MNLI and QNLI")
    epochs: float = option(5.0, "training epochs per fine-tuning")
    lr: float = option(4e-5, "peak learning rate")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.98, "AdamW beta2")
    eps: float = option(1e-6, "AdamW epsilon")
    weight_decay: float = option(0.0, "AdamW weight decay")
    batch_size: int = option(16, "examples per optimizer step (over all processes)")
    scheduler: str = option("cosine", "learning-rate schedule after warm-up (a transformers scheduler name)")
    warmup: float = option(0.1, "warm-up as a fraction of the training steps")
    # GLUE_sane.yaml: gradient_clipping is empty, so the original never clips (Trainer's own default is 1.0).
    max_grad_norm: float = option(0.0, "gradient clipping by global norm (0, the original's: none)")
    max_length: int = option(128, "tokens per example; longer pairs are truncated")
    dropout: float = option(0.1, "dropout while fine-tuning (checkpoints pretrained without it get it back)")
    max_train_examples: int | None = option(None, "use only the first N training examples of each task (smoke runs)")
    lora_r: int = option(0, "LoRA rank through peft (0: fine-tune every weight)")
    lora_alpha: float = option(16.0, "LoRA scaling numerator (the update is scaled by alpha / r)")


@dataclass
class GlueRunOptions:
    """Options that change only speed and bookkeeping."""

    output_dir: str = option("runs/glue", "where results, the report and the per-task cache go")
    precision: Precision = option("auto", "auto: bf16 where supported (as the cram recipe)")
    compile: CompileChoice = option(
        "auto", "torch.compile: auto (on for GPUs that support it), true, false, or one of its modes (true and auto "
        "compile in default)")
    eval_batch_size: int = option(128, "examples per evaluation batch")
    write_eval_results: bool = option(True, "also write eval_results.json beside a local checkpoint (for the Hub)")
    fresh: bool = option(
        False, "discard the output folder's results of an earlier evaluation (other model or protocol), start over")


@dataclass
class Evaluation:
    """Everything checked and loaded before the first fine-tuning."""

    options: GlueOptions
    run: GlueRunOptions
    tokenizer: PreTrainedTokenizerBase
    model_type: str
    tasks: list[TaskData]
    mixed_precision: str  # Accelerate's value: bf16, fp16 or no
    compile_mode: str | None  # torch.compile's mode, None: eager
    model_digest: str  # what was evaluated: see `model_digest`


def launch_state() -> PartialState:
    """The launch's processes. On the CPU Accelerate needs `cpu=True` to join them: without it, each process of a
    multi-process CPU launch counts itself the only one (each the main process, each with the whole batch)."""
    return PartialState(cpu=launch_device_type() == "cpu")


def seeds_for(task: GlueTask, options: GlueOptions) -> list[int]:
    return list(range(options.seeds if task.name in SMALL_TASKS else options.large_task_seeds))


def prepare_evaluation(options: GlueOptions, run: GlueRunOptions) -> Evaluation:
    """Check the options, the checkpoint, the tokenizer and every task's data; load the data. No training yet."""
    check_installed_versions()
    for module, package in (("sklearn", "scikit-learn"), ("scipy", "scipy")):
        require_installed(module, package=package, extra="glue", purpose="GLUE's metrics")
    tasks = parse_tasks(options.tasks)
    if options.seeds < 1 or options.large_task_seeds < 1:
        raise UserError("--seeds and --large-task-seeds must be at least 1: each task needs one fine-tuning.")
    if options.max_grad_norm < 0:
        raise UserError(
            f"--max-grad-norm {options.max_grad_norm} is negative: give 0 (no clipping) or a norm such as 1.0.")
    if options.lora_r < 0:
        raise UserError(f"--lora-r {options.lora_r} is negative: give a rank such as 8, or 0 for full fine-tuning.")
    if options.glue_dir is not None and not Path(options.glue_dir).is_dir():
        raise UserError(f"the GLUE folder {options.glue_dir} does not exist: give the original GLUE download's folder.")
    num_processes = launch_state().num_processes
    if options.batch_size % num_processes:
        raise UserError(
            f"--batch-size {options.batch_size} does not divide among {num_processes} processes: give a multiple of "
            f"{num_processes}."
        )
    config = load_config(options.model)
    positions = getattr(config, "max_position_embeddings", None)  # None: no table to run past (relative positions)
    if positions is not None and options.max_length > positions:
        raise UserError(f"--max-length {options.max_length} is longer than the {positions} positions {options.model} "
                        f"has: give --max-length {positions} or less.")
    tokenizer = load_tokenizer(options.model, config)
    if config.model_type == "crammed_bert":
        check_classification_token_first(tokenizer, options.model)
    device_type = launch_device_type()
    data = [load_task(task, options.glue_dir) for task in tasks]
    digest = model_digest(options.model, None if Path(options.model).is_dir() else hub_commit(options.model))
    if not run.fresh:
        check_cache_owner(options, digest, Path(run.output_dir))
    return Evaluation(
        options, run, tokenizer, config.model_type, data,
        resolve_precision(run.precision, device_type), resolve_compile_mode(run.compile, device_type), digest,
    )


def load_config(model: str):
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as err:
        where = "folder" if Path(model).exists() else "name"
        raise UserError(
            f"{model} is not a model: give a checkpoint folder with a config.json (e.g. runs/cram/final) or a "
            f"Hugging Face Hub model name ({type(err).__name__} for this {where})."
        ) from err
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES and config.model_type != "crammed_bert":
        raise UserError(
            f"{model} is a {config.model_type} model, which has no sequence-classification head in transformers: "
            "give an encoder checkpoint such as crammed BERT or BERT."
        )
    return config


def load_tokenizer(model: str, config) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise UserError(f"{model} holds no tokenizer: save the tokenizer beside the checkpoint.") from err
    if len(tokenizer) > config.vocab_size:
        raise UserError(
            f"the tokenizer of {model} has {len(tokenizer)} tokens but the model embeds only {config.vocab_size}: "
            "save the tokenizer the model was trained with beside it."
        )
    return tokenizer


# These choose which (task, seed) runs happen, not how one goes: changing them reuses the cached runs. The model's
# path is not what was evaluated either: its files are (`model_digest`).
SELECTION_OPTIONS = ("tasks", "seeds", "large_task_seeds", "model")
# What an evaluation itself writes beside a checkpoint: not part of the model it evaluated.
EVALUATION_OUTPUTS = ("eval_results.json", "README.md")


def model_digest(model: str, commit: str | None = None) -> str:
    """What is evaluated: for a checkpoint folder, a hash of its files (weights, config, tokenizer, the recipe's
    options); for a Hub name, the name at the `commit` it resolved to."""
    folder = Path(model)
    if not folder.is_dir():
        return f"{model}@{commit or 'unknown revision'}"
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        # Dot files are staging files of an interrupted write (ours, or a save in progress), not the model.
        if not path.is_file() or path.name in EVALUATION_OUTPUTS or path.name.startswith("."):
            continue
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as file:
            digest.update(hashlib.file_digest(file, "sha256").digest())
    return digest.hexdigest()[:16]


def hub_commit(model: str) -> str | None:
    """The commit of the Hub model `model` that the local cache holds, where loading its config just put it."""
    from huggingface_hub import try_to_load_from_cache

    resolved = try_to_load_from_cache(model, "config.json")
    return Path(resolved).parent.name if isinstance(resolved, str) else None  # …/snapshots/COMMIT/config.json


def protocol_options(options: GlueOptions) -> dict:
    """The options that change a single (task, seed) result; speed-only ones are in GlueRunOptions."""
    return {name: value for name, value in asdict(options).items() if name not in SELECTION_OPTIONS}


def options_fingerprint(options: GlueOptions, digest: str) -> str:
    """A hash of what one (task, seed) result depends on: the model's files and the protocol's options."""
    key = {"model_digest": digest, **protocol_options(options)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def check_cache_owner(options: GlueOptions, digest: str, output_dir: Path) -> None:
    """Refuse to mix cached results of another evaluation (another model, data or protocol) into this one."""
    options_file = output_dir / OPTIONS_FILE
    fix = "give another --output-dir, or --fresh to discard them and evaluate afresh."
    if not options_file.is_file():
        if any((output_dir / RESULTS_DIR).glob("*.json")):
            raise UserError(f"{output_dir} holds GLUE results of an unknown evaluation: {fix}")
        return
    recorded = json.loads(options_file.read_text())
    if recorded.get("fingerprint") == options_fingerprint(options, digest):
        return
    if recorded.get("model_digest") != digest:
        raise UserError(
            f"{output_dir} holds GLUE results of another model than the files now at {options.model}: {fix}")
    ours = protocol_options(options)
    theirs = recorded.get("options", {})
    changed = [name for name in ours if theirs.get(name) != ours[name]]

    def flags(values: dict) -> str:
        return " and ".join(
            f"--{name.replace('_', '-')} {'unset' if values.get(name) is None else values[name]}" for name in changed)

    if not changed:  # a record another version of this evaluation wrote
        raise UserError(f"{output_dir} holds GLUE results of an evaluation with other options: {fix}")
    raise UserError(f"{output_dir} holds GLUE results fine-tuned with {flags(theirs)}, not {flags(ours)}: {fix}")


# Everything an evaluation writes into its output folder; --fresh removes these and nothing else there.
OUTPUT_FILES = (OPTIONS_FILE, "glue.md", "glue.json", "glue.png")
OUTPUT_FOLDERS = (RESULTS_DIR, "adapters", "trainer")


def discard_earlier_results(output_dir: Path) -> None:
    for name in OUTPUT_FOLDERS:
        shutil.rmtree(output_dir / name, ignore_errors=True)
    for name in OUTPUT_FILES:
        (output_dir / name).unlink(missing_ok=True)


def record_options(evaluation: Evaluation) -> None:
    output_dir = Path(evaluation.run.output_dir)
    (output_dir / RESULTS_DIR).mkdir(parents=True, exist_ok=True)
    write_json(output_dir / OPTIONS_FILE, {
        "fingerprint": options_fingerprint(evaluation.options, evaluation.model_digest),
        "model_digest": evaluation.model_digest, "model": evaluation.options.model,
        "options": asdict(evaluation.options),
    })


def result_path(evaluation: Evaluation, task: GlueTask, seed: int) -> Path:
    return Path(evaluation.run.output_dir) / RESULTS_DIR / f"{task.name}-seed{seed}.json"


def build_model(evaluation: Evaluation, task: GlueTask):
    """A fresh copy of the checkpoint with a new head for `task`, dropout on, LoRA-wrapped if asked."""
    options = evaluation.options
    overrides: dict[str, object] = {"num_labels": task.num_labels}
    if task.is_regression:
        overrides["problem_type"] = "regression"
    config = AutoConfig.from_pretrained(options.model, **overrides)
    # Crammed checkpoints are saved with dropout 0 (as pretrained); fine-tuning turns it back on.
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
        if hasattr(config, name):
            setattr(config, name, options.dropout)
    model = AutoModelForSequenceClassification.from_pretrained(options.model, config=config)
    if options.lora_r:
        from peft import LoraConfig, get_peft_model

        targets = CRAMMED_LORA_TARGETS if evaluation.model_type == "crammed_bert" else None
        lora = LoraConfig(task_type="SEQ_CLS", r=options.lora_r, lora_alpha=options.lora_alpha,
                          lora_dropout=options.dropout, target_modules=targets)
        model = get_peft_model(model, lora)
    return model


def tokenized(evaluation: Evaluation, dataset):
    options, tokenizer = evaluation.options, evaluation.tokenizer

    def encode(batch: dict) -> dict:
        return encode_texts(tokenizer, batch["text_a"], batch["text_b"], options.max_length)

    return dataset.map(encode, batched=True, remove_columns=["text_a", "text_b"])


def training_arguments(evaluation: Evaluation, task: GlueTask, seed: int, num_processes: int) -> TrainingArguments:
    options = evaluation.options
    return TrainingArguments(
        output_dir=str(Path(evaluation.run.output_dir) / "trainer" / f"{task.name}-seed{seed}"),
        per_device_train_batch_size=options.batch_size // num_processes,
        per_device_eval_batch_size=evaluation.run.eval_batch_size,
        num_train_epochs=options.epochs,
        learning_rate=options.lr,
        adam_beta1=options.beta1,
        adam_beta2=options.beta2,
        adam_epsilon=options.eps,
        weight_decay=options.weight_decay,
        lr_scheduler_type=options.scheduler,
        warmup_steps=options.warmup,  # below 1, transformers reads it as a fraction of the steps
        max_grad_norm=options.max_grad_norm,  # Trainer skips clipping at 0
        bf16=evaluation.mixed_precision == "bf16",
        fp16=evaluation.mixed_precision == "fp16",
        torch_compile=evaluation.compile_mode is not None,
        torch_compile_mode=evaluation.compile_mode,
        seed=seed,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="epoch",
        report_to="none",
        disable_tqdm=True,
        use_cpu=launch_device_type() == "cpu",
    )


def fine_tune(evaluation: Evaluation, data: TaskData, seed: int) -> dict:
    """Fine-tune a fresh copy on the task's training set with `seed`, and score every dev set."""
    task = data.task
    state = launch_state()
    arguments = training_arguments(evaluation, task, seed, state.num_processes)
    torch.manual_seed(seed)  # the new head's initialisation depends on the seed too
    model = build_model(evaluation, task)
    trainable = sum(param.numel() for param in model.parameters() if param.requires_grad)
    total = sum(param.numel() for param in model.parameters())
    train = data.train
    if evaluation.options.max_train_examples is not None:
        train = train.select(range(min(len(train), evaluation.options.max_train_examples)))
    collator = DataCollatorWithPadding(evaluation.tokenizer, pad_to_multiple_of=8)
    trainer = Trainer(
        model=model, args=arguments, train_dataset=tokenized(evaluation, train), data_collator=collator,
        processing_class=evaluation.tokenizer,
    )
    started = time.perf_counter()
    output = trainer.train()
    train_seconds = time.perf_counter() - started
    result: dict = {
        "task": task.name, "seed": seed, "train_examples": len(train), "optimizer_steps": output.global_step,
        "train_loss": output.training_loss, "train_seconds": round(train_seconds, 1),
        "trainable_parameters": trainable, "total_parameters": total, "dev": {}, "predictions": {},
    }
    for key, dev in data.dev.items():
        predictions = trainer.predict(tokenized(evaluation, dev)).predictions
        predictions = predictions[0] if isinstance(predictions, tuple) else predictions
        labels = np.asarray(dev["label"])
        result["dev"][key] = task_metrics(key, np.asarray(predictions, dtype=np.float32), labels)
        result["predictions"][key] = (
            predictions.reshape(-1).round(5).tolist() if task.is_regression else predictions.argmax(-1).tolist()
        )
    if evaluation.options.lora_r and state.is_main_process:
        trainer.model.save_pretrained(Path(evaluation.run.output_dir) / "adapters" / f"{task.name}-seed{seed}")
    return result


def evaluate(evaluation: Evaluation) -> dict:
    """Run every (task, seed) not already cached, then write the report; returns the summary."""
    state = launch_state()
    if state.device.type == "cuda":
        enable_tf32()
    else:
        use_cpu_cores()
    if state.is_main_process:
        if evaluation.run.fresh:
            discard_earlier_results(Path(evaluation.run.output_dir))
        record_options(evaluation)
    state.wait_for_everyone()  # no process looks for cached results before --fresh has removed them
    results = []
    for data in evaluation.tasks:
        for seed in seeds_for(data.task, evaluation.options):
            path = result_path(evaluation, data.task, seed)
            if path.is_file():
                print(f"{data.task.name} seed {seed}: cached in {path}", flush=True)
                results.append(json.loads(path.read_text()))
                continue
            print(f"{data.task.name} seed {seed}: fine-tuning on {len(data.train):,} examples", flush=True)
            result = fine_tune(evaluation, data, seed)
            if state.is_main_process:
                write_json(path, result)
            state.wait_for_everyone()
            scores = ", ".join(f"{key} {metric} {value:.4f}" for key, metrics in result["dev"].items()
                               for metric, value in metrics.items())
            print(f"{data.task.name} seed {seed}: {scores} ({result['trainable_parameters']:,} of "
                  f"{result['total_parameters']:,} parameters trained)", flush=True)
            results.append(result)
    summary = summarize(results)
    if state.is_main_process:
        write_report(evaluation, summary, results)
    return summary


def write_report(evaluation: Evaluation, summary: dict, results: list[dict]) -> None:
    options, output_dir = evaluation.options, Path(evaluation.run.output_dir)
    model_name = Path(options.model).name if Path(options.model).exists() else options.model
    seeds = {data.task.name: len(seeds_for(data.task, options)) for data in evaluation.tasks}
    seed0 = seed_zero(results)
    markdown = markdown_report(model_name + (f" (LoRA r={options.lora_r})" if options.lora_r else ""), summary, seeds,
                               seed0)
    (output_dir / "glue.md").write_text(markdown)
    trainable = {result["task"]: result["trainable_parameters"] for result in results}
    seed0_headline, seed0_average = headline(seed0)
    hub_results = eval_results(summary)
    write_json(output_dir / "glue.json", {
        "model": options.model, "options": asdict(options), "seeds": seeds, "summary": summary,
        "seed0": {"summary": seed0, "headline": seed0_headline, "average": seed0_average},
        "eval_results": hub_results, "trainable_parameters": trainable,
    })
    bar_chart(model_name, summary, output_dir / "glue.png")
    print(markdown)
    print(f"report: {output_dir / 'glue.md'}, {output_dir / 'glue.json'}, {output_dir / 'glue.png'}")
    checkpoint = Path(options.model)
    if evaluation.run.write_eval_results and checkpoint.is_dir():
        if model_digest(options.model) != evaluation.model_digest:
            raise UserError(
                f"the files at {checkpoint} changed while they were evaluated, so these results were not written "
                f"beside them: {output_dir} reports the model as it was; run GLUE again with --fresh for the new one."
            )
        write_json(checkpoint / "eval_results.json", hub_results)
        add_eval_results_to_card(checkpoint, hub_results)  # the Hub shows the card's model-index
        print(f"eval_results.json written beside the checkpoint: {checkpoint / 'eval_results.json'}")
