"""
The model zoo of `benchmarks.zoo`: every class name of the text auto mappings hf_parallel claims a head for
(`TEXT_KINDS`) and of the non-text ones (`MEDIA_KINDS`: images, video, audio, vision-language), each built tiny from
its config class; `benchmarks.zoo_inputs` makes the four rows of inputs and labels for its kind.

A tiny config is the config class's defaults with every size it knows shrunk (`SIZES`: width, depth, heads, experts;
`MEDIA_SIZES`: images of 32 pixels in patches of at most 8, short convolution stacks, few mel bins), every dropout,
stochastic depth and SpecAugment mask at 0, and no cache; nested configs (a text, vision or audio config, an encoder
and a decoder, a backbone) are shrunk alike; a timm backbone (DETR and its kin) becomes a tiny transformers ResNet with
the same stages out (timm is not a dependency). The vocabulary is kept above every special token id the config or the
config around it names (a VLM's image token), so that those stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

from hf_parallel.exact.heads.router import text_config

__all__ = ["HEAD_KINDS", "MEDIA_KINDS", "ROUTER_KIND", "TEXT_KINDS", "ZooModel", "build_model", "zoo_models"]

#: The text mappings of `hf_parallel.exact.resolve`, by the head kind they give, in its order of precedence.
TEXT_KINDS = {
    "question_answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "multiple_choice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
}
#: The non-text mappings with a loss, by kind; a class of a text mapping keeps its text kind. The last seven have a
#: loss that is not a sum over items (matching, contrastive, scale-invariant, a mean over masked patches).
MEDIA_KINDS = {
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "video_classification": "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES",
    "audio_classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "speech_seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "semantic_segmentation": "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
    "image_text_to_text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "multimodal_lm": "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "vision_2_seq": "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",  # gone from recent transformers; skipped when absent
    "object_detection": "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",
    "depth_estimation": "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES",
    "masked_image_modeling": "MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES",
    "universal_segmentation": "MODEL_FOR_UNIVERSAL_SEGMENTATION_MAPPING_NAMES",
    "audio_frame_classification": "MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES",
    "audio_xvector": "MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES",
    "zero_shot_image_classification": "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
HEAD_KINDS = {**TEXT_KINDS, **MEDIA_KINDS}
#: Mixture-of-experts causal LMs (a config with `output_router_logits`), built with their router loss on: each class
#: of the causal LM mapping that has one is run a second time as this kind.
ROUTER_KIND = "moe_causal_lm"

NUM_LABELS = 3
WIDTH = 32
IMAGE = 32
MAX_PATCH = 8

# Config attribute -> its tiny value. Only attributes the config class has are set.
SIZES = {
    **dict.fromkeys(
        ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "hidden_dim", "word_embed_proj_dim"), WIDTH
    ),
    **dict.fromkeys(("embedding_size", "n_embed", "d_embed", "emb_dim", "projection_dim", "projection_size"), WIDTH),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers"), 2),
    **dict.fromkeys(("num_decoder_layers", "num_encoder_layers", "decoder_num_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads"), 2),
    **dict.fromkeys(("decoder_attention_heads", "num_heads", "decoder_num_attention_heads"), 2),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "multi_query_group_num"), 1),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "decoder_ffn_embed_dim"), 64),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"), 2),
    "head_dim": 16,
    "d_kv": 16,
    "d_head": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "use_cache": False,
    "num_labels": NUM_LABELS,
}
# The sizes of images, video, audio and vision-language configs (an int attribute only; see `_media`).
MEDIA_SIZES = {
    "image_size": IMAGE,
    "num_frames": 4,  # video: frames of a clip
    **dict.fromkeys(("decoder_hidden_size", "fusion_hidden_size", "classifier_proj_size", "xvector_output_dim"), 32),
    **dict.fromkeys(("decoder_intermediate_size", "encoder_feedforward_dim", "dim_feedforward"), 64),
    **dict.fromkeys(("feature_size", "mask_feature_size", "conv_channels", "output_hidden_size"), 32),
    **dict.fromkeys(("out_hidden_size", "vision_output_dim"), WIDTH),  # a vision tower's output, the text's width
    **dict.fromkeys(("decoder_num_hidden_layers", "depth", "vision_layers", "audio_layers"), 2),
    "num_queries": 8,
    "num_mel_bins": 8,
    "input_feat_per_channel": 8,
    "max_source_positions": 16,  # Whisper-like encoders take exactly 2 x this many frames
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 2,
    "train_num_points": 64,
    "mask_time_prob": 0.0,  # SpecAugment draws masks in training: the reference forward would draw other ones
    "mask_feature_prob": 0.0,
    "apply_spec_augment": False,
}
# Lists of a vision tower's layers, which must stay within its 2 layers: attribute -> its tiny list.
_LAYER_LISTS = {
    "deepstack_visual_indexes": lambda v: [0, 1][: len(v)],
    "fullatt_block_indexes": lambda v: [1],
    "global_attn_indexes": lambda v: [1],
    "vision_feature_layers": lambda v: [-1] * len(v),
    "vision_feature_layer": lambda v: [-1] * len(v),  # VipLlava: a list
    "image_grid_pinpoints": lambda v: [[IMAGE, IMAGE]],  # LLaVA-NeXT: one tile of the tiny image
}
# Per-stage lists of hierarchical vision and audio stacks: their length is kept, their values shrunk.
_STAGE_LISTS = {
    "depths": lambda v: 1,
    "hidden_sizes": lambda v: min(v, 128),  # a bottleneck of a quarter still holds 32 groups of a group norm
    "conv_dim": lambda v: min(v, 32),
    "tdnn_dim": lambda v: min(v, 32),
    "num_heads": lambda v: min(v, 2),
    "num_attention_heads": lambda v: min(v, 2),
}
# Sizes that only some model types read alike: model type (a substring of it) -> attribute -> tiny value.
_TYPE_SIZES = {
    "swin": {"window_size": 2, "image_size": 64},  # 4 stages of 16, 8, 4 and 2 patches a side, in windows of 2
    "levit": {"patch_size": 16},  # its patch embedding is 4 stride-2 convolutions whatever patch_size says
    "audio-spectrogram-transformer": {"max_length": 32},  # spectrogram frames
}
_NO_DROP = ("dropout", "drop_rate", "dropout_rate", "layerdrop", "drop_path_rate", "drop_path", "pdrop", "jitter")
_MIN_VOCAB = 64


@dataclass(frozen=True)
class ZooModel:
    """One class of a claimed mapping: its name, the head kind the mapping gives, its config class."""

    name: str
    kind: str
    config_class: str

    @property
    def router(self) -> bool:
        """Whether it is built with its router loss on (`output_router_logits=True`)."""
        return self.kind == ROUTER_KIND


def zoo_models(kinds: list[str] | None = None) -> list[ZooModel]:
    """Every class name of the mappings, once (under the first kind that holds it: a text kind before a non-text
    one), sorted by name; with `kinds`, only the classes of those kinds."""
    found: dict[str, ZooModel] = {}
    configs = configuration_auto.CONFIG_MAPPING_NAMES
    for kind, mapping in HEAD_KINDS.items():
        for model_type, names in getattr(modeling_auto, mapping, {}).items():
            for name in names if isinstance(names, (tuple, list)) else (names,):
                if name not in found and model_type in configs:
                    found[name] = ZooModel(name, kind, configs[model_type])
    chosen = [model for model in found.values() if not kinds or model.kind in kinds]
    if not kinds or ROUTER_KIND in kinds:
        causal = [model for model in found.values() if model.kind == "causal_lm"]
        chosen += [ZooModel(m.name, ROUTER_KIND, m.config_class) for m in causal if _has_router(m.config_class)]
    return sorted(chosen, key=lambda model: (model.name, model.kind))


def _has_router(config_class: str) -> bool:
    """Whether a config class has `output_router_logits` (itself, or its text config)."""
    try:
        config = getattr(transformers, config_class)()
    except Exception:  # a config that cannot be made with its defaults: not run as a MoE
        return False
    return hasattr(config, "output_router_logits") or hasattr(text_config(config), "output_router_logits")


def _router_on(values: dict) -> None:
    """Turn the router loss on, in a config's values and those of its text config."""
    for part in (values, values.get("text_config")):
        if isinstance(part, dict) and "output_router_logits" in part:
            part["output_router_logits"] = True
            if isinstance(part.get("router_aux_loss_coef"), float):
                part["router_aux_loss_coef"] = 0.5  # large: a router term over the wrong rows shows
    if "output_router_logits" not in values and not isinstance(values.get("text_config"), dict):
        values["output_router_logits"] = True


