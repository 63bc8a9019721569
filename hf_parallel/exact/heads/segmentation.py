"""
Semantic segmentation (`*ForSemanticSegmentation`: Segformer, BEiT, DPT, MobileViT, UperNet, ...): per-pixel
cross-entropy at the labels' resolution.

The models upsample their logits to the size of the labels (bilinear, `align_corners=False`) and take the mean
cross-entropy over the pixels that are not the ignore index (`config.semantic_loss_ignore_index`, UperNet's
`config.loss_ignore_index`; 255 by default). The items are those pixels: an image with more labelled pixels weighs
more, so a mean of per-micro-batch means is off wherever images are labelled unevenly.

An auxiliary head (`config.use_auxiliary_head`: BEiT, Data2VecVision, DPT, UperNet) adds
`auxiliary_loss_weight` x the same mean cross-entropy of its own logits, over the same pixels. The outputs do not
carry those logits: the head records them as the model's `auxiliary_head` returns them (`LossCallWatch`), and the
terms of a row are the main sum plus the weighted auxiliary sum, over the row's labelled pixels.

Not a sum over pixels, and left to the stock loss with a warning (`resolve`): a single-label map (`num_labels == 1`),
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
from torch import nn

from .base import LOSS_CALL_KEY, HeadFamily, HeadMismatch, LossCall, LossHead, UnsupportedHead, _logits, class_names

__all__ = ["SEMANTIC_SEGMENTATION", "SegmentationHead"]


class SegmentationHead(LossHead):
    """
    Per-pixel cross-entropy of `[rows, classes, h, w]` logits, upsampled to the `[rows, H, W]` labels.

    Args:
        ignore_index (`int`, *optional*, defaults to 255): the label of pixels without a class.
        name (`str`, *optional*): for messages.
        auxiliary_weight (`float`, *optional*): `config.auxiliary_loss_weight` of a model with an auxiliary head,
            whose logits (recorded from its `auxiliary_head`) add that weight times their own per-pixel sums.
    """

    def __init__(self, ignore_index: int = 255, name: str | None = None, auxiliary_weight: float | None = None):
        super().__init__(("labels",), name or "semantic_segmentation")
        self.ignore_index = int(ignore_index)
        self.auxiliary_weight = auxiliary_weight
        if auxiliary_weight is not None:
            self.loss_call = LossCall(submodules=("auxiliary_head",))

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
        sums = self._pixel_sums(logits, target)
        if self.auxiliary_weight is not None:
            auxiliary = labels.get(LOSS_CALL_KEY, {}).get("auxiliary_head")
            if not torch.is_tensor(auxiliary):
                raise HeadMismatch(f"{self.name}: the model's auxiliary_head did not run in its forward.")
            sums = sums + self.auxiliary_weight * self._pixel_sums(auxiliary, target)
        return sums, self.valid(target).flatten(1).sum(-1, keepdim=True)

    def _pixel_sums(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        upsampled = F.interpolate(logits, size=target.shape[-2:], mode="bilinear", align_corners=False)
        losses = F.cross_entropy(upsampled.float(), target.long(), ignore_index=self.ignore_index, reduction="none")
        return losses.flatten(1).sum(-1, keepdim=True)


def _segmentation(name: str, model, labels, smoothing: float) -> LossHead:
    config = model.config
    if getattr(config, "num_labels", 2) == 1:
        raise UnsupportedHead(f"{name} with num_labels=1 has a binary loss averaged over every pixel, ignored or not.")
    ignore = getattr(config, "semantic_loss_ignore_index", getattr(config, "loss_ignore_index", 255))
    weight = None
    if getattr(config, "use_auxiliary_head", False):
        weight = getattr(config, "auxiliary_loss_weight", None)
        if not isinstance(getattr(model, "auxiliary_head", None), nn.Module) or not isinstance(weight, (int, float)):
            raise UnsupportedHead(
                f"{name} adds an auxiliary head's loss (config.use_auxiliary_head=True) without an auxiliary_head "
                "module and an auxiliary_loss_weight hf_parallel can read; set use_auxiliary_head=False in its "
                "config to train it exactly without that head."
            )
        weight = float(weight)
    return SegmentationHead(ignore_index=ignore, auxiliary_weight=weight)


SEMANTIC_SEGMENTATION = HeadFamily(class_names("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES"), _segmentation)
