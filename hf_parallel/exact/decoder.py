"""
Decoder inputs of an encoder-decoder LM, when the labels are kept out of its forward.

The exact loss takes the labels out of the forward (the loss is computed from the logits), so a model that builds
its decoder inputs from its labels no longer can: the caller builds them, with the model's own
`prepare_decoder_input_ids_from_labels`. Some encoder-decoders build them inside `forward` only, each its own way
(Blenderbot, BlenderbotSmall, M2M100, NLLB-MoE and SeamlessM4T shift the labels right from
`config.decoder_start_token_id`; FSMT shifts the *inputs*): their head is a `LabelsInForwardHead`, whose forward
keeps the labels, so the model builds its decoder inputs itself (and computes its own loss next to the logits, which
the exact loss does not use: one more cross-entropy per forward, the cost of never guessing).

```python
from hf_parallel.exact.decoder import decoder_input_ids

inputs["decoder_input_ids"] = decoder_input_ids(model, labels["labels"])
```
"""

from __future__ import annotations

import torch
from torch import nn

from .heads import CrossEntropyHead

__all__ = ["LabelsInForwardHead", "decoder_input_ids"]


class LabelsInForwardHead(CrossEntropyHead):
    """The cross-entropy of an encoder-decoder that builds its decoder inputs inside its forward only: the labels
    stay in the model's inputs (`labels_in_forward`), the loss is still recomputed from the logits."""

    labels_in_forward = True


def decoder_input_ids(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """
    The decoder inputs `model` builds from `labels` when it is given no decoder inputs.

    Args:
        model (`nn.Module`): the encoder-decoder model, out of DataParallel/DDP wrappers.
        labels (`torch.Tensor`): `[rows, positions]` target ids, -100 where ignored.
    """
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if not callable(prepare):
        raise ValueError(
            f"{type(model).__name__} has no prepare_decoder_input_ids_from_labels: its head keeps the labels in the "
            "forward (LabelsInForwardHead), so that the model builds its decoder inputs itself."
        )
    return prepare(labels=labels)