def _tiny_value(key: str, value):
    """The tiny value of one config attribute, or `value` when it has none."""
    if value is None:
        return SIZES["head_dim"] if key == "head_dim" else value
    if isinstance(value, (int, float)):  # and bool (use_cache, apply_spec_augment)
        if key in SIZES or key in MEDIA_SIZES:
            return SIZES.get(key, MEDIA_SIZES.get(key))
        return min(value, MAX_PATCH) if key == "patch_size" else value
    if isinstance(value, list) and value and key in _LAYER_LISTS:
        return _LAYER_LISTS[key](value)
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        if key in ("image_size", "patch_size"):
            return [min(v, IMAGE if key == "image_size" else MAX_PATCH) for v in value]
        if key in _STAGE_LISTS:
            return [_STAGE_LISTS[key](v) for v in value]
    return value


def _shrunk(values: dict, token_ids: tuple[int, ...] = (), vlm_text: bool = False) -> dict:
    """A config's `to_dict()` with its sizes shrunk, dropouts off, nested configs shrunk alike (with `token_ids`, the
    special token ids of the configs around it, which its vocabulary must hold; `vlm_text`: a VLM's text config)."""
    out = {}
    depth = next((values[key] for key in ("num_hidden_layers", "num_layers", "n_layer") if key in values), None)
    depth = None if isinstance(values.get("depths"), list) else depth  # per-stage lists (Swin) are not per layer
    token_ids = (*token_ids, *(v for k, v in values.items() if _is_token_id(k, v)))
    for key, value in values.items():
        if isinstance(value, dict) and value.get("model_type") == "timm_backbone":
            out[key] = _resnet_backbone(value)
        elif isinstance(value, dict) and ("model_type" in value or "hidden_size" in value):
            out[key] = _shrunk(value, token_ids, vlm_text=key == "text_config" and "vision_config" in values)
        elif isinstance(value, float) and any(part in key for part in _NO_DROP):
            out[key] = 0.0
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(v, float) for v in value)
            and any(part in key for part in _NO_DROP)
        ):
            out[key] = [0.0] * len(value)  # per stage (CvT's drop_path_rate)
        elif isinstance(value, list) and depth and len(value) == depth and depth > 2 and key not in _STAGE_LISTS:
            out[key] = value[:2]  # one entry per layer (layer types, per-layer sizes)
        else:
            out[key] = _tiny_value(key, value)
    if vlm_text:
        _shrink_mrope(out)
    for model_type, sizes in _TYPE_SIZES.items():
        if model_type in str(values.get("model_type", "")):
            out.update({key: value for key, value in sizes.items() if key in out})
    _keep_output_layers(values, out)
    if isinstance(out.get("depths"), list) and isinstance(out.get("num_layers"), int):
        out["num_layers"] = len(out["depths"])  # Swin's stages: one per entry of depths
    if "encoder_stride" in out and "depths" not in out and isinstance(out.get("patch_size"), int):
        out["encoder_stride"] = out["patch_size"]  # a plain ViT reconstructs masked images at its patch size
    if "vocab_size" in out and isinstance(out["vocab_size"], int):
        out["vocab_size"] = max([_MIN_VOCAB, *(t + 1 for t in token_ids)])
    return out


