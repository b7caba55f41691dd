"""The crammed-BERT model: exact size, sparse prediction, and life as a plain Hugging Face model."""

import contextlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from launching import run
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForMaskedLM, AutoModelForSequenceClassification

import cram  # noqa: F401 - registers the Auto classes
from cram.models.crammed_bert import (
    IGNORE_INDEX,
    CrammedBertConfig,
    CrammedBertForMaskedLM,
    CrammedBertForSequenceClassification,
)

# 32768·768 tied embedding + 1 position scale + 2·768 embedding norm
# + 16 layers × (768·2304 QKV + 768·768 out + 768·3072 up + 1536·768 down + 2·2·768 norms) + 2·768 final norm
CRAMMED_BERT_PARAMETERS = 119_589_889


def tiny_config(**overrides) -> CrammedBertConfig:
    return CrammedBertConfig.from_preset(
        "tiny", vocab_size=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides
    )


def masked_batch(batch_size: int, vocab_size: int = 512, counts: list[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 128-token blocks with `counts[i]` labelled (masked) positions in sequence i (32 each by default)."""
    input_ids = torch.randint(5, vocab_size, (batch_size, 128))
    labels = torch.full_like(input_ids, -100)
    order = torch.rand(batch_size, 128).argsort(dim=1)
    for row, count in enumerate(counts or [32] * batch_size):
        masked = order[row, :count]
        labels[row, masked] = input_ids[row, masked]
    return input_ids, labels


def test_default_config_has_the_exact_parameter_count():
    with torch.device("meta"):
        model = CrammedBertForMaskedLM(CrammedBertConfig())
    assert sum(p.numel() for p in model.parameters()) == CRAMMED_BERT_PARAMETERS


def test_architecture_follows_the_recipe():
    with torch.device("meta"):
        model = CrammedBertForMaskedLM(CrammedBertConfig())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(linear.bias is None for linear in linears)
    assert model.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert len(model.bert.layers) == 16
    ffn = model.bert.layers[0].ffn
    assert (ffn.up.in_features, ffn.up.out_features, ffn.down.in_features) == (768, 3072, 1536)


def test_sparse_loss_equals_dense_loss_on_masked_positions():
    torch.manual_seed(0)
    model = CrammedBertForMaskedLM(tiny_config()).eval()
    input_ids, labels = masked_batch(3)

    sparse = model(input_ids, labels=labels)
    dense_logits = model(input_ids).logits
    dense_loss = torch.nn.functional.cross_entropy(dense_logits.reshape(-1, 512), labels.reshape(-1))
    assert sparse.logits.shape == (3 * 32, 512)
    torch.testing.assert_close(sparse.loss, dense_loss)


def test_positions_are_scaled_sinusoids_with_one_learned_scale():
    model = CrammedBertForMaskedLM(tiny_config())
    positions = model.bert.embeddings.positions
    assert [name for name, _ in positions.named_parameters()] == ["scale"]
    torch.testing.assert_close(positions.scale.detach(), torch.tensor([128**-0.5]))
    assert torch.allclose(positions.table[0, 1::2], torch.ones(64))  # cos(0) = 1


SAVED_LOGITS_SCRIPT = """
import sys
sys.modules["cram"] = None  # as on a machine without cram: any import of it fails
import torch
import torch.nn.functional as F
from transformers import AutoModelForMaskedLM
model = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
"""


@pytest.mark.launch
def test_save_then_load_in_a_fresh_process_gives_identical_logits(tmp_path):
    torch.manual_seed(0)
    model = CrammedBertForMaskedLM(tiny_config()).eval()
    model.save_pretrained(tmp_path / "model")
    assert (tmp_path / "model" / "model.safetensors").exists()
    input_ids = torch.randint(5, 512, (2, 64))
    torch.save(input_ids, tmp_path / "inputs.pt")
    # A fresh interpreter where cram cannot be imported: the checkpoint carries its modeling code (auto_map).
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    files = [tmp_path / "model", tmp_path / "inputs.pt", tmp_path / "out.pt"]
    completed = run([sys.executable, "-c", SAVED_LOGITS_SCRIPT, *files], cwd=tmp_path, env=env, fresh=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    with torch.no_grad():
        expected = model(input_ids).logits
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


def test_auto_classes_build_and_load_crammed_bert(tmp_path):
    config = tiny_config()
    assert isinstance(AutoConfig.for_model("crammed_bert"), CrammedBertConfig)
    CrammedBertForMaskedLM(config).save_pretrained(tmp_path)
    assert isinstance(AutoModelForMaskedLM.from_pretrained(tmp_path), CrammedBertForMaskedLM)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    assert isinstance(classifier, CrammedBertForSequenceClassification)
    # The encoder comes from the checkpoint; only the new head is freshly initialised.
    reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    qkv = classifier.bert.layers[0].attention.qkv.weight
    torch.testing.assert_close(qkv, reloaded.bert.layers[0].attention.qkv.weight)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_sequence_classifier_trains_with_padding(num_labels):
    torch.manual_seed(0)
    model = CrammedBertForSequenceClassification(tiny_config(num_labels=num_labels))
    input_ids = torch.randint(5, 512, (4, 16))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:2, 10:] = 0
    labels = torch.randn(4) if num_labels == 1 else torch.tensor([0, 1, 2, 1])
    output = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert output.logits.shape == (4, num_labels)
    output.loss.backward()
    assert model.bert.layers[0].attention.qkv.weight.grad is not None


@pytest.mark.parametrize("num_labels", [1, 3])
def test_padding_does_not_change_the_classifiers_logits(num_labels):
    # As DataCollatorWithPadding batches GLUE rows: each padded to the longest one, a multiple of 8.
    torch.manual_seed(0)
    model = CrammedBertForSequenceClassification(tiny_config(num_labels=num_labels)).eval()
    lengths = [5, 11, 16]
    rows = [torch.randint(5, 512, (length,)) for length in lengths]
    input_ids = torch.zeros(len(rows), 24, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = row
        attention_mask[index, : len(row)] = 1
    with torch.no_grad():
        alone = torch.cat([model(row[None]).logits for row in rows])
        batched = model(input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(batched, alone, rtol=1e-4, atol=1e-5)


def test_padding_does_not_change_the_unpadded_positions():
    torch.manual_seed(0)
    model = CrammedBertForMaskedLM(tiny_config()).eval()
    input_ids = torch.randint(5, 512, (1, 10))
    padded = torch.cat([input_ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 6)], dim=1).long()
    with torch.no_grad():
        alone = model(input_ids).logits
        with_padding = model(padded, attention_mask=mask).logits[:, :10]
    torch.testing.assert_close(alone, with_padding, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiled_sparse_prediction_matches_eager():
    # Under torch.compile the masked positions are found with the collator's static count (the GPU default path).
    torch.manual_seed(0)
    model = CrammedBertForMaskedLM(tiny_config()).eval()
    input_ids, labels = masked_batch(2)
    with torch.no_grad():
        eager = model(input_ids, labels=labels)
        compiled = torch.compile(model)(input_ids, labels=labels, masked_per_sequence=32)  # as the collator says
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-4, atol=1e-4)
    assert compiled.logits.shape == eager.logits.shape == (64, 512)


@pytest.mark.parametrize("seq_len", [126, 128, 130])
def test_static_count_matches_the_collators_per_sequence_count(monkeypatch, seq_len):
    # The static path normally runs only under torch.compile; force it to check the count for any length.
    from cram.data.collator import MaskedLMCollator

    collator = MaskedLMCollator(4, 512, [0, 1, 2, 3, 4])
    batch = collator(torch.randint(5, 512, (3, seq_len)))
    model = CrammedBertForMaskedLM(tiny_config(max_position_embeddings=seq_len))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    positions = model.masked_positions(batch["labels"], batch["masked_per_sequence"])
    assert len(positions) == 3 * collator.masked_count(seq_len)
    assert (batch["labels"].reshape(-1)[positions] != -100).all()


def test_a_model_cast_to_bf16_with_its_position_table_left_in_fp32_still_runs():
    # DeepSpeed's bf16 mode casts the parameters and can leave the (non-persistent) position table in fp32.
    model = CrammedBertForMaskedLM(CrammedBertConfig.from_preset("tiny")).to(torch.bfloat16)
    model.bert.embeddings.positions.table = model.bert.embeddings.positions.table.float()
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def bert_loss_on(logits: torch.Tensor, labels: torch.Tensor, num_labels: int, problem_type: str | None) -> torch.Tensor:
    """`BertForSequenceClassification`'s own loss for the given logits: its classifier is made to return them."""
    from transformers import BertConfig, BertForSequenceClassification

    class FixedLogits(torch.nn.Module):
        def forward(self, pooled: torch.Tensor) -> torch.Tensor:
            return logits

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=num_labels, problem_type=problem_type)
    bert = BertForSequenceClassification(config).eval()
    bert.classifier = FixedLogits()
    return bert(torch.randint(5, 64, (logits.shape[0], 8)), labels=labels).loss


@pytest.mark.parametrize(
    "num_labels, problem_type, labels",
    [
        (3, None, torch.tensor([0, 2, 1, 1])),
        (3, "single_label_classification", torch.tensor([0, 2, 1, 1])),
        (3, "multi_label_classification", torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]])),
        (3, None, torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]])),
        (1, None, torch.tensor([0.5, 4.0, 2.5, 1.0])),
        (2, "regression", torch.tensor([[0.5, 1.0], [4.0, 3.0], [2.5, 0.0], [1.0, 1.0]])),
    ],
)
def test_problem_type_losses_equal_bert_for_sequence_classification(num_labels, problem_type, labels):
    torch.manual_seed(0)
    model = CrammedBertForSequenceClassification(tiny_config(num_labels=num_labels, problem_type=problem_type))
    output = model(torch.randint(5, 512, (4, 12)), labels=labels)
    expected = bert_loss_on(output.logits.detach(), labels, num_labels, problem_type)
    torch.testing.assert_close(output.loss, expected)


