"""
The runs behind `benchmarks/reach.py`: tiny models and rows made in code, the reference (one process, one plain SGD
step on the whole batch, by hand), one Trainer run with its logged losses and parameters (in this process or in a DDP
rank), and a run on both sides, stock and hf_parallel, where a crash is a figure too.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel
from transformers import BertConfig, PrinterCallback
from transformers.training_args import ParallelMode

import hf_parallel
from tests.helpers.heads import VOCAB, _padded, lm_rows

LR = 0.5
STOCK = (transformers.Trainer, transformers.TrainingArguments)
OURS = (hf_parallel.Trainer, hf_parallel.TrainingArguments)
# One SGD step that applies the gradient as it is, so that a wrong scale shows in the weights.
COMMON = dict(
    report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, max_steps=1,
    optim="sgd", learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
    logging_steps=1, per_device_eval_batch_size=2, dataloader_num_workers=0, remove_unused_columns=False,
    include_num_input_tokens_seen="no",
)  # fmt: skip
SEQ2SEQ = {
    "stock": (transformers.Seq2SeqTrainer, transformers.Seq2SeqTrainingArguments),
    "ours": (hf_parallel.Seq2SeqTrainer, hf_parallel.Seq2SeqTrainingArguments),
}
GENERATE = dict(predict_with_generate=True, generation_max_length=6)


def generated_rows(prediction: transformers.EvalPrediction) -> dict:
    return {"generated_rows": len(prediction.predictions)}


# A metric, so that evaluate() generates: without `compute_metrics` it computes the loss only and never generates.
METRICS = {"compute_metrics": generated_rows}

GA2 = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2)
DDP2 = dict(per_device_train_batch_size=4)  # 8 rows in one step on 2 ranks

# ---- Tiny models and rows (uneven valid items per row, and rows without any, so that a wrong average shows) ----


def bert(seed: int, num_labels: int = 3):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def classification_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n)
    labels = torch.randint(0, 3, (n,), generator=g)
    labels[0] = -100  # an ignored sample
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def packed_sequences(n: int) -> list[dict]:
    """Unpadded causal LM sequences for `DataCollatorWithFlattening`, each with at least one token to predict."""
    sequences = [r["input_ids"][r["attention_mask"].bool()].tolist() for r in lm_rows(n + 1, 3)[1:]]
    return [{"input_ids": ids, "labels": ids} for ids in sequences]


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class StreamedRows(torch.utils.data.IterableDataset):
    """The rows as an iterable dataset (no length)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


# ---- The reference: one process on the whole batch, by hand ----


def whole_loss(model, rows: list[dict]) -> float:
    """The model's loss on all `rows` in one batch: every item counted once."""
    model.eval()
    with torch.no_grad():
        return model(**{key: torch.stack([row[key] for row in rows]) for key in rows[0]}).loss.item()


def packed_loss(model, rows: list[dict]) -> float:
    """Sum of the token losses over the count of predicted tokens, sequence by sequence."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logits = model.eval()(input_ids=ids).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def reference(build, train: list[dict], evaluate: list[dict] | None = None) -> dict:
    """One SGD step of one process on all `train` rows, then the loss on all `evaluate` rows."""
    model = build(0).train()
    initial = parameters(model)
    loss = model(**{key: torch.stack([row[key] for row in train]) for key in train[0]}).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    eval_loss = whole_loss(model, evaluate) if evaluate else None
    return {"loss": loss.item(), "params": parameters(model), "initial": initial, "eval_loss": eval_loss}


def relative_error(value: float, expected: float) -> float:
    return abs(value - expected) / abs(expected)


def update_error(params: dict, ref: dict) -> float:
    update = max((ref["params"][n] - ref["initial"][n]).abs().max().item() for n in params)
    return max((params[n] - ref["params"][n]).abs().max().item() for n in params) / update


# ---- One Trainer run (in this process or in a DDP rank) ----


def check_topology(trainer) -> None:
    """Inside a DDP rank: two ranks, in distributed mode, so that a mis-launch cannot pass as a measurement."""
    assert dist.get_world_size() == 2 and trainer.args.world_size == 2, trainer.args.world_size
    assert trainer.args.parallel_mode == ParallelMode.DISTRIBUTED, trainer.args.parallel_mode


def trained(trainer, expect_ddp: bool) -> dict:
    """The logged losses and parameters of a trained `trainer`; under DDP also the model it trained (asserted to be
    DDP when `expect_ddp`) and how far the ranks' parameters are apart."""
    params = parameters(trainer.accelerator.unwrap_model(trainer.model))
    result = {"loss": [log["loss"] for log in trainer.state.log_history if "loss" in log], "params": params}
    if dist.is_initialized():
        inner = getattr(trainer.model_wrapped, "_orig_mod", trainer.model_wrapped)  # inside torch.compile's wrapper
        assert isinstance(inner, DistributedDataParallel) or not expect_ddp, type(inner).__name__
        flat = torch.cat([p.flatten() for p in params.values()])
        gathered = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(gathered, flat)
        result.update(wrapper=type(inner).__name__, apart=(gathered[0] - gathered[1]).abs().max().item())
    return result


def run(build, classes, train=None, evaluate=None, *, evaluate_first=False, expect_ddp=True, kwargs=None, **args):
    """
    Train `build(0)` with `classes` (a Trainer and its arguments class; `COMMON`, then `args`, and `kwargs` for the
    Trainer) on `train`, then evaluate on `evaluate` (before training with `evaluate_first`): what `trained` gives,
    and eval_loss.
    """
    trainer_cls, args_cls = classes
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        args = args_cls(output_dir=tmp, **{**COMMON, **args})
        trainer = trainer_cls(model=build(0), args=args, train_dataset=train, eval_dataset=evaluate, **(kwargs or {}))
        trainer.remove_callback(PrinterCallback)
        if dist.is_initialized():
            check_topology(trainer)
        if evaluate is not None and evaluate_first:
            result["eval_loss"] = trainer.evaluate()["eval_loss"]
        if train is not None:
            trainer.train()
            result.update(trained(trainer, expect_ddp))
        if evaluate is not None and not evaluate_first:
            result["eval_loss"] = trainer.evaluate()["eval_loss"]
    return result


# ---- Stock and hf_parallel side by side ----


def crashed(error: Exception) -> str:
    return f"crash: {type(error).__name__}: {error}"[:72]


def both(run_one, sides: dict | None = None) -> dict:
    """`run_one(classes)` for stock and for hf_parallel: side -> its result, or the crash in words."""
    results = {}
    for side, classes in (sides or {"stock": STOCK, "ours": OURS}).items():
        try:
            results[side] = run_one(classes)
        except AssertionError:  # a wrong topology is no figure: fail
            raise
        except Exception as error:  # a crash is a figure too (under DDP both ranks raise alike)
            results[side] = crashed(error)
    return results
