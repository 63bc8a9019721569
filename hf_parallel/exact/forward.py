"""
One micro-batch's exact loss, wherever its forward runs (one device, a DDP rank, the replicas of a DataParallel
wrapper), by either of two routes to the same S / C:

- **recomputed** (the default): the labels are kept out of the forward and the head computes each row's loss sum
  from the logits (`ExactLoss.terms`);
- **the model's own** (a head `uses_model_loss`): the model gets its labels, the padding rows of an epoch's last
  step set to the ignore index, and `num_items_in_batch`, the item count C of the whole step; a loss that honours
  it, as transformers' `loss_function` and Liger's fused cross-entropy do, is then S / C itself. In evaluation the
  count given is 1, so the loss is S. This is the route of a forward that computes its loss from the hidden states
  chunk by chunk and never builds the `[rows, positions, vocabulary]` logits (`use_liger_kernel=True`), and of the
  plain transformers language models, whose own loss is that cross-entropy.

Which route a head takes is decided by its first forward (`hf_parallel.exact.selfcheck`): for a per-position
cross-entropy on a model whose forward takes `num_items_in_batch`, that forward gets the labels and a count N that is
no count of its items, 2C + 1/2, so that a loss divided by it tells itself apart from the mean of its items: with
logits, by comparing it with the heads' sums; without them, by its gradient with respect to the count (-S / N^2 for
S / N). The two differ by a factor of about 2 at any C, far beyond any rounding: an offset that does not grow with C
(C + 1/2) moves S / N by 1 / (2C) only, below a float32 loss's tolerance once a micro-batch holds 5,000 items (a
summarisation batch), and below a half-precision one's from 50.

```python
from hf_parallel.exact import ExactLoss
from hf_parallel.exact.forward import micro_batch_loss

exact = ExactLoss()
head = exact.head(model, batches[0])
step = exact.count_step(head, batches)
for batch in batches:
    loss, _ = micro_batch_loss(exact, model, head, batch, step)
    loss.backward()
```
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .counts import StepCounts, sequence_length
from .heads import CrossEntropyHead, LossHead
from .remainder import REAL_ROWS_KEY
from .replicas import is_data_parallel, outputs_device, run_in_replicas, takes_use_cache, without_cache
from .selfcheck import fused_outputs, takes_gradient_from_loss

__all__ = ["accepts_item_count", "batch_device", "can_use_model_loss", "micro_batch_loss"]

#: The item count a checked forward passes is C * PROBE_SCALE + PROBE_OFFSET for C items (see the module docstring):
#: never a whole number, so no count of items, and twice C, so that S / N and S / C differ at every size and precision.
PROBE_SCALE = 2.0
PROBE_OFFSET = 0.5


def probe_count(items: torch.Tensor) -> torch.Tensor:
    """The `num_items_in_batch` a checked forward of a micro-batch with `items` items passes: 2C + 1/2, in float32."""
    return items.float() * PROBE_SCALE + PROBE_OFFSET


def can_use_model_loss(head: LossHead | None, model: nn.Module, loss_func: Callable | None = None) -> bool:
    """
    Whether the model's own loss could be the exact one for `head`: a per-position cross-entropy without label
    smoothing (the model's loss has none), no user loss, and a forward that takes `num_items_in_batch`. Whether the
    loss honours the count is for the first forward to show (`hf_parallel.exact.selfcheck`).
    """
    return (
        isinstance(head, CrossEntropyHead)
        and head.per_position
        and not head.smoothing
        and loss_func is None
        and accepts_item_count(model)
    )


def accepts_item_count(model: nn.Module) -> bool:
    """
    Whether `model` (out of its wrappers) may be given `num_items_in_batch`: its `accepts_loss_kwargs` where it sets
    one, else whether its `forward` (an instance's own, as Liger patches it, or its class's) takes it or `**kwargs`.
    """
    inner = _base_model(model)
    flag = getattr(inner, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return flag
    forward = inner.forward  # an instance's own forward first (Liger patches the instance), else its class's
    return _takes_count(getattr(forward, "__func__", forward))


def _base_model(model: nn.Module) -> nn.Module:
    while isinstance(getattr(model, "module", None), nn.Module):  # DataParallel, DDP
        model = model.module
    base = getattr(model, "get_base_model", None)  # PEFT: its forward passes **kwargs on to the model's
    return base() if callable(base) and getattr(model, "active_peft_config", None) is not None else model


@functools.lru_cache(maxsize=256)
def _takes_count(forward: Callable) -> bool:
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "num_items_in_batch" or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def uses_model_loss(head: LossHead | None) -> bool:
    """Whether `head` takes the model's own loss (decided by its check) instead of recomputing it."""
    return bool(getattr(head, "uses_model_loss", False))


def micro_batch_loss(
    exact,
    model: nn.Module,
    head: LossHead,
    inputs: dict,
    step: StepCounts | None,
    *,
    owner: nn.Module | None = None,
    loss_func: Callable | None = None,
    return_outputs: bool = False,
    autocast_dtype: torch.dtype | None = None,
    main_input_name: str = "input_ids",
    accumulation_steps: int = 1,
) -> tuple[torch.Tensor, Any]:
    """
    The exact loss of one micro-batch (S / C of the step in training, `step` given; S / C of the batch in evaluation,
    added to the evaluation totals) and, when `return_outputs`, the model's outputs (None where a DataParallel
    forward gathered none: evaluation without predictions).

    Args:
        exact (`ExactLoss`): the loss core (head cache, check, counts, totals).
        model (`nn.Module`): what to call: the model, or its DDP / DataParallel wrapper.
        head (`LossHead`): `exact.head(owner)`.
        inputs (`dict`): the batch, with its labels (the caller's dict is not changed).
        step (`StepCounts`, *optional*): the counts of the whole optimizer step (`exact.count_step`); None in
            evaluation.
        owner (`nn.Module`, *optional*): the model whose head is cached (the Trainer's `self.model`); defaults to
            `model`.
        loss_func (`Callable`, *optional*): a user loss, `loss_func(outputs, labels, num_items_in_batch=...)`.
        return_outputs (`bool`, *optional*): return the outputs too.
        autocast_dtype (`torch.dtype`, *optional*): the dtype of every DataParallel replica's forward.
        main_input_name (`str`, *optional*): the input whose second dimension is the sequence length.
        accumulation_steps (`int`, *optional*): the micro-batches of the step, for the model's own mean loss where
            the check falls back to it.
    """
    owner = model if owner is None else owner
    check = exact.pending_check(head, owner, inputs, loss_func)
    own = uses_model_loss(head)
    probe = check is not None and can_use_model_loss(head, exact.unwrap(owner), loss_func)
    if "skip_logits" in inputs and (check is not None or not own):
        # Stock asks a Liger forward for no logits in evaluation without predictions (`skip_logits=True`); the check
        # compares the logits, and a recomputed loss is made of them.
        inputs = {key: value for key, value in inputs.items() if key != "skip_logits"}
    inputs, labels = exact.split_labels(head, inputs, model, build_decoder_inputs=check is None and not own)
    total = exact.user_loss_total(head, labels, step, inputs, main_input_name) if loss_func is not None else None
    run = _Forward(exact, head, loss_func, total, step, main_input_name, check, own, probe)
    data_parallel = is_data_parallel(model)
    run.keep = return_outputs and (exact.outputs_wanted or not data_parallel)
    run.drop_cache = data_parallel
    with exact.watching_decoder(check, model, inputs):  # which decoder inputs the model builds itself
        if not data_parallel:
            terms, outputs = run(model, inputs, labels)
        else:
            if not run.keep and "use_cache" not in inputs and takes_use_cache(model.module):
                inputs = {**inputs, "use_cache": False}  # nothing reads a cache of a forward whose outputs are dropped
            terms, outputs = run_in_replicas(model, run, inputs, labels, autocast_dtype)
    if check is not None:
        head = exact.settle(check, owner, terms, step)
    if head is None:
        # The model's own loss (per replica: their mean, as stock's), a per-micro-batch mean as the stock loss of the
        # following steps; the step was counted as exact, so divide by its micro-batches here.
        loss = terms["model_loss"].mean() / (accumulation_steps if step is not None else 1)
    else:
        loss = exact.reduce(head, terms, step)
    return loss, outputs


class _Forward:
    """
    One forward and its loss terms, run where the outputs are: in the caller, or in each DataParallel replica on its
    rows (`ReplicaStep` calls it with the replica's model and chunks).
    """

    def __init__(self, exact, head, loss_func, total, step, main_input_name, check, own, probe):
        self.exact, self.head, self.loss_func, self.total, self.step = exact, head, loss_func, total, step
        self.main_input_name, self.check, self.own, self.probe = main_input_name, check, own, probe
        self.keep = False
        self.drop_cache = False
        # The model gets the labels for the check, for its own loss, and where it builds its decoder inputs itself.
        self.with_labels = check is not None or own or getattr(head, "labels_in_forward", False)

    def __call__(self, run, inputs: dict, labels: dict):
        exact, head = self.exact, self.head
        model_labels = {key: value for key, value in labels.items() if key != REAL_ROWS_KEY}
        seq_len = sequence_length(inputs, self.main_input_name)
        device = batch_device(model_labels, inputs)
        count = None
        if self.own:
            # S / C of the step in training; S itself in evaluation.
            count = self.step.total().to(device) if self.step is not None else 1
        elif self.probe:
            items = head.count(model_labels, seq_len).sum().to(device)
            count = probe_count(items).requires_grad_(torch.is_grad_enabled())
        extra = model_labels if self.with_labels else {}
        if count is not None:
            extra = {**extra, "num_items_in_batch": count}
        outputs = run(**inputs, **extra)
        if self.own or (self.probe and fused_outputs(outputs)):
            terms = exact.model_terms(head, outputs, labels, seq_len, count)
        else:
            total = self.total
            here = total.to(outputs_device(outputs, labels)) if torch.is_tensor(total) else total
            # A checked forward whose gradient comes from the model's own loss computes the head only to compare.
            from_loss = self.check is not None and self.loss_func is None and takes_gradient_from_loss(head, outputs)
            with torch.no_grad() if from_loss else contextlib.nullcontext():
                terms = exact.terms(head, outputs, labels, inputs, loss_func=self.loss_func, total=here)
        if self.check is not None:
            terms.update(exact.check_terms(self.check, outputs, labels, inputs, terms, count if self.probe else None))
        if not self.keep:
            return terms, None
        return terms, (without_cache(outputs) if self.drop_cache else outputs)


def batch_device(*tensors: dict) -> torch.device:
    """The device a forward's rows are on (a DataParallel replica's): that of its first tensor."""
    for group in tensors:
        for value in group.values():
            if torch.is_tensor(value):
                return value.device
    return torch.device("cpu")
