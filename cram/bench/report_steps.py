"""The contender and lever rows `make device-check` times, each a whole step (forward, backward, clipping, AdamW)
on synthetic tokens at one shape, each in a process of its own.

The contenders: crammed BERT, the original cramming code from the user's checkout and Hugging Face's
`BertForMaskedLM`; cram's Pythia and `GPTNeoXForCausalLM` as a Hugging Face user trains it (its own attention and
init). Each is built fresh for its row, from a config of its own, and runs eager, compiled with torch.compile's
defaults, and compiled with the original's options (`ORIGINAL_COMPILE_OPTIONS`: its impl.compile_torch call), so a
ratio between two rows compiled alike is one of the code, and one between a model's two compiled rows one of the
flags. Then the levers, each beside the row it would change: compile mode max-autotune (CUDA graphs: the shapes are
static), crammed BERT's loss on the autocast dtype's logits instead of fp32, the readymade loader with one worker
instead of none, and for Pythia a fused linear-cross-entropy kernel where one is installed (Liger's, or
cut-cross-entropy) instead of the chunked loss. With DeepSpeed installed, the crammed-BERT step under ZeRO stage 1.

Every row counts its own model's FLOPs, so each MFU is that model's; the ratios compare tokens/s at one shape.
Building the list touches no device (the device check's own process must not initialise CUDA: `cram.bench.isolated`):
each row's batch is made in its row's process, and why a row cannot run here (`Candidate.unavailable`) is decided
before any process starts.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM, GPTNeoXConfig, GPTNeoXForCausalLM

from cram.bench.measure import Built, Candidate, Rounds, Skip
from cram.bench.original_cramming import (
    ORIGINAL_COMPILE_OPTIONS,
    OriginalUnavailable,
    build_original,
    check_checkout,
)
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.models.pythia_model import build_pythia_model, pythia_config
from cram.plan.launch import free_port
from cram.train.deepspeed_setup import prepare_deepspeed_on_the_cpu
from cram.train.throughput import bert_flops_per_token, crammed_bert_flops_per_token, gpt_neox_flops_per_token

TOY_VOCAB = 512
HF_GPT_NEOX = "GPTNeoXForCausalLM as Hugging Face users train it"
IGNORE_INDEX = -100
# Inductor options only a GPU can take: CUDA graphs. Dropped on the CPU, and the row says so.
CUDA_ONLY_OPTIONS = ("triton.cudagraphs", "triton.cudagraph_trees")
MAX_AUTOTUNE = {"mode": "max-autotune"}  # autotuned GEMMs and CUDA graphs, which static shapes allow
# The fused linear-cross-entropy kernels timed against the chunked loss: (row, module, pip name).
FUSED_LOSSES = (("Liger's fused linear cross-entropy", "liger_kernel", "liger-kernel"),
                ("cut-cross-entropy", "cut_cross_entropy", "cut-cross-entropy"))
LOADER_WORKERS = 1  # a stream has one reader: a worker moves it and the masking out of the training process


@dataclass(frozen=True)
class Shape:
    """The shapes measured: the full ones on GPUs, a toy one on the CPU."""

    bert: CrammedBertConfig  # a template: every row builds from its own copy
    bert_batch: int
    pythia: str
    pythia_batch: int
    pythia_seq_len: int
    rounds: Rounds
    pythia_vocab: int | None = None  # None: the released vocabulary


def shape_for(name: str) -> Shape:
    if name == "full":  # the crammed-BERT default (the paper's 16 × 768) and pythia-160m at its 2048-token context
        return Shape(CrammedBertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), 128,
                     "pythia-160m", 8, 2048, Rounds(warmup=3, rounds=5, steps_per_round=4))
    # The toy shape: the tiny preset and pythia-14m with a 512-token vocabulary, which a CPU runs in seconds.
    return Shape(CrammedBertConfig.from_preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                               max_position_embeddings=32, vocab_size=TOY_VOCAB), 4,
                 "pythia-14m", 2, 64, Rounds(warmup=1, rounds=2, steps_per_round=1), pythia_vocab=TOY_VOCAB)


def pythia_config_for(shape: Shape) -> GPTNeoXConfig:
    """A new config of the shape's Pythia size: cram's model sets its config's attention, so no two rows share one."""
    return pythia_config(shape.pythia, max_position_embeddings=shape.pythia_seq_len,
                         **({"vocab_size": shape.pythia_vocab} if shape.pythia_vocab else {}))


