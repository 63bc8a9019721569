"""
One micro-batch's exact loss, wherever its forward runs (one device, a DDP rank, the replicas of a DataParallel
wrapper): `micro_batch_loss`, the entry that `hf_parallel.Trainer` and `hf_parallel.ExactLoop` both call.

The forward runs by the head's route (`hf_parallel.exact.heads.Route`): the labels taken out and S recomputed from
the logits, or kept in (the model builds its decoder inputs), or the model's own loss given the step's count C
(`num_items_in_batch`), or the user's `compute_loss_func`. Under DataParallel each replica computes the terms of its
own rows (`hf_parallel.exact.replicas`); only `Terms` travel to GPU 0. The first forward of a model is checked
against the model's own loss (`hf_parallel.exact.check`): it keeps the labels in, and a per-position cross-entropy
of a model whose forward takes `num_items_in_batch` is given N = 2C + 1/2 (no count of items, and twice C, so that a
loss divided by it, S / N, and one that keeps its own mean, S / C, differ by a factor of 2 at any C and precision; an
offset of 1/2 alone moved S / N by 1 / (2C), below a float32 loss's tolerance from 5,000 items on).

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

from .compare import (
    ReplicaCheck,
    can_use_model_loss,
    fused_outputs,
    probe_count,
    replica_check,
    takes_gradient_from_loss,
)
from .coupled import contrastive_loss
from .heads import HeadMismatch, LossHead, Route
from .heads.base import LOSS_CALL_KEY, LossCallWatch
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
    sample_terms,
    sequence_length,
    split_labels,
    user_loss_total,
    watching_loss_call,
)

__all__ = ["RunContext", "check_terms", "micro_batch_loss"]


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
    check = exact.pending_check(head, owner, inputs)
    own = head.route is Route.MODEL_LOSS
    probe = check is not None and can_use_model_loss(head, exact.unwrap(owner))
    if "skip_logits" in inputs and (check is not None or not own):
        # Stock asks a Liger forward for no logits in evaluation without predictions (`skip_logits=True`); the check
        # compares the logits, and a recomputed loss is made of them.
        inputs = {key: value for key, value in inputs.items() if key != "skip_logits"}
    inputs, labels = split_labels(head, inputs, model, check is None and not own, exact.unwrap)
    user_loss = head.route is Route.USER_LOSS and context.loss_func is not None
    total = user_loss_total(head, labels, step, inputs, context.main_input_name) if user_loss else None
    run = _Forward(exact, head, context.loss_func if user_loss else None, total, step, context, check, probe)
    data_parallel = is_data_parallel(model)
    run.keep = return_outputs and (exact.outputs_wanted or not data_parallel)
    run.drop_cache = data_parallel
    # Which decoder inputs the model builds itself; what it passes to its own loss function (CTC's logit lengths).
    watching_call = watching_loss_call(head, model, exact.unwrap, checked=check is not None)
    with exact.watching_decoder(check, model, inputs), watching_call as loss_call:
        run.loss_call = loss_call
        if not data_parallel:
            terms, outputs = run(model, inputs, labels)
        else:
            terms, outputs = _in_replicas(exact, model, run, inputs, labels, context.autocast_dtype)
    if check is not None and terms.check is None:
        check = None  # no replica ran the check (`_ReplicasReport`): it stays pending
    if check is not None:
        head, terms = exact.settle(check, owner, terms, given)
        step = exact.current_counts(given)
    if head is None:
        # The model's own loss (per replica: their mean, as stock's), a per-micro-batch mean as the stock loss of the
        # following steps; the step was counted as exact, so divide by its micro-batches here.
        loss = terms.check.model_loss.mean() / (step.micro_batches if step is not None else 1)
    else:
        loss = exact.reduce(head, terms, step)
    return loss, outputs


def _in_replicas(exact, wrapper: nn.DataParallel, run: _Forward, inputs: dict, labels: dict, autocast_dtype):
    """`run` in every replica of `wrapper` (`run_in_replicas`): its `Terms` and the outputs it keeps."""
    if not gathers_as_torch(wrapper):
        # A forward of its own splits the batch as it likes: only the tensors of the batch go in, as under stock.
        return run_in_replicas(
            wrapper, run, inputs, labels, autocast_dtype, _ReplicasReport(exact, run, inputs, labels)
        )
    if not run.keep and "use_cache" not in inputs and takes_use_cache(wrapper.module):
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

    def __init__(self, exact, run: _Forward, inputs: dict, labels: dict):
        super().__init__()
        self.exact, self.run, self.inputs, self.labels = exact, run, inputs, labels

    def kept(self, result: tuple[Terms, Any]) -> Terms:
        return result[0]

    def shown(self, result: tuple[Terms, Any]) -> Any:
        return result[1] if result[1] is not None else {}

    def merged(self, gathered: Terms | None, returned: Any) -> tuple[Terms, Any]:
        if gathered is not None:
            return gathered, (returned if self.run.keep else None)
        run = self.run
        self.exact.warn_once(
            "exact_loss: the forward of the DataParallel wrapper does not call its `module`, so its replicas cannot "
            "compute their own loss terms; the loss is computed from the outputs the wrapper gathered (exact, but the "
            "whole batch's logits are gathered on the first device)."
            + (" The model's own loss is not checked against the head." if run.check is not None else "")
        )
        plain = _Forward(self.exact, run.head, run.loss_func, run.total, run.step, run.context, None, False)
        plain.keep = run.keep
        return plain(_Returned(returned), self.inputs, self.labels)


class _Returned:
    """Stands for a model already called: returns `outputs` whatever it is given."""

    def __init__(self, outputs: Any):
        self.outputs = outputs

    def __call__(self, **inputs: Any) -> Any:
        return self.outputs


class _Forward:
    """
    One forward and its `Terms`, run where the outputs are: in the caller, or in each DataParallel replica on its
    rows (`ReplicaStep` calls it with the replica's model and chunks).
    """

    def __init__(self, exact, head, loss_func, total, step, context: RunContext, check, probe: bool):
        self.exact, self.head, self.loss_func, self.total, self.step = exact, head, loss_func, total, step
        self.context, self.main_input_name, self.check, self.probe = context, context.main_input_name, check, probe
        self.own = head.route is Route.MODEL_LOSS
        self.keep = False
        self.drop_cache = False
        self.loss_call: LossCallWatch | None = None
        # The model gets the labels for the check, for its own loss, and where it builds its decoder inputs itself.
        self.with_labels = check is not None or head.route in (Route.MODEL_LOSS, Route.LABELS_IN_FORWARD)

    def __call__(self, run, inputs: dict, labels: dict):
        exact, head = self.exact, self.head
        targets = model_labels(labels)
        seq_len = sequence_length(inputs, self.main_input_name)
        device = batch_device(targets, inputs)
        count = None
        if self.own:
            # S / C of the step in training; S itself in evaluation.
            count = self.step.total().to(device) if self.step is not None else 1
        elif self.probe:
            items = head.count(targets, seq_len).sum().to(device)
            count = probe_count(items).requires_grad_(torch.is_grad_enabled())
        extra = targets if self.with_labels else {}
        if count is not None:
            extra = {**extra, "num_items_in_batch": count}
        outputs = run(**inputs, **extra)
        if self.loss_call is not None:
            seen = self.loss_call.take()
            if not seen and head.loss_call.inferred is not None:
                # A model that computes its loss inline passes nothing: its arguments as it computes them.
                seen = head.loss_call.inferred(getattr(run, "module", run), inputs)
            labels = {**labels, LOSS_CALL_KEY: seen}
        from_loss = False
        if self.own or (self.probe and fused_outputs(outputs)):
            terms = model_terms(head, outputs, labels, seq_len, count)
        else:
            here = self.total.to(outputs_device(outputs, labels)) if torch.is_tensor(self.total) else self.total
            # A checked forward whose gradient comes from the model's own loss computes the head only to compare.
            from_loss = self.check is not None and self.loss_func is None and takes_gradient_from_loss(head, outputs)
            try:
                router = router_terms(head, outputs, labels, inputs, exact.evaluating)
                with torch.no_grad() if from_loss else contextlib.nullcontext():
                    terms = forward_terms(head, outputs, labels, inputs, exact.evaluating, self.loss_func, here)
                terms = terms._replace(router=router)
            except HeadMismatch:
                if self.check is None:
                    raise
                terms = Terms()  # the check rules the head out (`replica_check`)
        if self.check is not None:
            given = count if self.probe else None
            check = check_terms(exact, self.check, outputs, labels, inputs, terms, given, from_loss)
            terms = terms._replace(check=check)
        if not self.keep:
            return terms, None
        return terms, (without_cache(outputs) if self.drop_cache else outputs)


def check_terms(exact, candidates, outputs, labels, inputs, terms: Terms, count=None, from_loss=False) -> ReplicaCheck:
    """
    In a checked forward (in a DataParallel replica: for its rows), what it says of `candidates` (`replica_check`),
    `terms` holding the first candidate's; the others computed without autograd `from_loss` (see
    `takes_gradient_from_loss`).
    """

    def terms_of(head: LossHead) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad() if from_loss else contextlib.nullcontext():
            return sample_terms(head, outputs, dict(labels), inputs, exact.evaluating)

    known = {candidates[0]: (terms.sums, terms.counts)} if terms.sums is not None else {}
    decoder = exact.check.decoder_vote(labels)
    # The model's loss adds its router term on these rows: so does every candidate's.
    router = candidates[0].router.loss(terms.router.detach().sum(0)) if terms.router is not None else None
    return replica_check(
        candidates, outputs, terms_of, known, count, from_loss, decoder, exact.check.note_mismatch, router
    )
