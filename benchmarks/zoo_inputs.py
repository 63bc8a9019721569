"""
The inputs of the model zoo (`benchmarks.zoo`): four rows of inputs and labels for a tiny model of each kind
(`benchmarks.zoo_models.HEAD_KINDS`), one function per modality, and the collator that batches them.

Every kind gets uneven items per row, so that a mean of per-micro-batch means differs from the mean over the step:
label lengths that differ (-100 padding), audio of different lengths (attention masks), CTC targets of different
lengths, segmentation maps with some pixels at the ignore index, masked patches of different counts, detection
targets with different numbers of boxes; vision-language rows with and without an image where the model allows it.
"""

from __future__ import annotations

import inspect
import re

import torch
from transformers.data.data_collator import default_data_collator

from benchmarks.zoo_models import IMAGE, ZooModel

__all__ = ["ROWS", "SEQ", "collate", "rows_for"]

SEQ = 8
ROWS = 4
SAMPLES = 8000  # audio samples of the longest row: 24 frames of a wav2vec2 feature encoder (stride 320)
LENGTHS = (2, SEQ, 5, 7)  # labelled positions per row
_MIN_VOCAB = 64
# Columns that hold the images of the rows that have one: concatenated over those rows, not stacked.
PER_IMAGE = (
    "pixel_values",
    "pixel_values_videos",
    "image_grid_thw",
    "image_sizes",
    "pixel_attention_mask",
    "image_attention_mask",
)
# Columns that hold a list (one target per image), batched as a list.
PER_TARGET = ("mask_labels", "class_labels")


def collate(rows: list[dict]) -> dict:
    """The batch of `rows`: `default_data_collator` for plain rows; per-image columns concatenated over the rows that
    have them (a batch without an image has none), lists of targets kept as lists, flags passed once."""
    keys = dict.fromkeys(key for row in rows for key in row)
    plain = all(row.keys() == keys.keys() for row in rows) and not any(
        key in PER_IMAGE or key in PER_TARGET or not isinstance(rows[0][key], torch.Tensor) for key in keys
    )
    if plain:
        return default_data_collator(rows)
    batch = {}
    for key in keys:
        values = [row[key] for row in rows if key in row]
        if key in PER_IMAGE:
            batch[key] = torch.cat(values)
        elif isinstance(values[0], bool):
            batch[key] = values[0]
        elif key in PER_TARGET or isinstance(values[0], dict):
            batch[key] = values
        else:
            batch[key] = torch.stack(values)
    return batch


def rows_for(model: ZooModel, built: torch.nn.Module, seed: int = 1) -> list[dict]:
    """`ROWS` rows of inputs and labels for the head of `model`, with uneven numbers of items per row."""
    g = torch.Generator().manual_seed(seed)
    return MODALITIES[model.kind](model.kind, built, g)


def _accepts(built: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(built.forward).parameters


def _uneven(labels: torch.Tensor, ignore: int = -100) -> torch.Tensor:
    """`labels` [rows, positions] with only the first `LENGTHS` positions of each row kept."""
    lengths = torch.tensor(LENGTHS)[: labels.shape[0]]
    return labels.masked_fill(torch.arange(labels.shape[1])[None, :] >= lengths[:, None], ignore)


def _token_ids(config, rows: int, seq: int, g: torch.Generator) -> torch.Tensor:
    vocab = getattr(config.get_text_config(), "vocab_size", None) or _MIN_VOCAB
    # Clear of the special tokens (ids 0..3 in most configs), and of the vocabulary's end.
    return torch.randint(4, min(vocab, _MIN_VOCAB), (rows, seq), generator=g)


# ---- Text ------------------------------------------------------------------------------------------------------


def text_rows(kind: str, built: torch.nn.Module, g: torch.Generator) -> list[dict]:
    config = built.config
    if kind == "multiple_choice":
        ids = _token_ids(config, ROWS * 2, SEQ, g).view(ROWS, 2, SEQ)
        labels = torch.randint(0, 2, (ROWS,), generator=g)
        return [{"input_ids": ids[i], "labels": labels[i]} for i in range(ROWS)]
    ids = _token_ids(config, ROWS, SEQ, g)
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long)} for i in range(ROWS)]
    if kind == "question_answering":
        start, end = torch.randint(0, SEQ, (ROWS,), generator=g), torch.randint(0, SEQ, (ROWS,), generator=g)
        start[0] = SEQ + 2  # outside the input: ignored
        for i, row in enumerate(rows):
            row.update(start_positions=start[i], end_positions=end[i])
        return rows
    if kind == "sequence_classification":
        labels = torch.randint(0, config.num_labels, (ROWS,), generator=g)
    elif kind == "token_classification":
        labels = _uneven(torch.randint(0, config.num_labels, (ROWS, SEQ), generator=g))
    elif kind == "seq2seq_lm":
        labels = _uneven(_token_ids(config, ROWS, SEQ, g))
    else:
        labels = _uneven(ids.clone())  # uneven: a wrong average of per-batch means shows
    for i, row in enumerate(rows):
        row["labels"] = labels[i]
    return rows


