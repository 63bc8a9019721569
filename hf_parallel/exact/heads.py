"""
Loss heads: how each kind of model head turns its outputs and labels into per-row loss **sums** and item **counts**.

One class per kind of loss: token-level and sequence-level cross-entropy (`CrossEntropyHead`, with the causal shift
and label smoothing), multi-label BCE (`MultiLabelHead`), regression (`RegressionHead`) and question answering
(`QuestionAnsweringHead`, two weighted terms). Each gives, for a batch:
- `count(labels)`: the items per term, from the labels alone, so that a step can be counted before it runs;
- `row_terms(outputs, labels)`: `[rows, terms]` loss sums and item counts;
- `combine(sums, counts)`: `sum_k weight_k * sums_k / counts_k`, a term without items contributing 0.

```python
from hf_parallel.exact import CrossEntropyHead

head = CrossEntropyHead(shift=True, name="causal_lm")
labels = head.pop_labels(batch)  # batch no longer holds "labels"
sums, counts = head.row_terms(model(**batch), labels)
loss = head.combine(sums.sum(0), counts.sum(0))  # what the model's own loss gives on this batch
```
"""

from __future__ import annotations

import copy
import enum

import torch
import torch.nn.functional as F

__all__ = [
    "IGNORE_INDEX",
    "NO_GRAD_CHUNK_ELEMENTS",
    "CrossEntropyHead",
    "HeadMismatch",
    "LossHead",
    "MultiLabelHead",
    "QuestionAnsweringHead",
    "RegressionHead",
    "Route",
    "routed",
    "token_losses",
]

IGNORE_INDEX = -100
#: Logits entries per chunk of a per-position loss computed without autograd (64 MiB of float32).
NO_GRAD_CHUNK_ELEMENTS = 2**24