def hf_bert_config(bert: CrammedBertConfig) -> BertConfig:
    return BertConfig(
        vocab_size=bert.vocab_size, hidden_size=bert.hidden_size, num_hidden_layers=bert.num_hidden_layers,
        num_attention_heads=bert.num_attention_heads, intermediate_size=bert.intermediate_size,
        max_position_embeddings=bert.max_position_embeddings, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")


def contenders(shape: Shape) -> dict[str, Callable[[], torch.nn.Module]]:
    """Each contender's model (but the original's, which needs its checkout), built fresh on every call from a
    config of its own."""
    return {
        "crammed BERT": lambda: CrammedBertForMaskedLM(copy.deepcopy(shape.bert)),
        "BertForMaskedLM": lambda: BertForMaskedLM(hf_bert_config(shape.bert)),
        # As recipes/pythia.py builds it: the released init, SDPA's causal kernel, the chunked loss.
        shape.pythia: lambda: build_pythia_model(shape.pythia, pythia_config_for(shape)),
        # transformers' own class on its own config: its attention ("sdpa") and init, as a user's script has them.
        HF_GPT_NEOX: lambda: GPTNeoXForCausalLM(pythia_config_for(shape)),
    }


def compile_for(model: torch.nn.Module, options: dict, device: torch.device) -> tuple[torch.nn.Module, str | None]:
    """`torch.compile(model, **options)`, and on the CPU without the inductor options only a GPU takes (CUDA
    graphs), with a note naming those dropped (None when nothing was)."""
    inductor = dict(options.get("options") or {})
    dropped = [name for name in CUDA_ONLY_OPTIONS if name in inductor] if device.type != "cuda" else []
    for name in dropped:
        del inductor[name]
    compiled = torch.compile(model, **{**options, **({"options": inductor} if "options" in options else {})})
    return compiled, f"{' and '.join(dropped)} dropped: CUDA graphs need a GPU" if dropped else None


def training_step(model: torch.nn.Module, next_batch: Callable[[], dict[str, torch.Tensor]], precision: str,
                  device: torch.device) -> Callable[[], None]:
    """One whole step of `model` on `next_batch()` under the autocast `precision` ("bf16", "fp16" or "no")."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step() -> None:
        batch = next_batch()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(**batch)["loss"]  # a dict from the original code, a ModelOutput from transformers
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def mlm_batch(vocab: int, batch: int, seq_len: int, masked_fraction: float, device: torch.device) -> dict:
    """Synthetic masked-LM tokens: `masked_fraction` of each sequence's positions, at random, carry labels, the
    fixed count that crammed BERT's and the original's sparse prediction are built for; the batch says the count
    (`masked_per_sequence`) as cram's collator does, so crammed BERT predicts only those positions."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, vocab, (batch, seq_len), generator=generator)
    per_sequence = round(masked_fraction * seq_len)
    masked = torch.rand(batch, seq_len, generator=generator).argsort(dim=1)[:, :per_sequence]
    labels = torch.full_like(input_ids, -100).scatter_(1, masked, input_ids.gather(1, masked))
    return {"input_ids": input_ids.to(device), "labels": labels.to(device), "masked_per_sequence": per_sequence}


def without_count(batch: dict) -> dict:
    """The batch as a model that knows nothing of cram's collator takes it (the original's, BertForMaskedLM)."""
    return {key: value for key, value in batch.items() if key != "masked_per_sequence"}


class LossInAutocastDtype(torch.nn.Module):
    """Crammed BERT with its cross-entropy on the sparse logits as the decoder gives them (bf16 under bf16
    autocast), where the model upcasts them to fp32 first: the lever of the fp32 copy of the masked logits."""

    def __init__(self, model: CrammedBertForMaskedLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                masked_per_sequence: int | None = None) -> dict[str, torch.Tensor]:
        hidden = self.model.bert(input_ids).last_hidden_state
        hidden, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        positions = self.model.masked_positions(labels, masked_per_sequence)
        if positions is not None:
            hidden, targets = hidden[positions], targets[positions]
        logits = self.model.get_output_embeddings()(hidden)
        with torch.autocast(logits.device.type, enabled=False):  # autocast would run cross_entropy in fp32
            loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
        return {"loss": loss}


class FusedLinearCrossEntropy(torch.nn.Module):
    """cram's Pythia with the output layer and loss of an installed fused kernel in place of the chunked loss."""

    def __init__(self, model: torch.nn.Module, module: str):
        super().__init__()
        self.model, self.module = model, module
        if module == "liger_kernel":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self.liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.model.gpt_neox(input_ids).last_hidden_state
        weight = self.model.get_output_embeddings().weight
        if torch.is_autocast_enabled(hidden.device.type):  # the kernels take one dtype, autocast's, for both
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # token t predicts label t + 1
        hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        if self.module == "liger_kernel":
            return {"loss": self.liger(weight, hidden, targets)}
        from cut_cross_entropy import linear_cross_entropy

        return {"loss": linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX)}


