"""Tiny models and datasets for the tests: built from configs and made in code, nothing downloaded."""

from __future__ import annotations

import inspect
import warnings

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

VOCAB = 50


def tiny_bert_config(**overrides) -> BertConfig:
    return tiny(BertConfig, **overrides)


def tiny_bert_classifier(seed: int = 0, num_labels: int = 2, **config) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(tiny_bert_config(num_labels=num_labels, **config))


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class IterableRows(torch.utils.data.IterableDataset):
    """The same rows as an iterable dataset (no length): accelerate then shards it by batches, not by indices."""

    def __init__(self, rows):
        self.rows = list(rows)

    def __iter__(self):
        return iter(self.rows)


def classification_rows(n: int, seq_len: int = 8, num_labels: int = 2, seed: int = 0) -> ListDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, seq_len), generator=g)
    labels = torch.randint(0, num_labels, (n,), generator=g)
    return ListDataset(
        [
            {"input_ids": ids[i], "attention_mask": torch.ones(seq_len, dtype=torch.long), "labels": labels[i]}
            for i in range(n)
        ]
    )


class TinyRegressor(nn.Module):
    """A Linear `fc` and a mean squared error, called the way Trainer calls a model: `forward(x, labels)` -> dict."""

    def __init__(self, out_features: int = 3):
        super().__init__()
        self.fc = nn.Linear(4, out_features)

    def forward(self, x, labels=None):
        outputs = {"logits": self.fc(x)}
        if labels is not None:
            outputs["loss"] = nn.functional.mse_loss(outputs["logits"], labels)
        return outputs


def qat_model(seed: int, out_features: int = 3, backend: str = "fbgemm") -> TinyRegressor:
    """
    A `TinyRegressor` prepared for quantization-aware training with torch.ao's default QAT qconfig: the weight's
    fake-quantize is per channel, and its scale / zero_point / observer min and max start with a placeholder shape
    that the first forward, or the module's `_load_from_state_dict`, turns into one value per output channel.
    """
    torch.manual_seed(seed)
    model = TinyRegressor(out_features).train()  # prepare_qat refuses a model in eval mode
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.ao.quantization is deprecated", DeprecationWarning)
        warnings.filterwarnings("ignore", "Please use quant_min and quant_max", UserWarning)
        model.qconfig = torch.ao.quantization.get_default_qat_qconfig(backend)
        return torch.ao.quantization.prepare_qat(model)


# The sizes of every tiny model built by `tiny`, by the config argument that holds them; a config class takes those
# its constructor names.
TINY_SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd"), 16),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers"), 1),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads"), 2),
    **dict.fromkeys(("encoder_attention_heads", "decoder_attention_heads"), 2),
    **dict.fromkeys(("intermediate_size", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim"), 32),
    "num_key_value_heads": 1,
    "d_kv": 8,
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions"), 32),
    **dict.fromkeys(("dropout", "dropout_rate", "attention_dropout", "activation_dropout"), 0.0),
    **dict.fromkeys(("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop"), 0.0),
    "attn_pdrop": 0.0,
    "use_cache": False,
}


def tiny(config_class: type, **overrides):
    """
    A tiny config of `config_class`: `TINY_SIZES` where its constructor takes them, then `overrides`.

    ```python
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(tiny(LlamaConfig, vocab_size=1000))
    ```
    """
    accepted = inspect.signature(config_class.__init__).parameters
    sizes = {key: value for key, value in TINY_SIZES.items() if key in accepted}
    return config_class(**{**sizes, **overrides})