def test_lora_sequence_classification_trains_the_whole_head_and_reloads_to_the_same_predictions(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    CrammedBertForMaskedLM(tiny_config()).save_pretrained(tmp_path / "base")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=2)
    lora = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["qkv", "out", "up", "down"])
    model = get_peft_model(model, lora)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all("lora_" in name or ".classifier." in name for name in trainable)
    assert any("classifier.modules_to_save.default.dense" in name for name in trainable)  # the pooler trains

    input_ids = torch.randint(5, 512, (4, 12))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids, labels=torch.tensor([0, 1, 1, 0])).loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids).logits
    model.save_pretrained(tmp_path / "adapter")

    torch.manual_seed(1)  # a different fresh head: everything the adapter needs must come from its files
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=2)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, expected)


def one_trainer_step(model: torch.nn.Module, rows: dict, micro_batch: int, accumulation: int, tmp_path):
    """One SGD step of `Trainer` over the same 8 examples; returns its logged loss and the updated weights."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    arguments = TrainingArguments(
        output_dir=str(tmp_path / f"trainer-{accumulation}"), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=Dataset.from_dict(rows))
    trainer.train()
    return trainer.state.log_history[0]["loss"], {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("head", ["classification", "masked-lm"])
def test_trainer_with_gradient_accumulation_takes_the_same_step(tmp_path, head):
    torch.manual_seed(0)
    if head == "classification":
        rows = {"input_ids": torch.randint(5, 512, (8, 16)).tolist(), "labels": [0, 1, 1, 0, 1, 0, 0, 1]}
        build = lambda: CrammedBertForSequenceClassification(tiny_config(num_labels=2))  # noqa: E731
    else:
        # Micro-batches of 2 with 4, 8, 40 and 80 masked positions: the step equals the whole batch's only when
        # each micro-batch's summed loss is divided by the whole batch's count (Trainer's num_items_in_batch).
        input_ids, labels = masked_batch(8, counts=[1, 3, 2, 6, 16, 24, 32, 48])
        rows = {"input_ids": input_ids.tolist(), "labels": labels.tolist()}
        build = lambda: CrammedBertForMaskedLM(tiny_config())  # noqa: E731
    initial = build().state_dict()

    results = []
    for micro_batch, accumulation in [(8, 1), (2, 4)]:
        model = build()
        model.load_state_dict(initial)
        results.append(one_trainer_step(model, rows, micro_batch, accumulation, tmp_path))
    (loss_whole, weights_whole), (loss_accumulated, weights_accumulated) = results
    assert loss_accumulated == pytest.approx(loss_whole, rel=1e-4)
    for name, value in weights_whole.items():
        torch.testing.assert_close(weights_accumulated[name], value, rtol=1e-4, atol=1e-6, msg=name)


class AtenOps(TorchDispatchMode):
    """Records the aten operators that run."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_eager_training_step_finds_the_masked_positions_without_nonzero(precision):
    """nonzero's output size is read by the host, a device-to-host sync per micro-batch on a GPU; training takes
    the static count instead, with the loss and gradients of exactly the masked positions."""
    from cram.data.collator import MaskedLMCollator

    collator = MaskedLMCollator(4, 512, [0, 1, 2, 3, 4], mask_fraction=0.25)
    batch = collator(torch.randint(5, 512, (3, 64), generator=torch.Generator().manual_seed(0)))
    torch.manual_seed(0)
    model = CrammedBertForMaskedLM(tiny_config(max_position_embeddings=64))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    results = {}
    for mode in ("train", "eval"):
        getattr(model, mode)()
        model.zero_grad()
        with AtenOps() as recorded, autocast:
            loss = model(**batch).loss
            loss.backward()
        results[mode] = (loss.detach(), [param.grad.clone() for param in model.parameters()], recorded.ops)
    train_loss, train_grads, train_ops = results["train"]
    eval_loss, eval_grads, eval_ops = results["eval"]
    assert torch.ops.aten.nonzero in eval_ops  # the recorder sees it where it runs
    assert torch.ops.aten.nonzero not in train_ops and torch.ops.aten._local_scalar_dense not in train_ops
    assert torch.equal(train_loss, eval_loss)
    for grad, expected in zip(train_grads, eval_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def bernoulli_batch(seq_len: int = 32) -> dict[str, torch.Tensor]:
    """A batch as Hugging Face's DataCollatorForLanguageModeling masks it: each position drawn, here with a
    probability of three quarters, so the sequences have far more masked positions than the config's quarter."""
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(5, 512, (4, seq_len), generator=generator)
    labels = torch.where(torch.rand(input_ids.shape, generator=generator) < 0.75, input_ids, IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels}


def exact_masked_lm_loss(model: CrammedBertForMaskedLM, batch: dict) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1),
                           ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_on_a_collator_that_draws_each_position_is_exact(compiled, precision):
    torch.manual_seed(0)
    model = CrammedBertForMaskedLM(tiny_config(max_position_embeddings=32)).train()
    batch = bernoulli_batch()
    assert ((batch["labels"] != IGNORE_INDEX).sum(1) > round(model.config.sparse_prediction * 32)).all()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with autocast:
        expected = exact_masked_lm_loss(model, batch)
        forward = model
        if compiled:
            torch._dynamo.reset()
            forward = torch.compile(model, backend="aot_eager")
        # Divided by the count of masked positions (as Trainer passes it), so the loss is their sum: one dropped
        # position shows whatever its size.
        loss = forward(**batch, num_items_in_batch=(batch["labels"] != IGNORE_INDEX).sum()).loss
    tolerance = dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, expected, **tolerance)
    loss.backward()  # trains, every masked position included
    assert model.decoder.weight.grad is not None


def test_cram_s_collator_gives_its_count_and_the_model_predicts_that_many():
    from cram.data.collator import MaskedLMCollator

    collator = MaskedLMCollator(4, 512, [0, 1, 2, 3, 4], mask_fraction=0.25)
    batch = collator(torch.randint(5, 512, (3, 32), generator=torch.Generator().manual_seed(0)))
    assert batch["masked_per_sequence"] == 8
    model = CrammedBertForMaskedLM(tiny_config(max_position_embeddings=32)).train()
    output = model(**batch)
    assert output.logits.shape == (3 * 8, 512)  # the static count, not every position
    torch.testing.assert_close(output.loss, exact_masked_lm_loss(model, batch))


def test_a_broken_count_guarantee_is_refused():
    model = CrammedBertForMaskedLM(tiny_config()).train()
    input_ids, labels = masked_batch(2)
    labels[:, :] = input_ids  # every position masked, where the batch says a quarter
    with pytest.raises(RuntimeError, match="masked_per_sequence guarantees"):
        model(input_ids, labels=labels, masked_per_sequence=round(0.25 * input_ids.shape[1]))