def readymade_batches(vocab: int, batch: int, seq_len: int, steps: int, workers: int, device: torch.device,
                      folder: Path) -> Callable[[], dict[str, torch.Tensor]]:
    """Masked batches through `cram.data.readymade.readymade_loader` (in the training process) or the same
    micro-batches in a DataLoader with `workers` workers, from parquet shards of synthetic blocks written to
    `folder`, as the ready-made upload holds them: enough for `steps` steps, so no timed step re-opens a shard. Each
    batch carries the collator's `masked_per_sequence`, so the model predicts the masked quarter, as in the recipe
    (and as its FLOPs are counted), not every position."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    from cram.data.collator import MaskedLMCollator
    from cram.data.readymade import StreamedBlocks, readymade_loader

    shards = sorted(folder.glob("*.parquet"))
    if not shards:
        blocks = torch.randint(5, vocab, (steps * batch, seq_len), generator=torch.Generator().manual_seed(0))
        for index, part in enumerate(blocks.chunk(4)):
            pq.write_table(pa.table({"input_ids": pa.array(part.int().tolist(), pa.list_(pa.int32()))}),
                           folder / f"train-{index:05d}-of-00004.parquet")
        shards = sorted(folder.glob("*.parquet"))
    rows = [pq.ParquetFile(shard).metadata.num_rows for shard in shards]
    stream = StreamedBlocks([str(shard) for shard in shards], rows, seq_len)
    # Ids 0-4 stand in for the special tokens, 4 for the mask, as in the synthetic blocks above.
    collator = MaskedLMCollator(4, vocab, range(5), mask_fraction=0.25)
    pin = device.type == "cuda"
    loader = readymade_loader(stream, collator, start=0, micro_batch_size=batch, process_index=0, num_processes=1,
                              pin_memory=pin)
    if workers:
        loader = DataLoader(loader.dataset, batch_size=None, collate_fn=collator, num_workers=workers,
                            pin_memory=pin, persistent_workers=True)
    batches: Iterator[dict[str, torch.Tensor]] = iter(loader)

    def next_batch() -> dict[str, torch.Tensor | int]:
        taken = next(batches)
        return {"input_ids": taken["input_ids"].to(device, non_blocking=True),
                "labels": taken["labels"].to(device, non_blocking=True),
                "masked_per_sequence": taken["masked_per_sequence"]}

    return next_batch


def zero1_step(model: torch.nn.Module, batch: dict, precision: str, device: torch.device) -> Callable[[], None]:
    """The same model's step through a one-process DeepSpeed engine under ZeRO stage 1 (gloo on the CPU)."""
    import deepspeed

    if device.type == "cpu":
        prepare_deepspeed_on_the_cpu()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": batch["input_ids"].shape[0], "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)

    def step() -> None:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

    return step


@dataclass(frozen=True)
class Setting:
    """How the report runs each step: where, at which precisions, whether compiled rows compile."""

    device: torch.device
    precision: str  # crammed BERT's, the original's and BertForMaskedLM's: `--precision auto` here
    pythia_precision: str  # the released Pythia's where the device can, else `--precision auto`
    compiled: bool  # whether compiled rows compile here
    compile_choice: str  # what --compile said, for a skipped row's reason
    original: Path | None  # the original cramming code's checkout

    @property
    def mode(self) -> str:
        """How the lever rows and the rows they are compared with run: as the recipes do on this device."""
        return "compiled" if self.compiled else "eager"

    @property
    def compile_refused(self) -> str:
        return f"--compile {self.compile_choice} does not compile on this device"


def missing(*modules: str) -> list[str]:
    return [module for module in modules if importlib.util.find_spec(module) is None]


