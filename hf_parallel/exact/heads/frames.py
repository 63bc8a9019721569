"""
Audio frame classification (`*ForAudioFrameClassification`: Wav2Vec2, WavLM, Data2VecAudio, ...): one class per frame.

The models take their labels as one-hot (or multi-hot) frames, `[rows, frames, classes]`, and compute the mean
cross-entropy of every frame against its label's arg-max, over all frames of all rows: the items are the frames, each
row's as many as the logits have (padding frames too, as the models count them).

```python
from hf_parallel.exact.heads.frames import FrameClassificationHead

sums, counts = FrameClassificationHead().row_terms(model(input_values=audio), {"labels": one_hot_frames})
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import HeadFamily, HeadMismatch, LossHead, _logits, class_names

__all__ = ["AUDIO_FRAME_CLASSIFICATION", "FrameClassificationHead"]


class FrameClassificationHead(LossHead):
    """Cross-entropy of each frame's logits against the arg-max of its one-hot label; every frame is an item."""

    def __init__(self, name: str | None = None):
        super().__init__(("labels",), name or "audio_frame_classification")

    def count(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> torch.Tensor:
        target = labels["labels"]
        return torch.tensor([target[..., 0].numel()], device=target.device)

    def row_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _logits(outputs)
        target = labels["labels"].to(logits.device)
        if target.dim() != 3 or logits.shape != target.shape:
            raise HeadMismatch(
                f"{self.name}: logits of shape {tuple(logits.shape)} and labels of shape {tuple(target.shape)} are "
                "not both [rows, frames, classes]."
            )
        losses = F.cross_entropy(logits.float().flatten(0, 1), target.argmax(-1).flatten(), reduction="none")
        frames = target.shape[1]
        sums = losses.view(target.shape[0], frames).sum(-1, keepdim=True)
        return sums, torch.full_like(sums, frames, dtype=torch.long)


def _frames(name: str, model, labels, smoothing: float) -> LossHead:
    return FrameClassificationHead()


AUDIO_FRAME_CLASSIFICATION = HeadFamily(class_names("MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES"), _frames)
