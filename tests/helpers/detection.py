"""
Tiny DETR-style detectors and their rows (`CASES`): DETR (a softmax class term weighted by `eos_coefficient`, with
its auxiliary decoder layers), Deformable DETR (a sigmoid focal class term, auxiliary layers), YOLOS (a ViT, no
convolution) and RF-DETR (3 query groups, an IoU-aware class term, auxiliary layers and the encoder's proposals; a
DINOv2 backbone, layer norms only). The ResNet backbones are transformers' own (frozen batch norm, as the DETR models
load them): a step does not depend on its split through batch statistics. Images carry 0 to 4 boxes each, so that a
mean of per-device means is visibly wrong.
"""

from __future__ import annotations

import torch
from transformers import (
    DeformableDetrConfig,
    DeformableDetrForObjectDetection,
    DetrConfig,
    DetrForObjectDetection,
    ResNetConfig,
    RfDetrConfig,
    RfDetrDinov2Config,
    RfDetrForObjectDetection,
    YolosConfig,
    YolosForObjectDetection,
)

from tests.helpers.heads import Case

NUM_LABELS = 3
QUERIES = 5
IMAGE = 64  # pixels a side: the backbone's last stage is 2 x 2
BOXES_PER_IMAGE = (1, 3, 0, 4, 2, 1, 3)


def _backbone(stages: tuple[int, ...]) -> ResNetConfig:
    return ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 8, 8, 8],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        out_features=[f"stage{i}" for i in stages],
    )


_DECODER = dict(
    encoder_layers=1,
    decoder_layers=3,  # two auxiliary layers
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    num_queries=QUERIES,
    num_labels=NUM_LABELS,
    auxiliary_loss=True,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)


def _detr(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = DetrConfig(
        backbone_config=_backbone((4,)), d_model=16, encoder_ffn_dim=16, decoder_ffn_dim=16, **_DECODER
    )
    return DetrForObjectDetection(config)


def _deformable(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = DeformableDetrConfig(
        backbone_config=_backbone((2, 3, 4)),
        d_model=32,  # its group norm takes 32 groups
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        num_feature_levels=3,
        encoder_n_points=2,
        decoder_n_points=2,
        **_DECODER,
    )
    return DeformableDetrForObjectDetection(config)


def _yolos(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = YolosConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        image_size=[IMAGE, IMAGE],
        patch_size=16,
        num_detection_tokens=QUERIES,
        num_labels=NUM_LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return YolosForObjectDetection(config)


def _rf_detr(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    backbone = RfDetrDinov2Config(
        hidden_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        mlp_ratio=1,
        image_size=IMAGE,
        patch_size=16,
        num_windows=1,
        out_features=["stage2", "stage4"],
    )
    config = RfDetrConfig(
        backbone_config=backbone,
        d_model=16,
        decoder_ffn_dim=16,
        decoder_layers=3,  # two auxiliary layers
        decoder_self_attention_heads=2,
        decoder_cross_attention_heads=2,
        decoder_n_points=2,
        c2f_num_blocks=1,
        num_queries=QUERIES,
        group_detr=3,  # in training 3 x 5 queries, each group matched on its own
        num_labels=NUM_LABELS,
        dropout=0.0,
    )
    return RfDetrForObjectDetection(config)


def detection_rows(n: int, seed: int) -> list[dict]:
    """Images with 0 to 4 boxes each (center, size: relative), classes drawn."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        boxes = BOXES_PER_IMAGE[i % len(BOXES_PER_IMAGE)]
        centers = torch.rand(boxes, 2, generator=g) * 0.5 + 0.25
        sizes = torch.rand(boxes, 2, generator=g) * 0.3 + 0.05
        rows.append(
            {
                "pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g),
                "labels": {
                    "class_labels": torch.randint(0, NUM_LABELS, (boxes,), generator=g),
                    "boxes": torch.cat([centers, sizes], dim=1),
                },
            }
        )
    return rows


def collate(rows: list[dict]) -> dict:
    """The images stacked, their targets a list of one dict per image (as DETR image processors give them)."""
    images = torch.stack([row["pixel_values"] for row in rows])
    return {"pixel_values": images, "labels": [row["labels"] for row in rows]}


CASES = {
    case.name: case
    for case in (
        Case("detr_detection", _detr, detection_rows, collator=collate),
        Case("deformable_detr_detection", _deformable, detection_rows, collator=collate),
        Case("yolos_detection", _yolos, detection_rows, collator=collate),
        Case("rf_detr_detection", _rf_detr, detection_rows, collator=collate),
    )
}