def _resnet_backbone(timm: dict) -> dict:
    """
    A tiny transformers ResNet for a timm backbone (DETR and its kin default to timm's ResNet-50, and timm is not a
    dependency): the same stages out (ResNet's stage i is timm's feature i), in transformers' own classes.
    """
    stages = timm.get("out_indices") or [1, 2, 3, 4]
    config = transformers.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 16, 16, 16],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        num_channels=timm.get("num_channels", 3),
        out_indices=list(stages),
    )
    return config.to_dict()


def _shrink_mrope(out: dict) -> None:
    """The multimodal RoPE sections of a VLM's text config (Qwen2-VL's default: [16, 24, 24] of a head of 128, set
    in its modeling code), in proportion to the tiny head; other models do not read them."""
    rope = out.get("rope_parameters")
    if not isinstance(rope, dict):
        return
    heads = out.get("num_attention_heads") or 1
    head = out.get("head_dim") or (out.get("hidden_size") or WIDTH) // heads
    half = int(head * rope.get("partial_rotary_factor", out.get("partial_rotary_factor", 1.0)) // 2)
    sections = rope.get("mrope_section") or [16, 24, 24]
    tiny = [max(1, round(half * s / sum(sections))) for s in sections]
    tiny[0] += half - sum(tiny)
    out["rope_parameters"] = {**rope, "mrope_section": tiny}


def _keep_output_layers(values: dict, out: dict) -> None:
    """A backbone whose stages are its layers ("stage12", `out_indices` [3, 6, 9, 12]) keeps one layer per output
    stage, and its outputs the last of them, in order."""
    layers = next((key for key in ("num_hidden_layers", "num_layers") if isinstance(values.get(key), int)), None)
    for key in ("out_indices", "backbone_out_indices"):
        indices = out.get(key)
        if not layers or not isinstance(indices, list) or all(-2 <= i <= out[layers] for i in indices):
            continue
        out[layers] = max(out[layers], len(indices))
        out[key] = [
            i if i < 0 else out[layers] - len(indices) + n + (key == "out_indices") for n, i in enumerate(indices)
        ]
        out.pop("stage_names", None)
        out.pop("out_features", None)


def _is_token_id(key: str, value) -> bool:
    return key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and not isinstance(value, bool)


def build_model(model: ZooModel, seed: int = 0) -> torch.nn.Module:
    """The tiny model of `model`, its weights drawn with `seed`, in float32."""
    config_class = getattr(transformers, model.config_class)
    values = config_class().to_dict()
    if values.get("image_token_index", 0) is None and "num_query_tokens" in values:
        # BLIP-2 and InstructBLIP leave their image token to the processor, which adds it to the tokenizer.
        values["image_token_index"] = _MIN_VOCAB - 1
    values = _shrunk(values)
    if model.kind == "ctc" and values.get("vocab_size", 0) is None:
        values["vocab_size"] = _MIN_VOCAB  # the CTC head's size, which the default config leaves to the tokenizer
    if model.router:
        _router_on(values)
    config = config_class(**values)
    if getattr(config, "classifier_dropout", None) is None:
        # Unset, the token classifiers of decoder LMs (`GenericForTokenClassification`) drop 10 % of the features.
        config.classifier_dropout = 0.0
    torch.manual_seed(seed)
    return getattr(transformers, model.name)(config).float()
