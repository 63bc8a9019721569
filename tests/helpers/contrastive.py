"""
Tiny contrastive dual encoders (`CASES`): CLIP (a softmax over the batch, both ways), SigLIP (a sigmoid per pair,
with a bias) and VideoPrism (a sigmoid per pair of similarities normalised over the texts, no parameter), on random
images (videos of 2 frames) and texts of uneven lengths. Their batches ask for the loss as the models' users do,
`return_loss=True` (`collate`). Each row's loss depends on every other row of its batch, so a split batch is
another loss: the x0.585 of the issue.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    CLIPConfig,
    CLIPModel,
    CLIPTextConfig,
    CLIPVisionConfig,
    SiglipConfig,
    SiglipModel,
    SiglipTextConfig,
    SiglipVisionConfig,
    VideoPrismClipModel,
    VideoPrismConfig,
)
from transformers.data.data_collator import default_data_collator

from tests.helpers.heads import Case
from tests.helpers.tiny import tiny

IMAGE = 16
TEXT = 6
VOCAB = 40
SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def collate(features: list[dict]) -> dict:
    """The rows stacked, and `return_loss=True` (one flag for the batch, as a contrastive model takes it)."""
    return {**default_data_collator(features), "return_loss": True}


def _clip(seed: int, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=tiny(
            CLIPTextConfig, vocab_size=VOCAB, max_position_embeddings=TEXT, attention_dropout=dropout, **SPECIAL_TOKENS
        ),
        vision_config=tiny(CLIPVisionConfig, image_size=IMAGE, patch_size=8, attention_dropout=dropout),
        projection_dim=16,
    )
    return CLIPModel(config)


def _siglip(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = SiglipConfig(
        text_config=tiny(SiglipTextConfig, vocab_size=VOCAB, max_position_embeddings=TEXT, **SPECIAL_TOKENS),
        vision_config=tiny(SiglipVisionConfig, image_size=IMAGE, patch_size=8),
    )
    return SiglipModel(config)


def _videoprism(seed: int) -> nn.Module:
    from transformers.models.videoprism.configuration_videoprism import VideoPrismTextConfig, VideoPrismVisionConfig

    torch.manual_seed(seed)
    vision = VideoPrismVisionConfig(
        image_size=IMAGE,
        num_frames=2,
        tubelet_size=(1, 8, 8),
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        num_spatial_layers=1,
        num_temporal_layers=1,
        num_auxiliary_layers=1,
    )
    text = tiny(VideoPrismTextConfig, vocab_size=VOCAB, max_position_embeddings=TEXT, pad_token_id=0)
    return VideoPrismClipModel(VideoPrismConfig(text_config=text.to_dict(), vision_config=vision.to_dict()))


def videoprism_rows(n: int, seed: int) -> list[dict]:
    """`clip_rows` with a video of 2 frames per row instead of an image."""
    g = torch.Generator().manual_seed(seed + 1000)
    rows = clip_rows(n, seed)
    for row in rows:
        del row["pixel_values"]
        row["pixel_values_videos"] = torch.randn(2, 3, IMAGE, IMAGE, generator=g)
    return rows


def clip_rows(n: int, seed: int) -> list[dict]:
    """An image and a text per row; texts of uneven lengths, padded and masked."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (TEXT,), generator=g)
        length = (2, 6, 4, 3, 5)[i % 5]
        mask = (torch.arange(TEXT) < length).long()
        rows.append(
            {
                "input_ids": ids.masked_fill(mask == 0, 0),
                "attention_mask": mask,
                "pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g),
            }
        )
    return rows


def siglip_rows(n: int, seed: int) -> list[dict]:
    """SigLIP's text tower takes no attention mask (padded to the length it was trained with)."""
    return [{key: value for key, value in row.items() if key != "attention_mask"} for row in clip_rows(n, seed)]


CASES = {
    case.name: case
    for case in (
        Case("clip_contrastive", _clip, clip_rows, collator=collate),
        Case("siglip_contrastive", _siglip, siglip_rows, collator=collate),
        Case("videoprism_contrastive", _videoprism, videoprism_rows, collator=collate),
    )
}