# ---- Images and video ------------------------------------------------------------------------------------------


def _find(config, name: str, default=None):
    """`config.name`, else the first nested config's (vision, backbone, encoder), else `default`."""
    value = getattr(config, name, None)
    if value is not None:
        return value
    for sub in ("vision_config", "backbone_config", "encoder_config", "encoder"):
        nested = getattr(config, sub, None)
        if nested is not None and not isinstance(nested, (str, dict)) and getattr(nested, name, None) is not None:
            return getattr(nested, name)
    return default


def _image_size(config) -> tuple[int, int]:
    size = _find(config, "image_size", IMAGE)
    size = size if isinstance(size, (list, tuple)) else (size, size)
    return int(size[0]), int(size[-1])


def _pixels(config, g: torch.Generator, *leading: int) -> torch.Tensor:
    channels = _find(config, "num_channels", None) or _find(config, "in_channels", 3)
    return torch.randn(*leading, channels, *_image_size(config), generator=g)


def image_rows(kind: str, built: torch.nn.Module, g: torch.Generator) -> list[dict]:
    config = built.config
    pixels = _pixels(config, g, ROWS)
    rows = [{"pixel_values": pixels[i : i + 1]} for i in range(ROWS)]  # one image a row
    height, width = pixels.shape[-2:]
    if kind == "image_classification":
        labels = list(torch.randint(0, config.num_labels, (ROWS,), generator=g))
    elif kind == "semantic_segmentation":
        ignore = getattr(config, "semantic_loss_ignore_index", getattr(config, "loss_ignore_index", 255))
        maps = torch.randint(0, config.num_labels, (ROWS, height, width), generator=g)
        # Uneven: the first rows (top) of each map ignored, 0, 1/4, 1/2 and 3/4 of its height.
        maps = maps.masked_fill(
            torch.arange(height)[None, :, None] < (torch.arange(ROWS) * height // 4)[:, None, None], ignore
        )
        labels = list(maps)
    elif kind == "depth_estimation":
        labels = list(torch.rand(ROWS, height, width, generator=g) + 0.5)
    elif kind == "masked_image_modeling":
        return _masked_patches(built, rows, g)
    elif kind == "object_detection":
        labels = [_boxes(n, config, g) for n in (1, 3, 2, 4)]
    elif kind == "universal_segmentation":
        for row, n in zip(rows, (1, 3, 2, 4), strict=True):
            row["mask_labels"] = (torch.rand(n, height, width, generator=g) > 0.5).float()
            row["class_labels"] = torch.randint(0, config.num_labels, (n,), generator=g)
        return rows
    elif kind == "zero_shot_image_classification":
        return _image_text_pairs(built, rows, g)
    for row, label in zip(rows, labels, strict=True):
        row["labels"] = label
    return rows


def _boxes(count: int, config, g: torch.Generator) -> dict:
    centers, sizes = torch.rand(count, 2, generator=g) * 0.5 + 0.25, torch.rand(count, 2, generator=g) * 0.2 + 0.05
    return {
        "class_labels": torch.randint(0, config.num_labels, (count,), generator=g),
        "boxes": torch.cat([centers, sizes], dim=1),
    }


def _masked_patches(built: torch.nn.Module, rows: list[dict], g: torch.Generator) -> list[dict]:
    config = built.config
    height, width = _image_size(config)
    patch = _find(config, "patch_size", 8)
    patches = (height // patch) * (width // patch)
    for i, row in enumerate(rows):
        mask = torch.zeros(patches, dtype=torch.bool)
        mask[torch.randperm(patches, generator=g)[: 1 + i * patches // ROWS]] = True  # 1, 1/4, 1/2, 3/4 masked
        row["bool_masked_pos"] = mask
    return rows


def _image_text_pairs(built: torch.nn.Module, rows: list[dict], g: torch.Generator) -> list[dict]:
    ids = _token_ids(built.config, ROWS, SEQ, g)
    for i, row in enumerate(rows):
        row.update(input_ids=ids[i], attention_mask=(torch.arange(SEQ) < LENGTHS[i]).long(), return_loss=True)
    return rows


def video_rows(kind: str, built: torch.nn.Module, g: torch.Generator) -> list[dict]:
    config = built.config
    frames = _find(config, "num_frames", 4)
    pixels = _pixels(config, g, ROWS, frames)
    labels = torch.randint(0, config.num_labels, (ROWS,), generator=g)
    name = "pixel_values" if _accepts(built, "pixel_values") else "pixel_values_videos"
    return [{name: pixels[i : i + 1], "labels": labels[i]} for i in range(ROWS)]  # one clip a row


# ---- Audio -----------------------------------------------------------------------------------------------------


def _audio(built: torch.nn.Module, g: torch.Generator) -> list[dict]:
    """Four rows of audio: a waveform (`input_values`) or features (`input_features`) in the layout the model reads,
    the later part of rows 1..3 padding (zeros, masked out where the model takes an attention mask)."""
    config = built.config
    name = "input_features" if built.main_input_name == "input_features" else "input_values"
    if name == "input_values" and getattr(config, "max_length", None) and getattr(config, "num_mel_bins", None):
        shape, time_axis = (config.max_length, config.num_mel_bins), 0  # AST: a spectrogram in input_values
    elif name == "input_values":
        shape, time_axis = (SAMPLES,), 0
    elif getattr(config, "max_source_positions", None) and hasattr(config, "num_mel_bins"):
        # Whisper-like: [mel bins, frames], exactly 2 frames per encoder position.
        shape, time_axis = (config.num_mel_bins, 2 * config.max_source_positions), 1
    else:
        bins = next(
            (
                getattr(config, key)
                for key in ("feature_projection_input_dim", "input_feat_per_channel", "num_mel_bins", "feature_size")
                if isinstance(getattr(config, key, None), int)
            ),
            _find(config, "num_mel_bins", 8),
        )
        shape, time_axis = (4 * SEQ, bins * getattr(config, "input_channels", 1)), 0
    values = torch.randn(ROWS, *shape, generator=g)
    steps = shape[time_axis]
    rows = []
    for i, fraction in enumerate((1.0, 0.75, 0.5, 0.625)):
        keep = (torch.arange(steps) < int(steps * fraction)).long()
        along_time = keep.view([steps if axis == time_axis else 1 for axis in range(len(shape))])
        row = {name: values[i] * along_time}
        if _accepts(built, "attention_mask"):
            row["attention_mask"] = keep
        rows.append(row)
    return rows


def audio_rows(kind: str, built: torch.nn.Module, g: torch.Generator) -> list[dict]:
    config = built.config
    rows = _audio(built, g)
    if kind in ("audio_classification", "audio_xvector"):
        labels = list(torch.randint(0, config.num_labels, (ROWS,), generator=g))
    elif kind == "ctc":
        vocab = config.get_text_config().vocab_size
        targets = torch.randint(1, min(vocab, _MIN_VOCAB), (ROWS, 6), generator=g)
        blank = getattr(config, "pad_token_id", 0)
        targets = targets.masked_fill(targets == blank, 1 if blank != 1 else 2)
        lengths = torch.tensor([2, 6, 3, 5])  # targets per utterance
        labels = list(targets.masked_fill(torch.arange(6)[None, :] >= lengths[:, None], -100))
    elif kind == "audio_frame_classification":
        with torch.no_grad():
            frames = built.eval()(**collate(rows)).logits.shape[1]
        built.train()
        classes = torch.randint(0, config.num_labels, (ROWS, frames), generator=g)
        labels = list(torch.nn.functional.one_hot(classes, config.num_labels).float())
    else:  # speech_seq2seq
        labels = list(_uneven(_token_ids(config, ROWS, SEQ, g)))
    for row, label in zip(rows, labels, strict=True):
        row["labels"] = label
    return rows


# ---- Vision-language -------------------------------------------------------------------------------------------


class _Counted(Exception):
    """Stops a probing forward once the image features are known."""


def _image_token_id(config) -> int | None:
    for owner in (config, config.get_text_config()):
        for key in ("image_token_id", "image_token_index", "image_pad_token_id", "img_token_id"):
            if isinstance(getattr(owner, key, None), int):
                return getattr(owner, key)
    return None


def _image_layouts(built: torch.nn.Module, g: torch.Generator) -> list[dict]:
    """The per-image columns of one image in each layout a model may take, most likely first: flat patches and their
    grid (Qwen-like), an image, an image with its size (and its one tile: LLaVA-NeXT), a list of images per row."""
    config = built.config
    vision = getattr(config, "vision_config", None) or config
    merge, temporal = getattr(vision, "spatial_merge_size", None), getattr(vision, "temporal_patch_size", None)
    if merge and temporal and _accepts(built, "image_grid_thw"):
        side = 2 * merge  # patches a side: 2 x 2 tokens after merging
        patch = getattr(vision, "patch_size", 8)
        channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
        pixels = torch.randn(side * side, channels * temporal * patch * patch, generator=g)
        return [{"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]])}]
    image = _pixels(config, g, 1)
    layouts = [{"pixel_values": image}]
    if _accepts(built, "image_sizes"):
        tiles = (
            image[:, None].expand(1, 2, *image.shape[1:]) if getattr(config, "image_grid_pinpoints", None) else image
        )
        layouts.append({"pixel_values": tiles.clone(), "image_sizes": torch.tensor([_image_size(config)])})
    return [*layouts, {"pixel_values": image[None]}]


def _image_tokens(built: torch.nn.Module, image: dict, token: int) -> int:
    """How many placeholder tokens one image takes: what the model's own `get_placeholder_mask` is given (or its
    error message says), not a guess from the config."""
    owner = next((m for m in (built, getattr(built, "model", None)) if hasattr(m, "get_placeholder_mask")), None)
    seen = {}
    if owner is not None:

        def record(*args, **kwargs):
            features, embeds = kwargs.get("image_features"), kwargs.get("inputs_embeds")
            if features is None or embeds is None:
                names = ("input_ids", "inputs_embeds", "image_features")
                found = dict(zip(names, args, strict=False)) | kwargs
                features, embeds = found.get("image_features"), found.get("inputs_embeds")
            seen["count"] = features.numel() // embeds.shape[-1]
            raise _Counted

        owner.get_placeholder_mask = record
    ids = torch.full((1, 4), 5)
    ids[0, 1] = token
    extra = {"mm_token_type_ids": (ids == token).long()} if _accepts(built, "mm_token_type_ids") else {}
    try:
        with torch.no_grad():
            built(input_ids=ids, attention_mask=torch.ones_like(ids), **image, **extra)
    except _Counted:
        pass
    except Exception as error:
        found = re.search(r"features:? (\d+)", str(error))
        if not found:
            raise
        seen["count"] = int(found.group(1))
    finally:
        if owner is not None:
            del owner.get_placeholder_mask
    if "count" not in seen:
        raise ValueError("the number of image tokens could not be read from a forward")
    return seen["count"]


def _text_inputs_beside_images(built: torch.nn.Module, row_ids: torch.Tensor, count: int, g) -> dict:
    """What some models take beside the image and the text: InstructBLIP's Q-Former prompt, Kosmos-2's positions of
    its image embeddings (the `count` after the first token)."""
    extra = {}
    if _accepts(built, "qformer_input_ids"):
        extra["qformer_input_ids"] = _token_ids(built.config, 1, SEQ, g)[0]
        extra["qformer_attention_mask"] = torch.ones(SEQ, dtype=torch.long)
    if _accepts(built, "image_embeds_position_mask"):
        extra["image_embeds_position_mask"] = (
            (torch.arange(len(row_ids)) >= 1) & (torch.arange(len(row_ids)) <= count)
        ).long()
    return extra


def _flattened_patch_rows(built: torch.nn.Module, g: torch.Generator) -> list[dict]:
    """Pix2Struct: each image as its flattened patches (row and column index, then the patch's pixels); uneven
    labels."""
    vision = built.config.vision_config
    patches, width = 8, vision.patch_embed_hidden_size
    rows = []
    for _ in range(ROWS):
        index = torch.arange(patches, dtype=torch.float)
        flat = torch.cat(
            [(index // 4 + 1)[:, None], (index % 4 + 1)[:, None], torch.randn(patches, width, generator=g)], 1
        )
        rows.append({"flattened_patches": flat, "attention_mask": torch.ones(patches, dtype=torch.long)})
    for row, labels in zip(rows, _uneven(_token_ids(built.config, ROWS, SEQ, g)), strict=True):
        row["labels"] = labels
    return rows


def vlm_rows(kind: str, built: torch.nn.Module, g: torch.Generator) -> list[dict]:
    """Rows 0 and 2 with an image (exactly the placeholders it takes), 1 and 3 text only where the model allows a
    batch of both, else all with images; labels on the text after the image, of uneven lengths."""
    config = built.config
    if _accepts(built, "flattened_patches"):
        return _flattened_patch_rows(built, g)
    token = _image_token_id(config)
    layouts = _image_layouts(built, g)
    for n, layout in enumerate(layouts):
        try:
            # Without an image token (Kosmos-2: its latent queries, at the positions a mask gives), the model puts the
            # image before the text itself; BLIP-2's and InstructBLIP's Q-Former queries fill the placeholders.
            queries = getattr(config, "num_query_tokens", None)
            if token is None:
                count = getattr(config, "latent_query_num", 0)
            else:
                count = queries if isinstance(queries, int) else _image_tokens(built, layout, token)
            break
        except Exception:
            if n == len(layouts) - 1:
                raise
    # Another image a row (the same grid).
    images = [{k: v + 0.1 * i if v.is_floating_point() else v for k, v in layout.items()} for i in range(ROWS)]
    choices = [(True, False, True, False)] * (token is not None) + [(True,) * ROWS]
    for with_image in choices:
        rows = []
        ids = _token_ids(config, ROWS, 1 + count + SEQ, g)
        for i in range(ROWS):
            row_ids = ids[i].clone()
            if with_image[i] and token is not None:
                row_ids[1 : 1 + count] = token
            labels = row_ids.masked_fill(torch.arange(len(row_ids)) < 1 + count, -100)
            labels = labels.masked_fill(torch.arange(len(row_ids)) >= 1 + count + LENGTHS[i], -100)
            row = {"input_ids": row_ids, "attention_mask": torch.ones_like(row_ids), "labels": labels}
            if _accepts(built, "mm_token_type_ids"):
                row["mm_token_type_ids"] = (row_ids == token).long()  # the processor's: 1 on image tokens
            row.update(_text_inputs_beside_images(built, row_ids, count, g))
            rows.append({**row, **(images[i] if with_image[i] else {})})
        try:
            with torch.no_grad():
                built(**collate(rows))
            return rows
        except Exception:
            if all(with_image):
                raise
    return rows


MODALITIES = {
    **dict.fromkeys(
        (
            "question_answering",
            "sequence_classification",
            "seq2seq_lm",
            "causal_lm",
            "masked_lm",
            "token_classification",
            "multiple_choice",
            "moe_causal_lm",
        ),
        text_rows,
    ),
    **dict.fromkeys(
        (
            "image_classification",
            "semantic_segmentation",
            "object_detection",
            "depth_estimation",
            "masked_image_modeling",
            "universal_segmentation",
            "zero_shot_image_classification",
        ),
        image_rows,
    ),
    "video_classification": video_rows,
    **dict.fromkeys(
        ("audio_classification", "ctc", "speech_seq2seq", "audio_frame_classification", "audio_xvector"), audio_rows
    ),
    **dict.fromkeys(("image_text_to_text", "multimodal_lm", "vision_2_seq"), vlm_rows),
}
