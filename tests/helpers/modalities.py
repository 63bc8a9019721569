"""
One tiny model and its rows per head family beyond text (`CASES`): image classification (ViT), CTC speech
recognition (Wav2Vec2, `ctc_loss_reduction` "mean" and "sum"; OmniASR "sum", whose blank is its `blank_token_id`, not
its pad token), speech seq2seq (Whisper), semantic segmentation
(Segformer, its batch normalisation replaced: see `_segformer`), a vision-language LM (LLaVA, rows with an image's
placeholder positions ignored). Random images, waveforms and features made in code; every case has uneven items per
row (target lengths, audio lengths, labelled pixels), so that a mean of per-device means is visibly wrong.
"""

from __future__ import annotations

import functools

import torch
import transformers
from torch import nn
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    SegformerConfig,
    SegformerForSemanticSegmentation,
    ViTConfig,
    ViTForImageClassification,
    Wav2Vec2Config,
    Wav2Vec2ForCTC,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from tests.helpers.heads import Case
from tests.helpers.tiny import tiny

NUM_LABELS = 3
IMAGE = 16  # pixels a side
AUDIO = 800  # samples of the longest waveform
CHARACTERS = 12  # CTC vocabulary, blank (pad) = 0
MEL_BINS, FRAMES = 8, 16  # Whisper's features: 2 x max_source_positions frames
TEXT_VOCAB = 64
IMAGE_TOKEN = TEXT_VOCAB - 1
PATCHES = (IMAGE // 8) ** 2  # LLaVA's placeholder positions per image (patch 8, the CLS feature dropped)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _vit(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return ViTForImageClassification(
        tiny(ViTConfig, image_size=IMAGE, patch_size=8, num_labels=NUM_LABELS, initializer_range=0.5)
    )


def image_rows(n: int, seed: int) -> list[dict]:
    g = _generator(seed)
    return [
        {
            "pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, NUM_LABELS, (), generator=g),
        }
        for _ in range(n)
    ]


def _wav2vec2(reduction: str, seed: int) -> nn.Module:
    """A tiny Wav2Vec2 CTC model (`functools.partial` binds the reduction: a Case crosses to spawned DDP ranks)."""
    torch.manual_seed(seed)
    config = tiny(
        Wav2Vec2Config,
        vocab_size=CHARACTERS,
        pad_token_id=0,
        ctc_loss_reduction=reduction,
        conv_dim=(16, 16),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0,
        layerdrop=0.0,
        hidden_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
    )
    return Wav2Vec2ForCTC(config)


