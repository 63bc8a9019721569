"""
CTC speech recognition (`*ForCTC`: Wav2Vec2, HuBERT, WavLM, Parakeet, ...): the per-utterance CTC loss.

transformers' CTC heads call `self.loss_function(logits=..., labels=..., logit_lengths=..., blank_token_id=...,
reduction=config.ctc_loss_reduction, zero_infinity=config.ctc_zero_infinity)`, with `logit_lengths` (the frames of
each utterance's logits) computed inside the forward, each model its own way (from the feature extractor's strides,
from the encoder's attention mask). Nothing outside the forward can compute them without guessing, so the labels
stay in the forward (`Route.LABELS_IN_FORWARD`) and `LossCallWatch` records the arguments of that call; the head then
computes one CTC loss per utterance from the logits and those lengths (`reduction="none"`).

The two reductions:
- `"mean"`: each utterance's loss divided by its target length (at least 1), averaged over the utterances: the items
  are the utterances, S the sum of their length-normalised losses;
- `"sum"` (the config default): a plain sum. No one divides it, so the step's loss is the sum over all its
  utterances, on every rank and micro-batch (`LossHead.summed`); under DDP each rank's sum is scaled by the world
  size, which DDP's averaging takes back.

```python
from hf_parallel.exact.heads.base import LOSS_CALL_KEY, LossCallWatch
from hf_parallel.exact.heads.ctc import CTCHead

head = CTCHead(blank=model.config.pad_token_id, reduction=model.config.ctc_loss_reduction)
watch = LossCallWatch(model, head.loss_call.arguments)
outputs = model(input_values=values, attention_mask=mask, labels=labels)
sums, counts = head.row_terms(outputs, {"labels": labels, LOSS_CALL_KEY: watch.take()})
watch.remove()
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import (
    IGNORE_INDEX,
    LOSS_CALL_KEY,
    HeadFamily,
    HeadMismatch,
    LossCall,
    LossHead,
    Route,
    UnsupportedHead,
    _logits,
    class_names,
)

__all__ = ["CTC", "CTCHead", "inferred_logit_lengths"]


def inferred_logit_lengths(model, inputs: dict) -> dict:
    """
    `logit_lengths` as a model that computes its CTC loss inline (transformers before 5.2x, which has no
    `loss_function` for CTC) computes them: the frames of each utterance's unmasked samples,
    `_get_feat_extract_output_lengths(attention_mask.sum(-1))`; empty where the model has no such method.
    """
    frames = getattr(model, "_get_feat_extract_output_lengths", None)
    values = inputs.get(getattr(model, "main_input_name", "input_values"), inputs.get("input_values"))
    if not callable(frames) or not torch.is_tensor(values):
        return {}
    mask = inputs.get("attention_mask")
    samples = mask.sum(-1) if torch.is_tensor(mask) else torch.full(values.shape[:1], values.shape[-1])
    return {"logit_lengths": frames(samples.to(values.device)).to(torch.long)}


class CTCHead(LossHead):
    """
    The CTC loss of each utterance, from the logits and the `logit_lengths` the model passed to its loss function.

    Args:
        blank (`int`): the blank token id when the model's loss call does not say it (`config.pad_token_id`, as most
            models pass it; the one a model passes as `blank_token_id` wins).
        reduction (`str`): `config.ctc_loss_reduction`, `"mean"` or `"sum"`.
        zero_infinity (`bool`, *optional*): `config.ctc_zero_infinity`.
        name (`str`, *optional*): for messages.
    """

    route = Route.LABELS_IN_FORWARD
    loss_call = LossCall(("logit_lengths", "blank_token_id"), inferred=inferred_logit_lengths)

    def __init__(self, blank: int, reduction: str, zero_infinity: bool = False, name: str | None = None):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"CTCHead: ctc_loss_reduction must be 'mean' or 'sum', got {reduction!r}.")
        super().__init__(("labels",), name or f"ctc/{reduction}")
        self.blank, self.reduction, self.zero_infinity = blank, reduction, bool(zero_infinity)
        self.summed = reduction == "sum"

    def count(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> torch.Tensor:
        """The utterances: every row is one, with or without targets (torch's mean divides by the batch)."""
        target = labels["labels"]
        return torch.tensor([target.shape[0]], device=target.device)

    def row_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        call = labels.get(LOSS_CALL_KEY, {})
        lengths = call.get("logit_lengths")
        if not torch.is_tensor(lengths):
            raise HeadMismatch(
                f"{self.name}: the model did not pass logit_lengths to its loss_function, so the frames of each "
                "utterance are not known."
            )
        logits = _logits(outputs)
        target = labels["labels"].to(logits.device)
        # The blank the model passed (OmniASR's and Parakeet TDT's `blank_token_id`, not `pad_token_id`).
        blank = int(call.get("blank_token_id", self.blank))
        items = target.ne(IGNORE_INDEX) & target.ne(blank)
        target_lengths = items.sum(-1)
        log_probs = F.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
        with torch.backends.cudnn.flags(enabled=False):  # as the models: cuDNN's CTC takes other inputs
            losses = F.ctc_loss(
                log_probs,
                target.masked_select(items),
                lengths.to(logits.device),
                target_lengths,
                blank=blank,
                reduction="none",
                zero_infinity=self.zero_infinity,
            )
        if not self.summed:
            losses = losses / target_lengths.clamp(min=1)
        rows = target.shape[0]
        return losses.reshape(rows, 1), torch.ones(rows, 1, dtype=torch.long, device=losses.device)


def _ctc(name: str, model, labels, smoothing: float) -> LossHead:
    config = model.config
    reduction = getattr(config, "ctc_loss_reduction", None)
    if reduction not in ("mean", "sum"):
        raise UnsupportedHead(f"{name} has ctc_loss_reduction={reduction!r}; hf_parallel knows 'mean' and 'sum'.")
    # Most CTC models pass pad_token_id as the blank; OmniASR passes blank_token_id (recorded from the call).
    blank = getattr(config, "pad_token_id", None)
    blank = blank if isinstance(blank, int) else getattr(config, "blank_token_id", None)
    if not isinstance(blank, int):
        raise UnsupportedHead(f"{name} has neither a pad_token_id nor a blank_token_id for its CTC blank token.")
    return CTCHead(blank, reduction, getattr(config, "ctc_zero_infinity", False), name=f"ctc/{reduction}")


CTC = HeadFamily(class_names("MODEL_FOR_CTC_MAPPING_NAMES"), _ctc)
