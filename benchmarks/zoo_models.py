"""
The model zoo of `benchmarks.zoo`: every class name of the auto mappings hf_parallel claims a head for, built tiny
from its config class, and four rows of inputs and labels for its head.

A tiny config is the config class's defaults with every size it knows shrunk (`SIZES`: width, depth, heads, experts),
every dropout and stochastic depth at 0, and no cache; nested configs (a text config, an encoder and a decoder) are
shrunk alike. The vocabulary is kept above every special token id the config names, so that those stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

__all__ = ["HEAD_KINDS", "ZooModel", "build_model", "rows_for", "zoo_models"]

#: The mappings of `hf_parallel.exact.resolve`, by the head kind they give, in its order of precedence.
HEAD_KINDS = {
    "question_answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "multiple_choice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
}

SEQ = 8
ROWS = 4
NUM_LABELS = 3
WIDTH = 32

# Config attribute -> its tiny value. Only attributes the config class has are set.
SIZES = {
    **dict.fromkeys(
        ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "hidden_dim", "word_embed_proj_dim"), WIDTH
    ),
    **dict.fromkeys(("embedding_size", "n_embed", "d_embed", "emb_dim", "projection_dim"), WIDTH),
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
_NO_DROP = ("dropout", "drop_rate", "dropout_rate", "layerdrop", "drop_path_rate", "drop_path", "pdrop")
_MIN_VOCAB = 64


@dataclass(frozen=True)
class ZooModel:
    """One class of a claimed mapping: its name, the head kind the mapping gives, its config class."""

    name: str
    kind: str
    config_class: str


def zoo_models() -> list[ZooModel]:
    """Every class name of the claimed mappings, once (under the head kind resolve tries first), sorted by name."""
    found: dict[str, ZooModel] = {}
    configs = configuration_auto.CONFIG_MAPPING_NAMES
    for kind, mapping in HEAD_KINDS.items():
        for model_type, names in getattr(modeling_auto, mapping).items():
            for name in names if isinstance(names, (tuple, list)) else (names,):
                if name not in found and model_type in configs:
                    found[name] = ZooModel(name, kind, configs[model_type])
    return sorted(found.values(), key=lambda model: model.name)


def _shrunk(values: dict) -> dict:
    """A config's `to_dict()` with its sizes shrunk, dropouts off, nested configs shrunk alike."""
    out = {}
    depth = next((values[key] for key in ("num_hidden_layers", "num_layers", "n_layer") if key in values), None)
    for key, value in values.items():
        if isinstance(value, dict) and ("model_type" in value or "hidden_size" in value):
            out[key] = _shrunk(value)
        elif key in SIZES and (value is None or isinstance(value, (int, float, bool))):
            out[key] = SIZES[key] if value is not None or key == "head_dim" else value
        elif isinstance(value, float) and any(part in key for part in _NO_DROP):
            out[key] = 0.0
        elif isinstance(value, list) and depth and len(value) == depth and depth > 2:
            out[key] = value[:2]  # one entry per layer (layer types, per-layer sizes)
        else:
            out[key] = value
    token_ids = [v for k, v in out.items() if k.endswith(("_token_id", "_token_index")) and isinstance(v, int)]
    if "vocab_size" in out and isinstance(out["vocab_size"], int):
        out["vocab_size"] = max([_MIN_VOCAB, *(t + 1 for t in token_ids)])
    return out


def build_model(model: ZooModel, seed: int = 0) -> torch.nn.Module:
    """The tiny model of `model`, its weights drawn with `seed`, in float32."""
    config_class = getattr(transformers, model.config_class)
    config = config_class(**_shrunk(config_class().to_dict()))
    torch.manual_seed(seed)
    return getattr(transformers, model.name)(config).float()


def _token_ids(config, rows: int, seq: int, g: torch.Generator) -> torch.Tensor:
    vocab = getattr(config.get_text_config(), "vocab_size", None) or _MIN_VOCAB
    # Clear of the special tokens (ids 0..3 in most configs), and of the vocabulary's end.
    return torch.randint(4, min(vocab, _MIN_VOCAB), (rows, seq), generator=g)


def rows_for(model: ZooModel, built: torch.nn.Module, seed: int = 1) -> list[dict]:
    """`ROWS` rows of inputs and labels for the head of `model`, with uneven numbers of items per row."""
    g = torch.Generator().manual_seed(seed)
    config = built.config
    if model.kind == "multiple_choice":
        ids = _token_ids(config, ROWS * 2, SEQ, g).view(ROWS, 2, SEQ)
        labels = torch.randint(0, 2, (ROWS,), generator=g)
        return [{"input_ids": ids[i], "labels": labels[i]} for i in range(ROWS)]
    ids = _token_ids(config, ROWS, SEQ, g)
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long)} for i in range(ROWS)]
    if model.kind == "question_answering":
        start, end = torch.randint(0, SEQ, (ROWS,), generator=g), torch.randint(0, SEQ, (ROWS,), generator=g)
        start[0] = SEQ + 2  # outside the input: ignored
        for i, row in enumerate(rows):
            row.update(start_positions=start[i], end_positions=end[i])
        return rows
    if model.kind == "sequence_classification":
        labels = torch.randint(0, config.num_labels, (ROWS,), generator=g)
    elif model.kind == "token_classification":
        labels = torch.randint(0, config.num_labels, (ROWS, SEQ), generator=g)
    elif model.kind == "seq2seq_lm":
        labels = _token_ids(config, ROWS, SEQ, g)
    else:
        labels = ids.clone()
    if labels.dim() == 2:
        lengths = torch.tensor([2, SEQ, 5, 7])  # uneven: a wrong average of per-batch means shows
        labels = labels.masked_fill(torch.arange(SEQ)[None, :] >= lengths[:, None], -100)
    for i, row in enumerate(rows):
        row["labels"] = labels[i]
    return rows