def candidates(shape: Shape, setting: Setting) -> list[Candidate]:
    """Every contender and lever row, in their order: the comparisons of the code first, the levers after, so a time
    bound cuts levers first. Builds nothing: each row's model and batch are made by its build, in its process."""
    device, bert = setting.device, shape.bert
    models = contenders(shape)
    bert_shape = f"{shape.bert_batch} × {bert.max_position_embeddings}"
    bert_tokens = shape.bert_batch * bert.max_position_embeddings
    crammed_flops = crammed_bert_flops_per_token(bert.num_hidden_layers, bert.hidden_size, bert.intermediate_size,
                                                 bert.vocab_size, bert.max_position_embeddings, bert.sparse_prediction)
    hf_bert_flops = bert_flops_per_token(bert.num_hidden_layers, bert.hidden_size, bert.intermediate_size,
                                         bert.vocab_size, bert.max_position_embeddings)
    pythia = pythia_config_for(shape)  # read for the shape's sizes only
    pythia_sizes = (pythia.num_hidden_layers, pythia.hidden_size, pythia.intermediate_size, pythia.vocab_size,
                    shape.pythia_seq_len)
    pythia_flops = gpt_neox_flops_per_token(*pythia_sizes)
    pythia_causal_flops = gpt_neox_flops_per_token(*pythia_sizes, causal_half=True)
    pythia_shape = f"{shape.pythia_batch} × {shape.pythia_seq_len}"
    pythia_tokens = shape.pythia_batch * shape.pythia_seq_len
    precision, pythia_precision = setting.precision, setting.pythia_precision
    original: dict = {}

    def bert_batch() -> dict:
        return mlm_batch(bert.vocab_size, shape.bert_batch, bert.max_position_embeddings, bert.sparse_prediction,
                         device)

    def pythia_batch() -> dict:
        tokens = torch.randint(0, pythia.vocab_size, (shape.pythia_batch, shape.pythia_seq_len),
                               generator=torch.Generator().manual_seed(0)).to(device)
        return {"input_ids": tokens, "labels": tokens}

    def step_of(make_model: Callable[[], torch.nn.Module], options: Callable[[], dict] | None,
                next_batch: Callable[[], Callable[[], dict]], step_precision: str, note: str | None,
                ) -> Callable[[], Built]:
        """A row's build: `make_model()` fresh, compiled with `options()` unless None, fed by `next_batch()`."""
        def build() -> Built:
            torch.manual_seed(0)
            model, dropped = make_model().to(device), None
            if options is not None:
                model, dropped = compile_for(model, options(), device)
            notes = [text for text in (dropped, note) if text]
            return Built(training_step(model, next_batch(), step_precision, device), "; ".join(notes) or None)
        return build

    def fixed(make_batch: Callable[[], dict]) -> Callable[[], Callable[[], dict]]:
        """Every step on one batch, made when the row is built."""
        def feed() -> Callable[[], dict]:
            batch = make_batch()
            return lambda: batch
        return feed

    def row(name: str, shape_text: str, make_model: Callable[[], torch.nn.Module], options: dict | None | Callable,
            batch: Callable[[], Callable[[], dict]], step_precision: str, tokens_per_step: int, flops: float,
            autotunes: bool = False, note: str | None = None, unavailable: str | None = None,
            causal_flops: float | None = None) -> Candidate:
        """A row: `options` None for eager, else torch.compile's keywords (or a function giving them)."""
        get_options = options if callable(options) or options is None else (lambda: options)
        if options is not None and not setting.compiled:
            unavailable = setting.compile_refused
        compiles = int(options is not None and unavailable is None)  # a row that cannot run compiles nothing
        return Candidate(f"{name} ({shape_text})", step_of(make_model, get_options, batch, step_precision, note),
                         tokens_per_step, flops, compiles=compiles, autotunes=bool(compiles and autotunes),
                         unavailable=unavailable, causal_flops_per_token=causal_flops)

    try:
        check_checkout(setting.original)
        original_unavailable = None
    except OriginalUnavailable as reason:
        original_unavailable = str(reason)

    def original_model() -> torch.nn.Module:
        """The original code's model at this shape (built once per row: each row trains its own)."""
        overrides = {"num_transformer_layers": bert.num_hidden_layers, "hidden_size": bert.hidden_size,
                     "intermed_size": bert.intermediate_size,
                     "attention": {"num_attention_heads": bert.num_attention_heads},
                     "embedding": {"max_seq_length": bert.max_position_embeddings}}
        try:
            built = build_original(setting.original, bert.vocab_size, overrides)
        except OriginalUnavailable as reason:
            raise Skip(str(reason)) from None
        original["compile options"] = built.compile_options
        return built.model

    def zero1() -> Callable[[], None]:
        torch.manual_seed(0)
        return zero1_step(models["crammed BERT"]().to(device), bert_batch(), setting.precision, device)

    def fused_unavailable(module: str, pip_name: str) -> str | None:
        if missing(module):
            return f"not installed (pip install {pip_name})"
        if device.type != "cuda":
            return f"{pip_name} runs Triton kernels, which need a GPU"
        return None

    no_loader = (f"the readymade loader needs {' and '.join(missing('datasets', 'pyarrow'))}: pip install datasets"
                 if missing("datasets", "pyarrow") else None)
    # The shards both loader rows read, written by the first: made here, in the check's own process, so that they
    # are removed when it ends (a row's process leaves by os._exit, which removes nothing).
    shards = tempfile.TemporaryDirectory(prefix="cram-device-check-") if no_loader is None else None

    def loader_batches(workers: int) -> Callable[[], Callable[[], dict]]:
        def make() -> Callable[[], dict]:
            steps = shape.rounds.warmup + shape.rounds.rounds * shape.rounds.steps_per_round + 8
            return readymade_batches(bert.vocab_size, shape.bert_batch, bert.max_position_embeddings, steps, workers,
                                     device, Path(shards.name))
        return make

    bert_rows, pythia_rows = [], []
    for name, make_model, flops, batch, unavailable in (
            ("crammed BERT", models["crammed BERT"], crammed_flops, bert_batch, None),
            ("original cramming", original_model, crammed_flops, lambda: without_count(bert_batch()),
             original_unavailable),
            ("BertForMaskedLM", models["BertForMaskedLM"], hf_bert_flops, lambda: without_count(bert_batch()), None)):
        # The original's own options come from its checkout (they equal ORIGINAL_COMPILE_OPTIONS; a test checks).
        own = (lambda: original["compile options"]) if name == "original cramming" else ORIGINAL_COMPILE_OPTIONS
        bert_rows += [row(f"{name}, eager", bert_shape, make_model, None, fixed(batch), precision, bert_tokens,
                          flops, unavailable=unavailable),
                      row(f"{name}, compiled", bert_shape, make_model, {}, fixed(batch), precision,
                          bert_tokens, flops, unavailable=unavailable),
                      row(f"{name}, compiled with the original's options", bert_shape, make_model, own,
                          fixed(batch), precision, bert_tokens, flops, autotunes=True, unavailable=unavailable)]
    for name in (shape.pythia, HF_GPT_NEOX):
        pythia_rows += [row(f"{name}, {how}", pythia_shape, models[name], options, fixed(pythia_batch),
                            pythia_precision, pythia_tokens, pythia_flops,
                            autotunes=options is ORIGINAL_COMPILE_OPTIONS, causal_flops=pythia_causal_flops)
                        for how, options in (("eager", None), ("compiled", {}),
                                             ("compiled with the original's options", ORIGINAL_COMPILE_OPTIONS))]
    recipes_compile = {} if setting.compiled else None  # the levers change the step the recipes run here
    mode = setting.mode
    levers = [
        row("crammed BERT, compiled max-autotune", bert_shape, models["crammed BERT"], MAX_AUTOTUNE,
            fixed(bert_batch), precision, bert_tokens, crammed_flops, autotunes=True),
        row(f"crammed BERT, {mode}, its loss on the autocast dtype's logits", bert_shape,
            lambda: LossInAutocastDtype(models["crammed BERT"]()), recipes_compile, fixed(bert_batch), precision,
            bert_tokens, crammed_flops,
            note=None if precision in ("bf16", "fp16") else "no autocast here: its loss is fp32 as the model's is"),
        row(f"crammed BERT, {mode}, fed by the readymade loader in-process", bert_shape, models["crammed BERT"],
            recipes_compile, loader_batches(0), precision, bert_tokens, crammed_flops, unavailable=no_loader),
        row(f"crammed BERT, {mode}, fed by the readymade loader with {LOADER_WORKERS} worker", bert_shape,
            models["crammed BERT"], recipes_compile, loader_batches(LOADER_WORKERS), precision, bert_tokens,
            crammed_flops, unavailable=no_loader),
        row(f"{shape.pythia}, compiled max-autotune", pythia_shape, models[shape.pythia], MAX_AUTOTUNE,
            fixed(pythia_batch), pythia_precision, pythia_tokens, pythia_flops, autotunes=True,
            causal_flops=pythia_causal_flops),
    ]
    for what, module, pip_name in FUSED_LOSSES:
        levers.append(row(f"{shape.pythia}, {mode}, {what}", pythia_shape,
                          lambda module=module: FusedLinearCrossEntropy(models[shape.pythia](), module),
                          recipes_compile, fixed(pythia_batch), pythia_precision, pythia_tokens, pythia_flops,
                          unavailable=fused_unavailable(module, pip_name), causal_flops=pythia_causal_flops))
    for lever in levers:
        lever.group = "lever"
    zero1_unavailable = 'DeepSpeed is not installed (pip install "cram[deepspeed]")' if missing("deepspeed") else None
    return [*bert_rows, *pythia_rows,
            Candidate(f"crammed BERT, DeepSpeed ZeRO-1 ({bert_shape})", zero1, bert_tokens, crammed_flops,
                      unavailable=zero1_unavailable),
            *levers]
