"""
The loss of an evaluation set, as one device computes it on the whole set: S and C of every batch of every rank added
up (`EvalTotals`), each sample once (the rows a sampler repeats to fill the last batch left out), divided once at the
end. `Evaluation` is a run's: `start`, then `add` (or `add_loss` for a loss over a batch's rows) per batch from the one
step (`hf_parallel.exact.step.reduce`), then `finish`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .engine import Engine
from .heads import LossHead, Route
from .terms import Terms

__all__ = ["EvalTotals", "Evaluation"]


class Evaluation:
    """
    The evaluation of one run: its totals while one is under way (`running`), whether the model's outputs are wanted
    besides the loss, and how a batch's per-row terms are gathered from every rank.

    Args:
        gather_rows (`Callable`, *optional*): gathers per-row tensors from all ranks, dropping the rows a distributed
            sampler duplicated (accelerate's `gather_for_metrics`); identity when not given.
        gather_embeddings (`Callable`, *optional*): the same for a contrastive model's per-row embeddings (a tuple);
            when not given, every rank's rows are gathered as they are (the caller cut the padding rows).
    """

    def __init__(self, gather_rows: Callable[[Any], Any] | None = None, gather_embeddings=None):
        self.gather_rows = gather_rows or (lambda rows: rows)
        self.gather_embeddings = gather_embeddings
        self.totals: EvalTotals | None = None
        #: Whether an evaluation is adding up its totals (between `start` and `finish`).
        self.running = False
        #: Whether the model's outputs are wanted besides the loss (False in evaluation with prediction_loss_only).
        self.outputs_wanted = True

    def start(self, enabled: bool = True, keep_outputs: bool = True) -> None:
        """Start adding up S and C of every evaluation batch (`enabled`: the exact loss is on); `keep_outputs=False`
        when only the loss is wanted."""
        self.totals = EvalTotals() if enabled else None
        self.running = self.totals is not None
        self.outputs_wanted = keep_outputs

    def finish(self, engine: Engine) -> float | None:
        """Stop adding up; the exact evaluation loss, or None when no batch was computed exactly."""
        totals, self.totals = self.totals, None
        self.running, self.outputs_wanted = False, True
        if totals is not None and engine.data_replicas > 1:
            totals.add_over(engine.add_counts)  # each rank's own rows (see `add`), each batch's once
        return totals.value() if totals is not None else None

    def add(self, head: LossHead, terms: Terms, engine: Engine) -> torch.Tensor:
        """Add one evaluation forward's S and C (every replica's gathered) to the totals of the set; this batch's S /
        C (and router term), as the loss of the batch."""
        row_sums, row_counts = terms.sums, terms.counts
        if self.totals is not None:
            if head.route in (Route.MODEL_LOSS, Route.TRAINER_LOSS):
                # One S and C per forward, duplicates masked before it (the caller marks them): added over ranks.
                router = None
                if terms.router is not None and head.route is Route.TRAINER_LOSS:  # a subclass's held back (TRL's)
                    router = engine.add_counts(terms.router.detach().double().sum(0, keepdim=True))
                self.totals.add(head, *sum_over_ranks(row_sums.detach().sum(0), row_counts.sum(0), engine), router)
            elif engine.data_replicas > 1:
                # The ranks of a tensor-parallel group hold the same rows: gathering them would keep each several
                # times, and cut an epoch's last batch by rows; each rank adds its own, padding rows masked before
                # (the caller marks them), added over ranks once at the end (`finish`). `EvalTotals.add` detaches.
                self.totals.add(head, row_sums, row_counts, terms.router)
            elif terms.router is None:
                # Per-row terms, so that gathering drops the rows a distributed sampler duplicated.
                self.totals.add(head, *self.gather_rows((row_sums.detach(), row_counts)))
            else:
                sums, counts, router = self.gather_rows((row_sums.detach(), row_counts, terms.router.detach()))
                self.totals.add(head, sums, counts, router)
        loss = head.combine(row_sums.sum(0), row_counts.sum(0))
        return loss if terms.router is None else loss + head.router.loss(terms.router.sum(0))

    def add_loss(self, head: LossHead, loss: torch.Tensor) -> None:
        """Add the loss of one whole evaluation batch over every device (a loss over a batch's rows, not a sum over
        them: `hf_parallel.exact.coupled`) to the totals, whose value is then the mean over batches."""
        if self.totals is not None:
            self.totals.add(head, loss.detach().reshape(1, 1), torch.ones(1, 1, dtype=torch.long))


def sum_over_ranks(sums: torch.Tensor, counts: torch.Tensor, engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """`[1, terms]` sums and counts, each added over the engine's ranks (one collective)."""
    if engine.count_ranks <= 1:
        return sums.reshape(1, -1), counts.reshape(1, -1)
    both = engine.add_counts(torch.cat([sums.double(), counts.to(sums.device).double()]))
    terms = sums.numel()
    return both[:terms].reshape(1, -1), both[terms:].round().long().reshape(1, -1)


class EvalTotals:
    """
    Running sums of per-row loss sums and item counts over an evaluation set, and of a MoE model's router statistics;
    `value()` divides once.
    """

    def __init__(self):
        self.head: LossHead | None = None
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.router: torch.Tensor | None = None

    def add(
        self, head: LossHead, row_sums: torch.Tensor, row_counts: torch.Tensor, router: torch.Tensor | None = None
    ) -> None:
        """Add the rows of one batch (already gathered from all ranks, duplicates dropped)."""
        self.head = head
        sums, counts = row_sums.detach().double().sum(0), row_counts.detach().sum(0)
        if self.sums is None:
            self.sums, self.counts = sums, counts
        else:
            self.sums, self.counts = self.sums + sums.to(self.sums.device), self.counts + counts.to(self.counts.device)
        if router is not None:
            router = router.detach().double().sum(0)
            self.router = router if self.router is None else self.router + router.to(self.router.device)

    def add_over(self, add: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each total by `add(total)` (a collective: added over ranks, which all evaluated as many batches)."""
        if self.sums is None:
            return
        self.sums, self.counts = add(self.sums), add(self.counts)
        if self.router is not None:
            self.router = add(self.router)

    def value(self) -> float | None:
        if self.sums is None:
            return None
        value = self.head.combine(self.sums, self.counts)
        if self.router is not None and self.head.router is not None:
            value = value + self.head.router.loss(self.router)  # the router term of the whole set, as one forward
        return value.item()
