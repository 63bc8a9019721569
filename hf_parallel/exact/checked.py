"""
The first forward of a model's head, checked against the model's own loss: a piece that wraps the plain forward of
`hf_parallel.exact.step`, so that no other forward carries the check.

It runs the plain forward with the labels kept in the model's inputs, and, where the model's own loss could be the
exact one (`can_use_model_loss`), gives it a probe count N = 2C + 1/2 as `num_items_in_batch` (no count of items, and
twice C, so that a loss divided by it, S / N, and one that keeps its own mean, S / C, differ by a factor of 2 at any C
and precision; an offset of 1/2 alone moved S / N by 1 / (2C), below a float32 loss's tolerance from 5,000 items on).
Then every candidate head's terms are compared with the model's loss on the same rows (`replica_check`); in a
DataParallel replica, for its rows. Where the gradient can come from the model's own loss (`takes_gradient_from_loss`),
the candidates are computed without autograd, only to compare. `hf_parallel.exact.check` decides from the verdicts of
every replica and rank.
"""

from __future__ import annotations

import torch

from .compare import probe_count, replica_check, takes_gradient_from_loss
from .heads import HeadMismatch, LossHead, Route
from .heads.base import sequence_length
from .terms import Terms, batch_device

__all__ = ["CheckedForward"]


class CheckedForward:
    """
    The checked first forward: `plain` (a plain forward, `hf_parallel.exact.step`) run with the labels in, and the
    `candidates` compared with the model's own loss.

    Args:
        plain: the plain forward of the head (its `forward`, `terms` and `kept`).
        candidates (`tuple[LossHead, ...]`): the heads to compare, the chosen one first.
        probe (`bool`): give the model a probe count (`can_use_model_loss`).
    """

    def __init__(self, plain, candidates: tuple[LossHead, ...], probe: bool):
        self.plain, self.candidates, self.probe = plain, candidates, probe

    def __call__(self, run, inputs: dict, labels: dict):
        plain, candidates = self.plain, self.candidates
        head, jury = plain.head, plain.exact.check  # the votes and verdict of the check (`ModelLossCheck`)
        probe = None  # the count given where the model's loss may divide by it (its own route gives the step's)
        if self.probe and head.route is not Route.MODEL_LOSS:
            targets = plain.targets(labels)
            items = head.count(targets, sequence_length(inputs, plain.context.main_input_name)).sum()
            probe = probe_count(items.to(batch_device(targets, inputs))).requires_grad_(torch.is_grad_enabled())
        outputs, labels, count = plain.forward(run, inputs, labels, count=probe, with_labels=True)
        # The gradient from the model's own loss, where the head's is recomputed (not read off the model's loss).
        from_loss = (
            not plain.from_model_loss(outputs, count)
            and plain.loss_func is None
            and takes_gradient_from_loss(head, outputs)
        )
        try:
            terms = plain.terms(outputs, labels, inputs, count, without_grad=from_loss)
        except HeadMismatch:
            terms = Terms()  # the check rules the head out (`replica_check`)

        # What the forward says of the candidates (`replica_check`; in a DataParallel replica: for its rows), `terms`
        # holding the first candidate's; the others computed without autograd `from_loss`.
        def terms_of(candidate: LossHead) -> tuple[torch.Tensor, torch.Tensor]:
            return plain.sample_terms(candidate, outputs, labels, inputs)

        known = {candidates[0]: (terms.sums, terms.counts)} if terms.sums is not None else {}
        # The model's loss adds its router term on these rows: so does every candidate's.
        router = candidates[0].router.loss(terms.router.detach().sum(0)) if terms.router is not None else None
        vote = jury.decoder_vote(labels)
        check = replica_check(candidates, outputs, terms_of, known, probe, from_loss, vote, jury.note_mismatch, router)
        return terms._replace(check=check), plain.kept(outputs)
