"""Tiny models and datasets for the tests: built from configs and made in code, nothing downloaded."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

VOCAB = 50


def tiny_bert_config(**overrides) -> BertConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    kwargs.update(overrides)
    return BertConfig(**kwargs)


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