class HeadMismatch(ValueError):
    """
    A head's loss cannot be computed from these outputs and labels (their shapes do not match: something between
    them adds or drops positions). In the checked forward it only rules the head out; after it, it stops the run.
    """


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
    flat_logits = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1).to(flat_logits.device)
    positions = max(1, NO_GRAD_CHUNK_ELEMENTS // vocab)
    if not torch.is_grad_enabled() and flat_logits.shape[0] > positions:
        # Without autograd nothing is kept for a backward: a chunk's float copy and log-softmax at a time, not the
        # whole batch's (a logits-sized buffer more at the peak of a check or an evaluation, for an LLM's vocabulary).
        chunks = zip(flat_logits.split(positions), flat_targets.split(positions), strict=True)
        return torch.cat([_flat_token_losses(lg, tg, smoothing) for lg, tg in chunks]).view(targets.shape)
    return _flat_token_losses(flat_logits, flat_targets, smoothing).view(targets.shape)


def _flat_token_losses(flat_logits: torch.Tensor, flat_targets: torch.Tensor, smoothing: float) -> torch.Tensor:
    flat_logits = flat_logits.float()
    if smoothing == 0:
        losses = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="none")
    else:
        neg_log_probs = -F.log_softmax(flat_logits, dim=-1)
        valid = flat_targets.ne(IGNORE_INDEX)
        nll = neg_log_probs.gather(-1, flat_targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        losses = ((1 - smoothing) * nll + smoothing * neg_log_probs.mean(-1)) * valid
    return losses


class Route(enum.Enum):
    """
    How a head's micro-batch loss S / C is made (the table in `hf_parallel.exact`'s docstring says which heads take
    which, and why). The Trainer's stock loss, where no head applies, is no route: the head is None.
    """

    #: The labels are kept out of the forward; S is computed from the logits by the head (the default).
    RECOMPUTED = "recomputed"
    #: The labels stay in the forward (the model builds its decoder inputs from them); S from the logits, as above.
    LABELS_IN_FORWARD = "labels_in_forward"
    #: The model's own loss, given its labels and `num_items_in_batch` = C, is S / C itself (it honours the count).
    MODEL_LOSS = "model_loss"
    #: The Trainer's `compute_loss_func`, given the step's count; the head only counts the items.
    USER_LOSS = "user_loss"


def routed(head: LossHead, route: Route) -> LossHead:
    """
    A copy of `head` that takes `route`; the one place a route is set. A route the check chose names the head for it
    (`causal_lm/model_loss`); the user's loss keeps the head's name.
    """
    other = copy.copy(head)
    other.route = route
    if route in (Route.MODEL_LOSS, Route.LABELS_IN_FORWARD) and not head.name.endswith(f"/{route.value}"):
        other.name = f"{head.name}/{route.value}"
    return other


class LossHead:
    """
    The base of every head: label keys, term weights, counting, combining. Subclasses say what a target is, which of
    its entries are items, and how the per-row sums are computed.

    Args:
        label_keys (`tuple[str, ...]`, *optional*, defaults to `("labels",)`):
            The batch keys that hold targets; popped before the forward.
        name (`str`, *optional*):
            What the head is, for messages (`"causal_lm"`, `"sequence_classification/regression"`, ...).
    """

    #: How the micro-batch's loss is made (`Route`); set with `routed`.
    route: Route = Route.RECOMPUTED
    #: Weight of each loss term in `combine`.
    weights: tuple[float, ...] = (1.0,)
    #: Whether the model builds its decoder inputs from the labels (encoder-decoder LMs): without the labels, the
    #: caller must build them.
    builds_decoder_inputs: bool = False
    #: Whether the targets are the labels shifted by one position (decoder-only LMs).
    shift: bool = False
    #: Whether the logits have one row per label position (LMs, token classification), not one per sample.
    per_position: bool = False
    #: Whether the model's loss is a plain sum over its items (CTC with `ctc_loss_reduction="sum"`): nothing divides
    #: it, so the step's loss is the sum of its micro-batches' sums, and `combine` ignores the counts.
    summed: bool = False
    #: The arguments of the model's own `loss_function` call the head needs (e.g. CTC's `logit_lengths`): the labels
    #: then stay in the forward, and `LossCallWatch` records them into the labels under `LOSS_CALL_KEY`.
    loss_call_arguments: tuple[str, ...] = ()
    #: The router auxiliary loss the model adds to this head's (a MoE LM with `output_router_logits=True`), made
    #: exact over the whole batch by `hf_parallel.exact.router`; None for a model without one.
    router = None

    def __init__(self, label_keys: tuple[str, ...] = ("labels",), name: str | None = None):
        self.label_keys = tuple(label_keys)
        self.name = name or type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, label_keys={self.label_keys})"

    @property
    def num_terms(self) -> int:
        return len(self.weights)

    def has_labels(self, batch) -> bool:
        """Whether `batch` holds every label key of this head."""
        return all(key in batch for key in self.label_keys)

    def pop_labels(self, inputs: dict) -> dict[str, torch.Tensor]:
        """Remove the targets from `inputs` (a dict the caller owns) and return them."""
        labels = {key: inputs.pop(key) for key in self.label_keys if key in inputs}
        missing = [key for key in self.label_keys if key not in labels]
        if missing:
            raise KeyError(f"The batch has no {missing} for the {self.name} loss; it has {sorted(inputs)}.")
        return labels

    def targets(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> list[torch.Tensor]:
        """One tensor per term whose valid entries are the items."""
        return [labels["labels"]]

    def valid(self, target: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Which entries of a target are items."""
        return target.ne(IGNORE_INDEX)

    def count(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> torch.Tensor:
        """Items per term in a batch, from the labels alone (so a step can be counted before it runs)."""
        return torch.stack([self.valid(t, seq_len).sum() for t in self.targets(labels, seq_len)])

    def row_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Per-row loss sums and item counts, each `[rows, num_terms]` (float32 sums, int64 counts).

        Rows are the first dimension of the labels, so evaluation can drop the duplicate rows that distributed
        samplers add, and sum the rest.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define row_terms.")

    def combine(self, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """
        `sum_k weight_k * sums_k / counts_k`, where a term with no item contributes 0 (never NaN); `sum_k weight_k *
        sums_k` for a `summed` head.
        """
        if self.summed:
            return sum(weight * sums[..., k].sum() for k, weight in enumerate(self.weights))
        ratios = sums / counts.to(sums.device, sums.dtype).clamp(min=1)
        # Python floats, not a tensor of the weights: building one each micro-batch is a host-to-device copy (and a
        # sync on CUDA) in the hot path.
        first = self.weights[0]
        if all(weight == first for weight in self.weights):
            return ratios.sum() * first if first != 1 else ratios.sum()
        return sum(weight * ratios[..., k].sum() for k, weight in enumerate(self.weights))


class CrossEntropyHead(LossHead):
    """
    Cross-entropy over classes, ignoring targets equal to -100: LMs and token classification (`[rows, positions,
    classes]` logits), single-label sequence classification and multiple choice (`[rows, classes]`). Items are the
    targets that are not ignored.

    Args:
        label_keys (`tuple[str, ...]`, *optional*, defaults to `("labels",)`): the batch keys of the targets.
        name (`str`, *optional*): for messages.
        shift (`bool`, *optional*, defaults to `False`): decoder-only LMs predict token t + 1 at position t; a
            `shift_labels` entry in the batch (padding-free packing) is then used as the targets as it is.
        smoothing (`float`, *optional*, defaults to 0): label smoothing epsilon.
        builds_decoder_inputs (`bool`, *optional*, defaults to `False`): encoder-decoder LMs.
        per_position (`bool`, *optional*, defaults to `False`): the logits have one row per position of the labels
            (LMs, token classification), not one per sample.
    """

    def __init__(
        self,
        label_keys: tuple[str, ...] = ("labels",),
        name: str | None = None,
        *,
        shift: bool = False,
        smoothing: float = 0.0,
        builds_decoder_inputs: bool = False,
        per_position: bool = False,
    ):
        super().__init__(label_keys, name)
        self.shift = shift
        self.smoothing = smoothing
        self.builds_decoder_inputs = builds_decoder_inputs
        self.per_position = per_position

    def pop_labels(self, inputs: dict) -> dict[str, torch.Tensor]:
        labels = super().pop_labels(inputs)
        # A collator may give the already shifted targets (padding-free packing): transformers' causal LM loss then
        # uses them as they are, and so do we.
        if self.shift and "shift_labels" in inputs:
            labels["shift_labels"] = inputs.pop("shift_labels")
        return labels

    def targets(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> list[torch.Tensor]:
        target = labels["labels"]
        if self.shift:
            if "shift_labels" in labels:
                target = labels["shift_labels"]
            else:
                target = F.pad(target[..., 1:], (0, 1), value=IGNORE_INDEX)
        return [target]

    def position_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position losses and items, each `[rows, positions]` (one position per row for sequence-level heads)."""
        logits = _logits(outputs)
        (target,) = self.targets(labels)
        rows = target.shape[0]
        target = target.to(logits.device).reshape(rows, -1)
        if self.per_position and logits.shape[1] != target.shape[1]:
            raise HeadMismatch(
                f"{self.name}: the model gives logits for {logits.shape[1]} positions but the labels have "
                f"{target.shape[1]}; something between them adds or drops positions (e.g. virtual tokens), so the "
                "loss cannot be matched to the labels. Set exact_loss=False for this model."
            )
        logits = logits.reshape(rows, target.shape[1], -1)
        return token_losses(logits, target, self.smoothing), target.ne(IGNORE_INDEX)

    def row_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        losses, valid = self.position_terms(outputs, labels)
        return losses.sum(-1, keepdim=True), valid.sum(-1, keepdim=True)


class _ElementwiseHead(LossHead):
    """A loss over every label element (no ignored entries): each element of a row's labels is an item."""

    def valid(self, target: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return torch.ones_like(target, dtype=torch.bool)

    def _per_item(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def row_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _logits(outputs)
        (target,) = self.targets(labels)
        rows = target.shape[0]
        per_item = self._per_item(logits.float().reshape(rows, -1), target.to(logits.device).float().reshape(rows, -1))
        return per_item.sum(-1, keepdim=True), torch.full_like(per_item[:, :1], per_item.shape[1], dtype=torch.long)


class RegressionHead(_ElementwiseHead):
    """Mean squared error over every label element (sequence classification with `problem_type="regression"`)."""

    def _per_item(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (logits - target).pow(2)


class MultiLabelHead(_ElementwiseHead):
    """Binary cross-entropy over every label element (`problem_type="multi_label_classification"`)."""

    def _per_item(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, target, reduction="none")


class QuestionAnsweringHead(LossHead):
    """
    Extractive question answering: `0.5 * S_start / C_start + 0.5 * S_end / C_end`, as transformers'
    `ForQuestionAnsweringLoss`, where positions are clamped to `[0, L]` and `L` (outside the input) is ignored.
    """

    weights = (0.5, 0.5)

    def __init__(self, label_keys: tuple[str, ...] = ("start_positions", "end_positions"), name: str | None = None):
        super().__init__(label_keys, name or "question_answering")

    def targets(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> list[torch.Tensor]:
        if seq_len is None:
            raise ValueError(
                "question answering: the batch has no input_ids or attention_mask to read the sequence length "
                "from, which decides which answer positions lie outside the input; add the attention_mask."
            )
        return [labels[key].reshape(-1).clamp(0, seq_len) for key in self.label_keys]

    def valid(self, target: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return target.ne(seq_len)

    def row_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        start_logits, end_logits = _logits(outputs, "start_logits"), _logits(outputs, "end_logits")
        seq_len = start_logits.shape[1]
        sums, counts = [], []
        for logits, target in zip((start_logits, end_logits), self.targets(labels, seq_len), strict=True):
            target = target.to(logits.device)
            sums.append(F.cross_entropy(logits.float(), target, ignore_index=seq_len, reduction="none"))
            counts.append(self.valid(target, seq_len).long())
        return torch.stack(sums, -1), torch.stack(counts, -1)
