"""
A CPU stand-in for Liger's fused linear cross-entropy (`use_liger_kernel=True`): `fuse_loss(model)` patches a
transformers causal LM *instance* the way Liger does (`model.forward = MethodType(lce_forward, model)`), so that the
real model code runs around it.

In training, given labels, the patched forward runs the base model and computes the loss from the hidden states chunk
by chunk of rows (LM head -> float -> summed cross-entropy), each chunk under non-reentrant activation checkpointing:
neither the forward nor the backward holds more than one chunk's logits, and the `[rows, positions, vocab]` logits are
never built (`logits=None` is returned). Liger does this in a Triton kernel, which needs a GPU. Its loss follows
transformers' `loss_function` convention: the shifted cross-entropy summed over non-ignored (-100) targets, divided by
`num_items_in_batch` when given, else by the number of those targets (the mean); `shift_labels` may replace the shift.
Without labels, or in eval mode unless `skip_logits=True`, it builds the logits and takes the model's own
`loss_function`, as the stock forward does.

Under `nn.DataParallel` the patched forward runs on each replica: torch's `replicate` makes replicas by copying each
module's `__dict__` (`Module._replicate_for_data_parallel`), so a forward bound to the original instance would run the
original module (its parameters, on GPU 0) in every replica thread. The patch therefore also gives the instance its own
`_replicate_for_data_parallel`, which re-binds both methods to each replica it makes. (Liger's own instance patch has
no such re-binding.)

What ran is recorded in a `FusedCalls` shared by the model and its replicas (`model.fused_calls_record`): tests assert
"the full logits were never built in training" from it.

```python
from tests.helpers.fused import fuse_loss

record = fuse_loss(model, chunk_size=1024)
model.train()
out = model(input_ids=ids, labels=labels, num_items_in_batch=n)  # out.logits is None
record.fused_calls, record.logits_calls  # (1, 0)
```
"""

from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["FusedCall", "FusedCalls", "fuse_loss"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class FusedCall:
    """One call of the patched forward: `fused` (the chunked loss ran) or not (full logits built)."""

    fused: bool
    rows: int
    replica: bool  # the module that ran was a DataParallel replica (`_is_replica`), not the original


@dataclass
class FusedCalls:
    """What the patched forward did, call by call (thread-safe: DataParallel replicas run in threads)."""

    calls: list[FusedCall] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, call: FusedCall) -> None:
        with self._lock:
            self.calls.append(call)

    @property
    def fused_calls(self) -> int:
        return sum(call.fused for call in self.calls)

    @property
    def logits_calls(self) -> int:
        """Calls that built the full `[rows, positions, vocab]` logits."""
        return sum(not call.fused for call in self.calls)


def _base_model(model: nn.Module) -> nn.Module:
    return model.model if "model" in model._modules else model.get_decoder()


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _fused_loss(self, hidden, labels, shift_labels, num_items_in_batch) -> torch.Tensor:
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    head = self.get_output_embeddings()
    chunk = self.fused_chunk_size
    loss = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        # Non-reentrant checkpointing keeps only the chunk's inputs; its logits are rebuilt in its backward.
        part = torch.utils.checkpoint.checkpoint(
            _chunk_loss_sum, head, hidden[start : start + chunk], targets[start : start + chunk], use_reentrant=False
        )
        loss = loss + part
    if num_items_in_batch is None:
        return loss / (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def fused_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    labels=None,
    use_cache=None,
    skip_logits=None,
    num_items_in_batch=None,
    shift_labels=None,
    logits_to_keep=0,
    **kwargs,
):
    """The patched forward (bound to the module that runs: the model or one of its DataParallel replicas)."""
    has_targets = labels is not None or shift_labels is not None
    if skip_logits is None:
        skip_logits = self.training and has_targets
    if skip_logits and not has_targets:
        raise ValueError("skip_logits=True needs labels or shift_labels: the fused path computes only the loss.")
    outputs = _base_model(self)(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **kwargs
    )
    hidden = outputs.last_hidden_state
    replica = bool(getattr(self, "_is_replica", False))
    self.fused_calls_record.add(FusedCall(fused=bool(skip_logits), rows=hidden.shape[0], replica=replica))
    loss = logits = None
    if skip_logits:
        loss = _fused_loss(self, hidden, labels, shift_labels, num_items_in_batch)
    else:
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep, :]
        logits = self.get_output_embeddings()(hidden)
        if has_targets:
            loss = self.loss_function(
                logits=logits,
                labels=labels,
                vocab_size=self.config.vocab_size,
                num_items_in_batch=num_items_in_batch,
                shift_labels=shift_labels,
            )
    # The cache's key: `cache` from transformers 5.2x, `past_key_values` before (5.19).
    cache_key = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        **{cache_key: getattr(outputs, cache_key, None)},
    )


def _replicate_fused(self) -> nn.Module:
    # torch's replica copies `__dict__`, whose methods are bound to `self`: bind them to the replica instead.
    replica = type(self)._replicate_for_data_parallel(self)
    _bind(replica)
    return replica


def _bind(module: nn.Module) -> None:
    module.forward = types.MethodType(fused_forward, module)
    module._replicate_for_data_parallel = types.MethodType(_replicate_fused, module)


def fuse_loss(model: nn.Module, chunk_size: int = 1024) -> FusedCalls:
    """
    Patch `model` (a transformers causal LM instance) to compute its training loss fused with the LM head, chunk by
    chunk of `chunk_size` rows of the flattened hidden states, as Liger's fused linear cross-entropy does.

    Args:
        model (`nn.Module`):
            A causal LM whose base model is `model.model` (or `model.get_decoder()`) and whose LM head is
            `model.get_output_embeddings()`.
        chunk_size (`int`, *optional*, defaults to 1024):
            Rows (batch x positions) per chunk.

    Returns:
        `FusedCalls`: the record of calls, also `model.fused_calls_record`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}.")
    if model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} has no LM head (get_output_embeddings() is None).")
    record = FusedCalls()
    model.fused_calls_record = record  # shared with the replicas: a shallow copy of __dict__ keeps the object
    model.fused_chunk_size = chunk_size
    _bind(model)
    return record
