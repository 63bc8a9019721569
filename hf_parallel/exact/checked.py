"""
The check of a model's head against the model's own loss, as a stage of its own before the step is counted
(`calibrate_head`): while the check is open, one forward of the step's first micro-batch (of an evaluation batch,
before its loss) with the labels kept in the model's inputs, only compared, never back-propagated; the step is then
counted, and every micro-batch computed, with the head the check settled on. So no step is counted for a head that
changes afterwards, and no training forward carries the check.

Where the model's own loss could be the exact one (`can_use_model_loss`), the forward gives it a probe count
N = 2C + 1/2 as `num_items_in_batch` (no count of items, and twice C, so that a loss divided by it, S / N, and one that
keeps its own mean, S / C, differ by a factor of 2 at any C and precision; an offset of 1/2 alone moved S / N by
1 / (2C), below a float32 loss's tolerance from 5,000 items on). Then every candidate head's terms are compared with
the model's loss on the same rows (`replica_check`, without autograd); in a DataParallel replica, for its rows.
`hf_parallel.exact.check` decides from the verdicts of every replica and rank. The forward runs in the model's own
mode (its loss is the one the step trains on: a loss fused with the LM head returns no logits in training only),
without autograd, within a fork of the random state (the step's own forwards draw the dropout they would draw without
it) and with the model's buffers put back after it (a batch normalisation's running statistics are the step's
forwards' alone). A fused loss, with no logits to compare, runs once more given 2N, drawing the same dropout: a loss
that divides by its count halves.

```python
from hf_parallel.exact import ExactLoss, RunContext, count_step
from hf_parallel.exact.checked import calibrate_head

exact = ExactLoss()
head = calibrate_head(exact, model, exact.head(model, batches[0]), batches[0], RunContext())  # None: the stock loss
step = count_step(exact, head, batches, model=model)
```
"""

from __future__ import annotations

import torch
from torch import nn

from .compare import can_use_model_loss, fused_outputs, model_loss, probe_count, replica_check
from .heads import HeadMismatch, LossHead, Route
from .heads.base import sequence_length
from .replicas import forward_in_replicas
from .step import PlainForward, RunContext, model_labels, sample_terms, split_labels
from .terms import Terms, batch_device, watching_loss_call

__all__ = ["CheckedForward", "calibrate_head"]


def calibrate_head(
    exact, model: nn.Module, head: LossHead | None, batch: dict, context: RunContext, real: int | None = None
) -> LossHead | None:
    """
    The head to compute `model`'s loss with (`head`, or the candidate the model's own loss fits; None: the stock loss,
    warned once): while the check of `head` is open (`ModelLossCheck.pending`), decided from one checked forward of
    `batch` (its leading `real` samples real, an epoch's padding after them) on every replica and rank; `head` itself
    otherwise, at the cost of one dictionary look-up.
    """
    owner = model if context.owner is None else context.owner
    candidates = exact.pending_check(head, owner, real is not None)
    if candidates is None:
        return head
    # Stock asks a Liger forward for no logits in evaluation without predictions: the check compares the logits.
    inputs = {key: value for key, value in batch.items() if key != "skip_logits"}
    inputs, labels = split_labels(head, inputs, model, False, exact.unwrap, real)
    # Contiguous: the model's own loss views its shifted targets flat, and Ulysses' micro-batches hold strided slices.
    labels = {key: value.contiguous() if torch.is_tensor(value) else value for key, value in labels.items()}
    plain = PlainForward(exact, head, None, context, real=real)
    run = CheckedForward(plain, candidates, can_use_model_loss(head, exact.unwrap(owner)))
    watch = watching_loss_call(head, model, exact.unwrap, checked=True)
    buffers = [(buffer, buffer.clone()) for buffer in exact.unwrap(owner).buffers()]
    forked = torch.random.fork_rng(devices=_devices(model, batch_device(labels, inputs)))
    with forked, torch.no_grad(), exact.watching_decoder(candidates, model, inputs), watch as call:
        plain.loss_call = call
        if exact.engine.replicas:
            terms, _ = forward_in_replicas(exact, model, run, inputs, labels, context.autocast_dtype, False)
        else:
            terms, _ = run(model, inputs, labels)
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return exact.settle(candidates, owner, terms.check)


def _devices(model: nn.Module, device: torch.device) -> list[int]:
    """The CUDA devices whose random state a forward of `model` on `device` draws from: every replica's under
    DataParallel."""
    return (getattr(model, "device_ids", None) or [device.index or 0]) if device.type == "cuda" else []


class CheckedForward:
    """
    The checked forward: `plain` (a plain forward, `hf_parallel.exact.step`) run with the labels in, and the
    `candidates` compared with the model's own loss; returns `Terms` holding the `check` alone.

    Args:
        plain: the plain forward of the head (its `forward` and `terms`).
        candidates (`tuple[LossHead, ...]`): the heads to compare, the chosen one first.
        probe (`bool`): give the model a probe count (`can_use_model_loss`).
    """

    def __init__(self, plain, candidates: tuple[LossHead, ...], probe: bool):
        self.plain, self.candidates, self.probe = plain, candidates, probe

    def __call__(self, run, inputs: dict, labels: dict):
        plain, candidates = self.plain, self.candidates
        head, jury = plain.head, plain.exact.check  # the votes and verdict of the check (`ModelLossCheck`)
        probe = None  # the count given where the model's loss may divide by it
        if self.probe and head.route is not Route.MODEL_LOSS:
            targets = model_labels(labels)
            items = head.count(targets, sequence_length(inputs, plain.context.main_input_name)).sum()
            probe = probe_count(items.to(batch_device(targets, inputs)))
        with torch.random.fork_rng(devices=_devices(run, batch_device(labels, inputs))):  # drawn again if doubled
            outputs, labels, count = plain.forward(run, inputs, labels, count=probe, with_labels=True)
        doubled = None  # no logits to compare (a fused loss): given twice the count, a loss divided by it halves
        if probe is not None and fused_outputs(outputs):
            doubled = model_loss(plain.forward(run, inputs, labels, count=probe * 2, with_labels=True)[0])
        try:
            with torch.no_grad():
                terms = plain.terms(outputs, labels, inputs, count)
        except HeadMismatch:
            terms = Terms()  # the check rules the head out (`replica_check`)

        def terms_of(candidate: LossHead) -> tuple[torch.Tensor, torch.Tensor]:
            return sample_terms(candidate, outputs, labels, inputs, plain.real)

        known = {candidates[0]: (terms.sums, terms.counts)} if terms.sums is not None else {}
        # The model's loss adds its router term on these rows: so does every candidate's.
        router = candidates[0].router.loss(terms.router.sum(0)) if terms.router is not None else None
        vote = jury.decoder_vote(labels)
        check = replica_check(candidates, outputs, terms_of, known, probe, vote, jury.note_mismatch, router, doubled)
        return Terms(check=check), None
