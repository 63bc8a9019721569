"""
Decoder inputs of an encoder-decoder LM, built from its labels as the model itself would build them.

The exact loss takes the labels out of the forward (the loss is computed from the logits), so a model that builds
its decoder inputs from its labels no longer can: the caller builds them. Most encoder-decoders expose how, as
`prepare_decoder_input_ids_from_labels`. Some build them inside `forward` only (Blenderbot, BlenderbotSmall,
M2M100, NLLB-MoE, SeamlessM4T's text-to-text): there every one of them shifts the labels one position to the right,
starts each row with `config.decoder_start_token_id` and replaces the ignored positions (-100) by
`config.pad_token_id`, which is what `shift_right` does.

```python
from hf_parallel.exact.decoder import decoder_input_ids

inputs["decoder_input_ids"] = decoder_input_ids(model, labels["labels"])
```
"""

from __future__ import annotations

import torch
from torch import nn

from .heads import IGNORE_INDEX

__all__ = ["decoder_input_ids", "decoder_inputs_unbuildable", "shift_right"]


def shift_right(labels: torch.Tensor, start_token_id: int, pad_token_id: int) -> torch.Tensor:
    """The labels shifted one position to the right, `start_token_id` first, ignored positions as `pad_token_id`."""
    shifted = labels.new_full(labels.shape, start_token_id)
    shifted[..., 1:] = labels[..., :-1]
    return shifted.masked_fill(shifted.eq(IGNORE_INDEX), pad_token_id)


def _token_ids(model: nn.Module) -> tuple[int | None, int | None]:
    """The decoder start and pad token ids, from the model's config, else from its generation config."""
    found = []
    for name in ("decoder_start_token_id", "pad_token_id"):
        value = getattr(getattr(model, "config", None), name, None)
        if value is None:
            value = getattr(getattr(model, "generation_config", None), name, None)
        found.append(value)
    return found[0], found[1]


def decoder_inputs_unbuildable(model: nn.Module) -> str | None:
    """Why the decoder inputs of `model` cannot be built from its labels (the reason names the fix), or None."""
    if callable(getattr(model, "prepare_decoder_input_ids_from_labels", None)):
        return None
    start, pad = _token_ids(model)
    missing = [name for name, value in (("decoder_start_token_id", start), ("pad_token_id", pad)) if value is None]
    if not missing:
        return None
    return (
        f"{type(model).__name__} has no prepare_decoder_input_ids_from_labels and its config sets no {missing}, so "
        "its decoder inputs cannot be built from the labels. Set them on model.config, or pass decoder_input_ids "
        "in the batch."
    )


def decoder_input_ids(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """
    The decoder inputs `model` builds from `labels` when it is given no decoder inputs.

    Args:
        model (`nn.Module`): the encoder-decoder model, out of DataParallel/DDP wrappers.
        labels (`torch.Tensor`): `[rows, positions]` target ids, -100 where ignored.
    """
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return prepare(labels=labels)
    reason = decoder_inputs_unbuildable(model)
    if reason is not None:
        raise ValueError(reason)
    return shift_right(labels, *_token_ids(model))
