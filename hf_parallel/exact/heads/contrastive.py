"""
Contrastive dual encoders (CLIP, SigLIP, ALIGN, CLAP, ... with `return_loss=True`): the head and the variants of its
loss. Each row's loss depends on every other row of its batch, so it is no sum over rows: the head counts the step's
rows (for the record) and `hf_parallel.exact.coupled` computes the loss on the embeddings of the whole step. A model
whose scale parameters hf_parallel does not know is ruled out, naming them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.trainer_pt_utils import find_batch_size

from .base import HeadFamily, LossHead, UnsupportedHead, class_names

__all__ = ["CONTRASTIVE", "ContrastiveHead", "ContrastiveVariant", "contrastive_variant", "rows_of"]


def _cross_entropy(logits: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    targets = torch.arange(logits.shape[0], device=logits.device)
    return F.cross_entropy(logits, targets, label_smoothing=smoothing)


def _clip(model: Any, text: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    logits = (text @ other.t()) * model.logit_scale.float().exp()
    return (_cross_entropy(logits) + _cross_entropy(logits.t())) / 2


def _siglip(model: Any, text: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    logits = (text @ other.t()) * model.logit_scale.float().exp() + model.logit_bias.float()
    return _pairwise_sigmoid(logits)


def _pairwise_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """SigLIP's loss on square logits: a sigmoid per pair, the diagonal the positives, summed per row, averaged."""
    signs = 2 * torch.eye(logits.shape[0], device=logits.device) - 1
    return -F.logsigmoid(signs * logits).sum(-1).mean()


def _temperature(smoothing: float) -> Callable[..., torch.Tensor]:
    def loss(model: Any, text: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        logits = (text @ other.t()) / model.temperature.float()
        return (_cross_entropy(logits, smoothing) + _cross_entropy(logits.t(), smoothing)) / 2

    return loss


def _clap(model: Any, text: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    # As ClapModel: both terms over the texts' rows, each with its own scale.
    per_text = (text @ audio.t()) * model.logit_scale_t.float().exp()
    per_audio = (audio @ text.t()) * model.logit_scale_a.float().exp()
    return (_cross_entropy(per_text) + _cross_entropy(per_audio.t())) / 2


def _videoprism(model: Any, text: torch.Tensor, video: torch.Tensor) -> torch.Tensor:
    # As VideoPrismClipModel without a `temperature` argument (a batch that passes one is the check's to catch): each
    # video's similarities exponentiated and normalised over the texts, then SigLIP's pairwise sigmoid terms on them.
    similarity = (video @ text.t()).exp()
    return _pairwise_sigmoid(similarity.t() / similarity.t().sum(0, keepdim=True))


@dataclass(frozen=True)
class ContrastiveVariant:
    """
    How a contrastive model's loss is made from its two embeddings.

    Args:
        name (`str`): "clip", "siglip", "align", "temperature", "clap" or "videoprism".
        keys (`tuple[str, str]`): the output keys of the text embeddings and the other modality's.
        loss (`Callable`): `loss(model, text, other)`: the loss of the rows given, reading the model's own scale
            parameters (float32 embeddings).
        parameters (`tuple[str, ...]`): the names of those parameters on the model.
    """

    name: str
    keys: tuple[str, str]
    loss: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
    parameters: tuple[str, ...]


def contrastive_variant(model: nn.Module, name: str) -> ContrastiveVariant | None:
    """
    The variant of a contrastive model (unwrapped), from the parameters its loss reads; None for one hf_parallel does
    not know. The first forward's check against the model's own loss confirms it.
    """

    def has(*names: str) -> bool:
        return all(isinstance(getattr(model, n, None), nn.Parameter) for n in names)

    keys = ("text_embeds", "audio_embeds" if "audio" in name.lower() or "clap" in name.lower() else "image_embeds")
    if name == "VideoPrismClipModel":  # its loss reads no parameter of the model
        return ContrastiveVariant("videoprism", ("text_embeds", "video_embeds"), _videoprism, ())
    if has("logit_scale_t", "logit_scale_a"):
        return ContrastiveVariant("clap", ("text_embeds", "audio_embeds"), _clap, ("logit_scale_t", "logit_scale_a"))
    if has("logit_scale", "logit_bias"):
        return ContrastiveVariant("siglip", keys, _siglip, ("logit_scale", "logit_bias"))
    if has("temperature"):
        smoothing = 0.1 if name == "AlignModel" else 0.0  # ALIGN smooths its targets by 0.1
        kind = "align" if smoothing else "temperature"
        return ContrastiveVariant(kind, keys, _temperature(smoothing), ("temperature",))
    if has("logit_scale"):
        return ContrastiveVariant("clip", keys, _clip, ("logit_scale",))
    return None


def rows_of(batch: dict) -> int:
    """The rows of a batch: the first dimension of its first tensor with one (`return_loss`, a flag, aside)."""
    rows = find_batch_size({key: value for key, value in batch.items() if key != "return_loss"})
    if rows is None:
        raise ValueError(f"A contrastive batch needs at least one tensor with rows; it has {sorted(batch)}.")
    return rows


class ContrastiveHead(LossHead):
    """
    A contrastive model's loss over every row of the step (see the module docstring). It has no labels: a batch
    asks for its loss with `return_loss=True`, as for the model itself. Its count is the step's rows (for the record:
    the loss is not a sum over them).
    """

    batch_coupled = True

    def __init__(self, variant: ContrastiveVariant):
        super().__init__((), f"contrastive/{variant.name}")
        self.variant = variant

    def has_labels(self, batch) -> bool:
        flag = batch.get("return_loss")
        return bool(flag.all()) if torch.is_tensor(flag) else bool(flag)

    def count(self, labels: dict, seq_len: int | None = None) -> torch.Tensor:
        return torch.tensor([rows_of(labels)])

    def row_terms(self, outputs, labels):
        raise NotImplementedError("A contrastive loss is not a sum over rows: see hf_parallel.exact.coupled.")


def _contrastive(name: str, model, labels, smoothing: float) -> LossHead:
    variant = contrastive_variant(model, name)
    if variant is None:
        raise UnsupportedHead(
            f"{name}'s contrastive loss reads scale parameters hf_parallel does not know (it knows CLIP's "
            "logit_scale, SigLIP's logit_scale and logit_bias, ALIGN's temperature, CLAP's two scales and "
            "VideoPrism's parameter-free loss), so each device keeps its own rows as negatives."
        )
    partitioned = [n for n in variant.parameters if hasattr(getattr(model, n), "ds_id")]
    if partitioned:
        raise UnsupportedHead(
            f"DeepSpeed ZeRO-3 partitions {name}'s scale parameters ({', '.join(partitioned)}), which the loss over "
            "the step's embeddings reads outside the model's forward; train it under ZeRO-1 or 2 (or DDP) for the "
            "exact contrastive loss."
        )
    return ContrastiveHead(variant)


# Contrastive dual encoders (`return_loss=True`): each row's loss depends on every other row of the batch, so they are
# computed on the whole step's embeddings (`hf_parallel.exact.coupled`). The zero-shot image classifiers, and the
# dual encoders of other modalities that the mappings file elsewhere. Not X-CLIP: it scores each video against text
# embeddings made for that video (`[videos, texts, dim]`), which no gather of two embedding tables reproduces.
CONTRASTIVE = HeadFamily(
    class_names("MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES")
    | frozenset({"ClapModel", "GroupViTModel", "VisionTextDualEncoderModel", "OwlViTModel", "Owlv2Model"}),
    _contrastive,
)