def ctc_rows(n: int, seed: int) -> list[dict]:
    """Waveforms of uneven lengths (padded, with an attention mask) and uneven targets (one row without any)."""
    g = _generator(seed)
    rows = []
    for i in range(n):
        samples = int(torch.randint(AUDIO // 2, AUDIO + 1, (), generator=g))
        targets = (0, 1, 6, 3, 8)[i % 5]
        values, mask = torch.zeros(AUDIO), torch.zeros(AUDIO, dtype=torch.long)
        values[:samples], mask[:samples] = torch.randn(samples, generator=g), 1
        labels = torch.full((8,), -100)
        labels[:targets] = torch.randint(1, CHARACTERS, (targets,), generator=g)
        rows.append({"input_values": values, "attention_mask": mask, "labels": labels})
    return rows


def _omniasr(seed: int) -> nn.Module:
    """
    A tiny OmniASR CTC model, "sum" reduction: its loss takes `blank_token_id` (0) as the blank, and its pad token (1)
    is a character like any other, which the rows' targets hold.
    """
    from transformers import OmniASRCTCConfig, OmniASRForCTC
    from transformers.models.omniasr.configuration_omniasr import OmniASRAudioConfig

    torch.manual_seed(seed)
    audio = tiny(
        OmniASRAudioConfig,
        conv_dim=(16, 16),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        layerdrop=0.0,
        activation_dropout=0.0,
    )
    config = OmniASRCTCConfig(vocab_size=CHARACTERS, audio_config=audio, ctc_loss_reduction="sum")
    assert (config.blank_token_id, config.pad_token_id) == (0, 1)
    return OmniASRForCTC(config)


def omniasr_rows(n: int, seed: int) -> list[dict]:
    """`ctc_rows` as OmniASR takes them: one channel of samples, the mask as `padding_mask`; targets include 1."""
    rows = ctc_rows(n, seed)
    for i, row in enumerate(rows):
        row["input_values"] = row["input_values"].unsqueeze(0)
        row["padding_mask"] = row.pop("attention_mask")
        if i % 5 == 1:
            row["labels"][0] = 1  # the pad token: a target for OmniASR's loss, not a blank
    return rows


def _whisper(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = tiny(
        WhisperConfig,
        vocab_size=TEXT_VOCAB,
        num_mel_bins=MEL_BINS,
        max_source_positions=FRAMES // 2,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=3,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return WhisperForConditionalGeneration(config)


def speech_seq2seq_rows(n: int, seed: int) -> list[dict]:
    g = _generator(seed)
    rows = []
    for i in range(n):
        targets = (2, 6, 0, 4, 5)[i % 5]
        labels = torch.full((6,), -100)
        labels[:targets] = torch.randint(4, TEXT_VOCAB, (targets,), generator=g)
        rows.append({"input_features": torch.randn(MEL_BINS, FRAMES, generator=g), "labels": labels})
    return rows


def _segformer(seed: int) -> nn.Module:
    """
    A tiny Segformer whose decode head's batch normalisation is an identity: batch statistics make any model's step
    depend on its split (hf_parallel warns: `test_batch_normalisation_is_warned`), which is not what is tested here.
    """
    torch.manual_seed(seed)
    config = SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        patch_sizes=[3, 3],
        strides=[2, 2],
        num_attention_heads=[1, 2],
        decoder_hidden_size=16,
        num_labels=NUM_LABELS,
        drop_path_rate=0.0,
        classifier_dropout_prob=0.0,
    )
    model = SegformerForSemanticSegmentation(config)
    model.decode_head.batch_norm = nn.Identity()
    return model


def segmentation_rows(n: int, seed: int) -> list[dict]:
    """Label maps with uneven ignored areas (255), one of them wholly ignored."""
    g = _generator(seed)
    rows = []
    for i in range(n):
        labels = torch.randint(0, NUM_LABELS, (IMAGE, IMAGE), generator=g)
        labels[: (0, 4, 16, 9, 1)[i % 5]] = 255
        rows.append({"pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g), "labels": labels})
    return rows


def _llava(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = LlavaConfig(
        vision_config=tiny(CLIPVisionConfig, image_size=IMAGE, patch_size=8, projection_dim=16),
        text_config=tiny(LlamaConfig, vocab_size=TEXT_VOCAB),
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
    )
    return LlavaForConditionalGeneration(config)


def vlm_rows(n: int, seed: int) -> list[dict]:
    """An image's placeholder positions, then text; the placeholders and the padding ignored, uneven text lengths."""
    g = _generator(seed)
    text = 6
    rows = []
    for i in range(n):
        ids = torch.cat([torch.full((PATCHES,), IMAGE_TOKEN), torch.randint(4, IMAGE_TOKEN, (text,), generator=g)])
        labels = ids.clone()
        labels[:PATCHES] = -100
        labels[PATCHES + (1, 6, 3, 2, 5)[i % 5] :] = -100
        rows.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g),
                "labels": labels,
            }
        )
    return rows


CASES = {
    case.name: case
    for case in (
        Case("vit_image_classification", _vit, image_rows),
        Case("wav2vec2_ctc_mean", functools.partial(_wav2vec2, "mean"), ctc_rows),
        Case("wav2vec2_ctc_sum", functools.partial(_wav2vec2, "sum"), ctc_rows),
        Case("whisper_speech_seq2seq", _whisper, speech_seq2seq_rows),
        Case("segformer_segmentation", _segformer, segmentation_rows),
        Case("llava_vlm", _llava, vlm_rows),
    )
}
if hasattr(transformers, "OmniASRForCTC"):  # transformers 5.2x; not in the oldest supported release
    CASES["omniasr_ctc_sum"] = Case("omniasr_ctc_sum", _omniasr, omniasr_rows)
