"""
Cross-entropy over classes (`CrossEntropyHead`): causal, masked and multimodal LMs, token classification, multiple
choice and single-label sequence classification. Items are the targets that are not ignored (-100), after the causal
shift for decoder-only LMs; the sum is the per-position cross-entropy (`token_losses`, with transformers' label
smoothing); the families warn of nothing of their own.

```python
from hf_parallel.exact import CrossEntropyHead

head = CrossEntropyHead(shift=True, name="causal_lm")
labels = head.pop_labels(batch)  # batch no longer holds "labels"
sums, counts = head.row_terms(model(**batch), labels)
loss = head.combine(sums.sum(0), counts.sum(0))  # what the model's own loss gives on this batch
```
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .base import IGNORE_INDEX, NO_GRAD_CHUNK_ELEMENTS, HeadFamily, HeadMismatch, LossHead, _logits, class_names

__all__ = ["CAUSAL_LM", "MASKED_LM", "TOKEN_CLASSIFICATION", "CrossEntropyHead", "token_losses"]


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
    # torch's label smoothing is transformers' `LabelSmoother` per position: (1 - eps) * nll + eps * the mean over the
    # vocabulary of -log p, 0 where the target is ignored.
    return F.cross_entropy(
        flat_logits.float(), flat_targets, ignore_index=IGNORE_INDEX, reduction="none", label_smoothing=smoothing
    )


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
        shift_ambiguous (`bool`, *optional*): whether the check also tries the other causal shift; defaults to
            `per_position` (an encoder-decoder's LM passes False: its labels are never shifted).
    """

    ignore_index_items = True

    def __init__(
        self,
        label_keys: tuple[str, ...] = ("labels",),
        name: str | None = None,
        *,
        shift: bool = False,
        smoothing: float = 0.0,
        builds_decoder_inputs: bool = False,
        per_position: bool = False,
        shift_ambiguous: bool | None = None,
    ):
        super().__init__(label_keys, name)
        self.shift = shift
        self.smoothing = smoothing
        self.builds_decoder_inputs = builds_decoder_inputs
        self.per_position = per_position
        self.shift_ambiguous = per_position if shift_ambiguous is None else shift_ambiguous

    def pop_labels(self, inputs: dict) -> dict[str, torch.Tensor]:
        labels = super().pop_labels(inputs)
        # A collator may give the already shifted targets (padding-free packing): transformers' causal LM loss then
        # uses them as they are, and so do we.
        if self.shift and "shift_labels" in inputs:
            labels["shift_labels"] = inputs.pop("shift_labels")
        return labels

    def targets(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> list[torch.Tensor]:
        if not self.shift:
            return [labels["labels"]]
        if "shift_labels" in labels:
            return [labels["shift_labels"]]
        return [F.pad(labels["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)]

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


def _cross_entropy(head_name: str, **options) -> Callable[..., LossHead]:
    def build(name: str, model, labels, smoothing: float) -> LossHead:
        return CrossEntropyHead(name=head_name, smoothing=smoothing, **options)

    return build


CAUSAL_LM = HeadFamily(
    class_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    _cross_entropy("causal_lm", shift=True, per_position=True),
    encoder_decoder=False,
    label_smoothing=True,
)
MASKED_LM = HeadFamily(
    class_names("MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    _cross_entropy("masked_lm", per_position=True),
    label_smoothing=True,
)
TOKEN_CLASSIFICATION = HeadFamily(
    class_names("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    _cross_entropy("token_classification", per_position=True),
    label_smoothing=True,
)
