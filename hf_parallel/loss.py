"""
Exact losses: per-head loss **sums** and item **counts**, computed once from the logits.

A loss that is a mean over items is exact over an optimizer step only when every micro-batch of every device is
divided by the item count C of the *whole* step. So the Trainer counts the items of the step before it runs
(all-reduced over ranks), pops the labels, runs the model without them, and asks a `LossHead` for the sum S of
per-item losses of each micro-batch: it back-propagates S / C (times the DDP world size, since DDP averages
gradients). Evaluation adds up S and C over the whole set and divides once.

A head may have several terms, each with its own count and a weight: question answering is
0.5 * S_start / C_start + 0.5 * S_end / C_end, as in transformers' `ForQuestionAnsweringLoss`.

```python
from hf_parallel.loss import resolve_head

head = resolve_head(model)  # None when the model's head cannot be made exact
labels = head.pop_labels(batch)
sums, counts = head.row_terms(model(**batch), labels)  # [batch, terms] each
loss = head.combine(sums.sum(0), counts.sum(0))
```
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.auto import modeling_auto

IGNORE_INDEX = -100


def _class_names(*mappings: str) -> frozenset[str]:
    names = set()
    for mapping in mappings:
        for value in getattr(modeling_auto, mapping).values():
            names.update(value if isinstance(value, (tuple, list)) else (value,))
    return frozenset(names)


CAUSAL_LM = _class_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
SEQ2SEQ_LM = _class_names("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES")
MASKED_LM = _class_names("MODEL_FOR_MASKED_LM_MAPPING_NAMES")
TOKEN_CLASSIFICATION = _class_names("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES")
SEQUENCE_CLASSIFICATION = _class_names("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES")
MULTIPLE_CHOICE = _class_names("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES")
QUESTION_ANSWERING = _class_names("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES")


class UnsupportedHead(ValueError):
    """The model's loss cannot be recomputed exactly from its logits; the reason names what to do."""


def _logits(outputs, key: str = "logits") -> torch.Tensor:
    if isinstance(outputs, dict):
        return outputs[key]
    return outputs[0]


