"""
One micro-batch's exact loss, wherever its forward runs (one device, a DDP rank, the replicas of a DataParallel
wrapper): `micro_batch_loss`, the entry that `hf_parallel.Trainer` and `hf_parallel.ExactLoop` both call.

The forward runs by the head's route (`hf_parallel.exact.heads.Route`): the labels taken out and S recomputed from
the logits, or kept in (the model builds its decoder inputs), or the model's own loss given the step's count C
(`num_items_in_batch`), or the user's `compute_loss_func`. Under DataParallel each replica computes the terms of its
own rows (`hf_parallel.exact.replicas`); only `Terms` travel to GPU 0. The first forward of a model is checked
against the model's own loss by a piece that wraps this forward (`hf_parallel.exact.checked`); its verdict is decided
in `hf_parallel.exact.check`. The steady steps of a plain run take a shorter path (`hf_parallel.exact.step`).

```python
from hf_parallel.exact import ExactLoss, RunContext, micro_batch_loss

exact = ExactLoss()
head = exact.head(model, batches[0])
step = exact.count_step(head, batches)
for batch in batches:
    loss, _ = micro_batch_loss(exact, model, head, batch, step, RunContext())
    loss.backward()
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .checked import CheckedForward
from .compare import can_use_model_loss, fused_outputs
from .coupled import contrastive_loss
from .heads import LossHead, Route
from .heads.base import LOSS_CALL_KEY
from .replicas import (
    Reporting,
    gathers_as_torch,
    is_data_parallel,
    outputs_device,
    run_in_replicas,
    takes_use_cache,
    without_cache,
)
from .terms import (
    StepCounts,
    Terms,
    batch_device,
    forward_terms,
    model_labels,
    model_terms,
    router_terms,
    sequence_length,
    split_labels,
    user_loss_total,
    watching_loss_call,
)

__all__ = ["RunContext", "micro_batch_loss"]


@dataclass(frozen=True)
class RunContext:
    """
    What stays the same over a run's micro-batches.

    Args:
        owner (`nn.Module`, *optional*): the model whose head is cached (the Trainer's `self.model`); defaults to the
            model called.
        loss_func (`Callable`, *optional*): a user loss, `loss_func(outputs, labels, num_items_in_batch=...)`.
        autocast_dtype (`torch.dtype`, *optional*): the dtype of every DataParallel replica's forward.
        main_input_name (`str`, *optional*, defaults to `"input_ids"`): the input whose second dimension is the
            sequence length.
    """

    owner: nn.Module | None = None
    loss_func: Callable | None = None
    autocast_dtype: torch.dtype | None = None
    main_input_name: str = "input_ids"


def micro_batch_loss(
    exact,
    model: nn.Module,
    head: LossHead,
    inputs: dict,
    step: StepCounts | None,
    context: RunContext,
    *,
    return_outputs: bool = False,
) -> tuple[torch.Tensor, Any]:
    """
    The exact loss of one micro-batch (S / C of the step in training, `step` given; S / C of the batch in evaluation,
    added to the evaluation totals) and, when `return_outputs`, the model's outputs (None where a DataParallel
    forward gathered none: evaluation without predictions).

    Args:
        exact (`ExactLoss`): the run's loss state (head cache, check, counts, totals).
        model (`nn.Module`): what to call: the model, or its DDP / DataParallel wrapper.
        head (`LossHead`): `exact.head(owner)`.
        inputs (`dict`): the batch, with its labels (the caller's dict is not changed).
        step (`StepCounts`, *optional*): the counts of the whole optimizer step (`exact.count_step`); None in
            evaluation.
        context (`RunContext`): what stays the same over the run.
        return_outputs (`bool`, *optional*): return the outputs too.
    """
    if head.batch_coupled:
        # Each row's loss depends on the others of the batch: computed on the whole step's embeddings.
        return contrastive_loss(exact, model, head, inputs, step, context, return_outputs)
    owner = model if context.owner is None else context.owner
    given, step = step, exact.current_counts(step)  # recounted where the check changed the head
    candidates = exact.pending_check(head, owner, inputs)
    own = head.route is Route.MODEL_LOSS
    if "skip_logits" in inputs and (candidates is not None or not own):
        # Stock asks a Liger forward for no logits in evaluation without predictions (`skip_logits=True`); the check
        # compares the logits, and a recomputed loss is made of them.
        inputs = {key: value for key, value in inputs.items() if key != "skip_logits"}
    inputs, labels = split_labels(head, inputs, model, candidates is None and not own, exact.unwrap)
    user_loss = head.route is Route.USER_LOSS and context.loss_func is not None
    total = user_loss_total(head, labels, step, inputs, context.main_input_name) if user_loss else None
    data_parallel = is_data_parallel(model)
    keep = return_outputs and (exact.outputs_wanted or not data_parallel)
    # Which decoder inputs the model builds itself; what it passes to its own loss function (CTC's logit lengths).
    watching_call = watching_loss_call(head, model, exact.unwrap, checked=candidates is not None)
    with exact.watching_decoder(candidates, model, inputs), watching_call as loss_call:
        run = _Forward(exact, head, step, context, total, keep=keep, drop_cache=data_parallel, loss_call=loss_call)
        if candidates is not None:
            # The first forward of the head: checked against the model's own loss, in a piece of its own.
            run = CheckedForward(run, candidates, can_use_model_loss(head, exact.unwrap(owner)))
        if not data_parallel:
            terms, outputs = run(model, inputs, labels)
        else:
            terms, outputs = _in_replicas(exact, model, run, inputs, labels, context.autocast_dtype, keep)
    if candidates is not None and terms.check is None:
        candidates = None  # no replica ran the check (`_ReplicasReport`): it stays pending
    if candidates is not None:
        head, terms = exact.settle(candidates, owner, terms, given)
        step = exact.current_counts(given)
    if head is None:
        # The model's own loss (per replica: their mean, as stock's), a per-micro-batch mean as the stock loss of the
        # following steps; the step was counted as exact, so divide by its micro-batches here.
        loss = terms.check.model_loss.mean() / (step.micro_batches if step is not None else 1)
    else:
        loss = exact.reduce(head, terms, step)
    return loss, outputs


def _in_replicas(exact, wrapper: nn.DataParallel, run, inputs: dict, labels: dict, autocast_dtype, keep: bool):
    """`run` in every replica of `wrapper` (`run_in_replicas`): its `Terms` and the outputs it keeps."""
    if not gathers_as_torch(wrapper):
        # A forward of its own splits the batch as it likes: only the tensors of the batch go in, as under stock.
        report = _ReplicasReport(exact, run, inputs, labels, keep)
        return run_in_replicas(wrapper, run, inputs, labels, autocast_dtype, report)
    if not keep and "use_cache" not in inputs and takes_use_cache(wrapper.module):
        inputs = {**inputs, "use_cache": False}  # nothing reads a cache of a forward whose outputs are dropped
    return run_in_replicas(wrapper, run, inputs, labels, autocast_dtype)


class _ReplicasReport(Reporting):
    """
    How the replicas of a DataParallel wrapper with a forward of its own (a subclass that splits and gathers as it
    likes) send their `Terms`: to hf_parallel directly, past the wrapper's gather, which may not keep a NamedTuple's
    type. The wrapper gathers only what it gathers under stock: the model's outputs where they are kept (and from
    there they are taken, in the wrapper's order), an empty dict otherwise. A forward that never calls its `module`
    returns the model's outputs on the whole batch, given its labels: the terms are computed from them, where they
    were gathered (exact, at the cost of the whole batch's outputs there), warned once.
    """

    def __init__(self, exact, run, inputs: dict, labels: dict, keep: bool):
        super().__init__()
        self.exact, self.run, self.inputs, self.labels, self.keep = exact, run, inputs, labels, keep

    def kept(self, result: tuple[Terms, Any]) -> Terms:
        return result[0]

    def shown(self, result: tuple[Terms, Any]) -> Any:
        return result[1] if result[1] is not None else {}

    def merged(self, gathered: Terms | None, returned: Any) -> tuple[Terms, Any]:
        if gathered is not None:
            return gathered, (returned if self.keep else None)
        checked = isinstance(self.run, CheckedForward)
        self.exact.warn_once(
            "exact_loss: the forward of the DataParallel wrapper does not call its `module`, so its replicas cannot "
            "compute their own loss terms; the loss is computed from the outputs the wrapper gathered (exact, but the "
            "whole batch's logits are gathered on the first device)."
            + (" The model's own loss is not checked against the head." if checked else "")
        )
        plain = self.run.plain if checked else self.run
        return plain(_Returned(returned), self.inputs, self.labels)


class _Returned:
    """Stands for a model already called: returns `outputs` whatever it is given."""

    def __init__(self, outputs: Any):
        self.outputs = outputs

    def __call__(self, **inputs: Any) -> Any:
        return self.outputs


class _Forward:
    """
    One plain forward of the head's route and its `Terms`, run where the outputs are: in the caller, or in each
    DataParallel replica on its rows (`ReplicaStep` calls it with the replica's model and chunks). The first forward of
    a head is this one wrapped in `hf_parallel.exact.checked.CheckedForward`.

    Args:
        exact (`ExactLoss`): the run's loss state.
        head (`LossHead`): the head; its route says what the model is given.
        step (`StepCounts`, *optional*): the step's counts (None in evaluation).
        context (`RunContext`): what stays the same over the run.
        total (`torch.Tensor`, *optional*): the count a user loss divides by; None without a user loss.
        keep (`bool`, *optional*): return the model's outputs (without their cache where `drop_cache`).
        drop_cache (`bool`, *optional*): drop the outputs' cache (a DataParallel gather would carry it).
        loss_call (`LossCallWatch`, *optional*): the watch on the model's loss call, for a head that declares one.
    """

    def __init__(
        self, exact, head, step, context: RunContext, total=None, *, keep=False, drop_cache=False, loss_call=None
    ):
        self.exact, self.head, self.step, self.context, self.total = exact, head, step, context, total
        self.loss_func = context.loss_func if total is not None else None
        self.keep, self.drop_cache, self.loss_call = keep, drop_cache, loss_call

    def __call__(self, run, inputs: dict, labels: dict):
        outputs, labels, count = self.forward(run, inputs, labels)
        return self.terms(outputs, labels, inputs, count), self.kept(outputs)

    def forward(self, run, inputs: dict, labels: dict, count=None, with_labels: bool = False):
        """
        The model's outputs, the labels with what its loss call passed (`LOSS_CALL_KEY`), and the count it was given.
        The model gets its labels where the route keeps them in (or `with_labels`), and as `num_items_in_batch` the
        step's count C where its own loss is the head's (S / C of the step in training, S in evaluation), else `count`.
        """
        head = self.head
        targets = model_labels(labels)
        if head.route is Route.MODEL_LOSS:
            count = self.step.total().to(batch_device(targets, inputs)) if self.step is not None else 1
        extra = targets if with_labels or head.route in (Route.MODEL_LOSS, Route.LABELS_IN_FORWARD) else {}
        if count is not None:
            extra = {**extra, "num_items_in_batch": count}
        outputs = run(**inputs, **extra)
        if self.loss_call is not None:
            seen = self.loss_call.take()
            if not seen and head.loss_call.inferred is not None:
                # A model that computes its loss inline passes nothing: its arguments as it computes them.
                seen = head.loss_call.inferred(getattr(run, "module", run), inputs)
            labels = {**labels, LOSS_CALL_KEY: seen}
        return outputs, labels, count

    def from_model_loss(self, outputs, count) -> bool:
        """Whether the terms are read off the model's own loss: its route, or fused outputs (no logits) and a count."""
        return self.head.route is Route.MODEL_LOSS or (count is not None and fused_outputs(outputs))

    def terms(self, outputs, labels: dict, inputs: dict, count=None, without_grad: bool = False) -> Terms:
        """The forward's `Terms`: read off the model's own loss (`from_model_loss`), or the head's sums from the
        outputs (or the user loss), computed `without_grad` where only compared (a checked forward)."""
        head, exact = self.head, self.exact
        if self.from_model_loss(outputs, count):
            seq_len = sequence_length(inputs, self.context.main_input_name)
            return model_terms(head, outputs, labels, seq_len, count)
        here = self.total.to(outputs_device(outputs, labels)) if torch.is_tensor(self.total) else self.total
        router = router_terms(head, outputs, labels, inputs, exact.evaluating)
        with torch.no_grad() if without_grad else contextlib.nullcontext():
            terms = forward_terms(head, outputs, labels, inputs, exact.evaluating, self.loss_func, here)
        return terms._replace(router=router)

    def kept(self, outputs):
        """The outputs to return: None unless kept, without their cache where it must not travel."""
        if not self.keep:
            return None
        return without_cache(outputs) if self.drop_cache else outputs
