"""
Classification and regression heads beyond the token level: a sequence classifier by its `problem_type` (single
label: cross-entropy; multi-label: binary cross-entropy over every label element; regression: squared error over every
label element), multiple choice, classifiers of images, videos and audio clips (transformers gives them the sequence
classifier's loss), and extractive question answering (two weighted terms: start and end positions). Label smoothing
applies to the single-label cross-entropy only; elsewhere it rules the head out, naming why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import HeadFamily, LossHead, ProblemTypeUnsettled, UnsupportedHead, _logits, class_names
from .tokens import CrossEntropyHead, _cross_entropy

__all__ = [
    "MEDIA_CLASSIFICATION",
    "MULTIPLE_CHOICE",
    "QUESTION_ANSWERING",
    "SEQUENCE_CLASSIFICATION",
    "MultiLabelHead",
    "QuestionAnsweringHead",
    "RegressionHead",
]


class _ElementwiseHead(LossHead):
    """A loss over every label element (no ignored entries): each element of a row's labels is an item. Subclasses
    define `_per_item(logits, target)`, the loss of each element."""

    def valid(self, target: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return torch.ones_like(target, dtype=torch.bool)

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


def _problem_type(config, labels: torch.Tensor | None) -> str | None:
    """transformers' rule in `ForSequenceClassificationLoss`, which also stores it on the config."""
    if config.problem_type is None and labels is not None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    return config.problem_type


def _sequence_classification(name: str, model, labels, smoothing: float) -> LossHead:
    problem = _problem_type(model.config, labels)
    if problem is None:
        raise ProblemTypeUnsettled(f"{name}: problem_type is unset and no labels were seen to settle it.")
    if problem == "single_label_classification":
        return CrossEntropyHead(name="sequence_classification/single_label", smoothing=smoothing)
    if problem == "regression":
        return RegressionHead(name="sequence_classification/regression")
    if problem == "multi_label_classification":
        return MultiLabelHead(name="sequence_classification/multi_label")
    raise UnsupportedHead(f"{name} has an unknown problem_type {problem!r}.")


def _question_answering(name: str, model, labels, smoothing: float) -> LossHead:
    return QuestionAnsweringHead()


QUESTION_ANSWERING = HeadFamily(class_names("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"), _question_answering)
SEQUENCE_CLASSIFICATION = HeadFamily(
    class_names("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"), _sequence_classification, label_smoothing=True
)
MULTIPLE_CHOICE = HeadFamily(
    class_names("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES"), _cross_entropy("multiple_choice"), label_smoothing=True
)
# A classifier of images, videos or audio clips has the loss of a sequence classifier (transformers maps them to
# `ForSequenceClassificationLoss`, or writes the same rule out).
MEDIA_CLASSIFICATION = HeadFamily(
    class_names(
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES",
        "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    ),
    _sequence_classification,
    label_smoothing=True,
)
