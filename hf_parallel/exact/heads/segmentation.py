"""
Semantic segmentation (`*ForSemanticSegmentation`: Segformer, BEiT, DPT, MobileViT, UperNet, ...): per-pixel
cross-entropy at the labels' resolution.

The models upsample their logits to the size of the labels (bilinear, `align_corners=False`) and take the mean
cross-entropy over the pixels that are not the ignore index (`config.semantic_loss_ignore_index`, UperNet's
`config.loss_ignore_index`; 255 by default). The items are those pixels: an image with more labelled pixels weighs
more, so a mean of per-micro-batch means is off wherever images are labelled unevenly.

Not a sum over pixels, and left to the stock loss with a warning (`resolve`): an auxiliary head's loss
(`config.use_auxiliary_head`), whose logits the outputs do not carry, and a single-label map (`num_labels == 1`),
which Segformer averages over every pixel, ignored or not.

```python
from hf_parallel.exact.heads.segmentation import SegmentationHead

head = SegmentationHead(ignore_index=255)
sums, counts = head.row_terms(model(pixel_values=images), {"labels": maps})  # [images, 1] each
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import HeadFamily, HeadMismatch, LossHead, UnsupportedHead, _logits, class_names

__all__ = ["SEMANTIC_SEGMENTATION", "SegmentationHead"]


class SegmentationHead(LossHead):
    """
    Per-pixel cross-entropy of `[rows, classes, h, w]` logits, upsampled to the `[rows, H, W]` labels.

    Args:
        ignore_index (`int`, *optional*, defaults to 255): the label of pixels without a class.
        name (`str`, *optional*): for messages.
    """

    def __init__(self, ignore_index: int = 255, name: str | None = None):
        super().__init__(("labels",), name or "semantic_segmentation")
        self.ignore_index = int(ignore_index)

    def valid(self, target: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return target.ne(self.ignore_index)

    def row_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _logits(outputs)
        target = labels["labels"].to(logits.device)
        if logits.dim() != 4 or target.dim() != 3 or logits.shape[0] != target.shape[0]:
            raise HeadMismatch(
                f"{self.name}: logits of shape {tuple(logits.shape)} and labels of shape {tuple(target.shape)} are "
                "not [images, classes, h, w] and [images, H, W]."
            )
        upsampled = F.interpolate(logits, size=target.shape[-2:], mode="bilinear", align_corners=False)
        losses = F.cross_entropy(upsampled.float(), target.long(), ignore_index=self.ignore_index, reduction="none")
        return losses.flatten(1).sum(-1, keepdim=True), self.valid(target).flatten(1).sum(-1, keepdim=True)


def _segmentation(name: str, model, labels, smoothing: float) -> LossHead:
    config = model.config
    if smoothing:
        raise UnsupportedHead(f"label smoothing does not apply to {name}'s per-pixel loss.")
    if getattr(config, "use_auxiliary_head", False):
        raise UnsupportedHead(
            f"{name} adds an auxiliary head's loss (config.use_auxiliary_head=True) whose logits its outputs do not "
            "carry; set use_auxiliary_head=False in its config to train it exactly without that head."
        )
    if getattr(config, "num_labels", 2) == 1:
        raise UnsupportedHead(f"{name} with num_labels=1 has a binary loss averaged over every pixel, ignored or not.")
    ignore = getattr(config, "semantic_loss_ignore_index", getattr(config, "loss_ignore_index", 255))
    return SegmentationHead(ignore_index=ignore)


SEMANTIC_SEGMENTATION = HeadFamily(class_names("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES"), _segmentation)