def token_losses(logits: torch.Tensor, targets: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """
    Per-position cross-entropy (with label smoothing when `smoothing > 0`), 0 where the target is ignored.

    Args:
        logits (`torch.Tensor`): `[..., vocab]`; upcast to float32 as transformers does.
        targets (`torch.Tensor`): `[...]`, `IGNORE_INDEX` (-100) where there is nothing to predict.
        smoothing (`float`, *optional*, defaults to 0): transformers' `LabelSmoother` epsilon:
            `(1 - eps) * nll + eps * mean over the vocabulary of -log p`.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab).float()
    flat_targets = targets.reshape(-1).to(flat_logits.device)
    if smoothing == 0:
        losses = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="none")
    else:
        neg_log_probs = -F.log_softmax(flat_logits, dim=-1)
        valid = flat_targets.ne(IGNORE_INDEX)
        nll = neg_log_probs.gather(-1, flat_targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        losses = ((1 - smoothing) * nll + smoothing * neg_log_probs.mean(-1)) * valid
    return losses.view(targets.shape)


@dataclass(frozen=True)
class LossHead:
    """
    How one kind of model head turns its outputs and labels into per-row loss sums and item counts.

    Args:
        name (`str`): what the head is, for messages (`"causal_lm"`, `"sequence_classification/regression"`, ...).
        label_keys (`tuple[str, ...]`): the batch keys that hold targets; popped before the forward.
        shift (`bool`): decoder-only LMs predict token t + 1 at position t, so their labels are shifted.
        smoothing (`float`): label smoothing epsilon (cross-entropy heads only).
    """

    name: str
    label_keys: tuple[str, ...] = ("labels",)
    shift: bool = False
    smoothing: float = 0.0

    @property
    def num_terms(self) -> int:
        return 2 if self.name == "question_answering" else 1

    @property
    def weights(self) -> tuple[float, ...]:
        return (0.5, 0.5) if self.name == "question_answering" else (1.0,)

    def pop_labels(self, inputs: dict) -> dict[str, torch.Tensor]:
        """Remove the targets from `inputs` (a dict the caller owns) and return them."""
        labels = {key: inputs.pop(key) for key in self.label_keys if key in inputs}
        # A collator may give the already shifted targets (padding-free packing): transformers' causal LM loss then
        # uses them as they are, and so do we.
        if self.shift and "shift_labels" in inputs:
            labels["shift_labels"] = inputs.pop("shift_labels")
        missing = [key for key in self.label_keys if key not in labels]
        if missing:
            raise KeyError(f"The batch has no {missing} for the {self.name} loss; it has {sorted(inputs)}.")
        return labels

    # ---- targets: the tensor of each term whose valid entries are the items -------------------------------------
    def _targets(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> list[torch.Tensor]:
        if self.name == "question_answering":
            if seq_len is None:
                raise ValueError(
                    "question answering: the batch has no input_ids or attention_mask to read the sequence length "
                    "from, which decides which answer positions lie outside the input; add the attention_mask."
                )
            # transformers clamps positions to [0, L] and ignores L (a position outside the input).
            return [labels[key].reshape(-1).clamp(0, seq_len) for key in self.label_keys]
        target = labels["labels"]
        if self.shift:
            if "shift_labels" in labels:
                target = labels["shift_labels"]
            else:
                target = F.pad(target[..., 1:], (0, 1), value=IGNORE_INDEX)
        return [target]

    def _valid(self, target: torch.Tensor, seq_len: int | None) -> torch.Tensor:
        if self.name == "question_answering":
            return target.ne(seq_len)
        if self.name.startswith("sequence_classification/") and not self.name.endswith("single_label"):
            return torch.ones_like(target, dtype=torch.bool)
        return target.ne(IGNORE_INDEX)

    def count(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> torch.Tensor:
        """Items per term in a batch, from the labels alone (so a step can be counted before it runs)."""
        return torch.stack([self._valid(t, seq_len).sum() for t in self._targets(labels, seq_len)])

    # ---- sums -----------------------------------------------------------------------------------------------------
    def row_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Per-row loss sums and item counts, each `[batch, num_terms]` (float32 sums, int64 counts).

        Rows are the first dimension of the labels, so evaluation can drop the duplicate rows that distributed
        samplers add, and sum the rest.
        """
        if self.name == "question_answering":
            start_logits, end_logits = _logits(outputs, "start_logits"), _logits(outputs, "end_logits")
            seq_len = start_logits.shape[1]
            sums, counts = [], []
            for logits, target in zip((start_logits, end_logits), self._targets(labels, seq_len), strict=True):
                target = target.to(logits.device)
                sums.append(F.cross_entropy(logits.float(), target, ignore_index=seq_len, reduction="none"))
                counts.append(target.ne(seq_len).long())
            return torch.stack(sums, -1), torch.stack(counts, -1)

        logits = _logits(outputs)
        (target,) = self._targets(labels)
        target = target.to(logits.device)
        rows = target.shape[0]
        if self.name == "sequence_classification/regression":
            diff = logits.float().reshape(rows, -1) - target.float().reshape(rows, -1)
            per_row = diff.pow(2)
            return per_row.sum(-1, keepdim=True), torch.full_like(per_row[:, :1], per_row.shape[1], dtype=torch.long)
        if self.name == "sequence_classification/multi_label":
            per_item = F.binary_cross_entropy_with_logits(
                logits.float().reshape(rows, -1), target.float().reshape(rows, -1), reduction="none"
            )
            return per_item.sum(-1, keepdim=True), torch.full_like(
                per_item[:, :1], per_item.shape[1], dtype=torch.long
            )
        # Cross-entropy heads: LMs and token classification give [rows, positions, classes]; sequence-level heads
        # (single-label classification, multiple choice) give [rows, classes], one position per row.
        target = target.reshape(rows, -1)
        logits = logits.reshape(rows, target.shape[1], -1)
        per_position = token_losses(logits, target, self.smoothing)
        valid = target.ne(IGNORE_INDEX)
        return per_position.sum(-1, keepdim=True), valid.sum(-1, keepdim=True)

    def combine(self, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`sum_k weight_k * sums_k / counts_k`, where a term with no item contributes 0 (never NaN)."""
        counts = counts.to(sums.device, sums.dtype)
        weights = torch.tensor(self.weights, device=sums.device, dtype=sums.dtype)
        return (weights * sums / counts.clamp(min=1)).sum()


def _problem_type(config, labels: torch.Tensor | None) -> str:
    """transformers' rule in `ForSequenceClassificationLoss`, which also stores it on the config."""
    if config.problem_type is None and labels is not None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    return config.problem_type


def resolve_head(
    model: nn.Module,
    label_names: list[str] | None = None,
    label_smoothing: float = 0.0,
    sample_labels: torch.Tensor | None = None,
) -> LossHead:
    """
    The `LossHead` of a (unwrapped) transformers model, or `UnsupportedHead` saying why there is none.

    Args:
        model (`nn.Module`): the model, unwrapped from DataParallel/DDP.
        label_names (`list[str]`, *optional*): the Trainer's label names; the defaults of the head when `None`.
        label_smoothing (`float`, *optional*, defaults to 0): `TrainingArguments.label_smoothing_factor`.
        sample_labels (`torch.Tensor`, *optional*): a batch's `labels`, to settle a sequence classifier's
            `problem_type` the way transformers does when the config leaves it unset.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedHead(f"{name} has no `config`: not a transformers model with a known head.")
    if getattr(config, "output_router_logits", False):
        raise UnsupportedHead(
            f"{name} adds a router auxiliary loss (config.output_router_logits=True) that the logits do not carry."
        )

    def expect(keys: tuple[str, ...]) -> tuple[str, ...]:
        if label_names is not None and tuple(label_names) != keys:
            raise UnsupportedHead(
                f"{name} takes labels {list(keys)}, but the Trainer's label_names are {label_names}."
            )
        return keys

    if name in QUESTION_ANSWERING:
        if label_smoothing:
            raise UnsupportedHead(f"label smoothing does not apply to {name}'s start/end positions.")
        return LossHead("question_answering", expect(("start_positions", "end_positions")))
    if name in SEQUENCE_CLASSIFICATION:
        problem = _problem_type(config, sample_labels)
        if problem is None:
            raise UnsupportedHead(f"{name}: problem_type is unset and no labels were seen to settle it.")
        if problem == "single_label_classification":
            return LossHead("sequence_classification/single_label", expect(("labels",)), smoothing=label_smoothing)
        if label_smoothing:
            raise UnsupportedHead(f"label smoothing does not apply to {name} with problem_type={problem!r}.")
        short = {"regression": "regression", "multi_label_classification": "multi_label"}.get(problem)
        if short is None:
            raise UnsupportedHead(f"{name} has an unknown problem_type {problem!r}.")
        return LossHead(f"sequence_classification/{short}", expect(("labels",)))
    if getattr(config, "is_encoder_decoder", False) and name in SEQ2SEQ_LM:
        return LossHead("seq2seq_lm", expect(("labels",)), smoothing=label_smoothing)
    if name in CAUSAL_LM and not getattr(config, "is_encoder_decoder", False):
        return LossHead("causal_lm", expect(("labels",)), shift=True, smoothing=label_smoothing)
    for head_name, names in (
        ("masked_lm", MASKED_LM),
        ("token_classification", TOKEN_CLASSIFICATION),
        ("multiple_choice", MULTIPLE_CHOICE),
    ):
        if name in names:
            return LossHead(head_name, expect(("labels",)), smoothing=label_smoothing)
    raise UnsupportedHead(
        f"{name} is not a head hf_parallel knows (causal/seq2seq/masked LM, token/sequence classification, "
        "multiple choice, question answering)."
    )


@dataclass(frozen=True)
class StepCounts:
    """
    The item counts of one whole optimizer step (all micro-batches, all ranks), per loss term.

    The Trainer hands it to `compute_loss` as `num_items_in_batch`; its type tells an exact step from a stock one.
    `scale` is the factor that undoes DDP's gradient averaging (the number of processes; 1 without DDP).
    """

    counts: torch.Tensor
    scale: int = 1

    def total(self) -> torch.Tensor:
        return self.counts.sum()


class EvalTotals:
    """Running sums of per-row loss sums and item counts over an evaluation set; `value()` divides once."""

    def __init__(self):
        self.head: LossHead | None = None
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def add(self, head: LossHead, row_sums: torch.Tensor, row_counts: torch.Tensor) -> None:
        """Add the rows of one batch (already gathered from all ranks, duplicates dropped)."""
        self.head = head
        sums, counts = row_sums.detach().double().sum(0), row_counts.detach().sum(0)
        if self.sums is None:
            self.sums, self.counts = sums, counts
        else:
            self.sums, self.counts = self.sums + sums.to(self.sums.device), self.counts + counts.to(self.counts.device)

    def value(self) -> float | None:
        if self.sums is None:
            return None
        return self.head.combine(self.sums, self.counts).item()
