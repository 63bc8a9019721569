"""
Head families hf_parallel knows and cannot make exact: their loss is not a sum over items that a split of the batch
preserves. Each row names why; the Trainer keeps the stock loss for them, with one warning that says it.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import HeadFamily, LossHead, UnsupportedHead, class_names

__all__ = ["NOT_A_SUM", "NOT_A_SUM_FAMILIES"]

# Losses that are not a sum over items, by mapping: why each stays on the stock loss.
NOT_A_SUM = {
    "MODEL_FOR_ZERO_SHOT_OBJECT_DETECTION_MAPPING_NAMES": "matches predictions to boxes over the whole batch",
    "MODEL_FOR_UNIVERSAL_SEGMENTATION_MAPPING_NAMES": "matches predicted masks to the labels' masks over the batch",
    "MODEL_FOR_INSTANCE_SEGMENTATION_MAPPING_NAMES": "matches predicted masks to the labels' masks over the batch",
    "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES": "is a scale-invariant log loss of the whole batch, not a sum over "
    "pixels",
    "MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES": "reconstructs masked patches (normalised targets, a mask the "
    "model may draw itself), which the logits do not give per item",
    "MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES": "is an additive-margin softmax of speaker embeddings",
    "MODEL_FOR_PRETRAINING_MAPPING_NAMES": "adds pre-training objectives the logits do not carry",
}


def _not_a_sum(reason: str) -> Callable[..., LossHead]:
    def build(name: str, model, labels, smoothing: float) -> LossHead:
        raise UnsupportedHead(f"{name}'s loss {reason}: it is not a sum over items that can be split exactly.")

    return build


NOT_A_SUM_FAMILIES = tuple(
    HeadFamily(class_names(mapping), _not_a_sum(reason)) for mapping, reason in NOT_A_SUM.items()
)
