"""
The loss of an evaluation set, as one device computes it on the whole set: S and C of every batch of every rank added
up (`EvalTotals`), each sample once (the rows a sampler repeats to fill the last batch left out), divided once at the
end. `Evaluation` is a run's: `start`, then `add` (or `add_loss` for a loss over a batch's rows) per batch from the one
step (`hf_parallel.exact.step.reduce`), then `finish`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .engine import Engine
from .heads import LossHead, Route
from .terms import Terms

__all__ = ["EvalTotals", "Evaluation"]


class Evaluation:
    """
    The evaluation of one run: its totals while one is under way (`running`) and whether the model's outputs are
    wanted besides the loss. Each rank adds up its own rows, the samples a sampler repeated to fill the last batch
    masked before the loss (the caller marks them: `real`), and the totals are added over the ranks once, at the end:
    the sums of the training step, kept over the whole set.
    """

    def __init__(self):
        self.totals: EvalTotals | None = None
        #: Whether the model's outputs are wanted besides the loss (False in evaluation with prediction_loss_only).
        self.outputs_wanted = True

    def start(self, enabled: bool = True, keep_outputs: bool = True) -> None:
        """Start adding up S and C of every evaluation batch (`enabled`: the exact loss is on); `keep_outputs=False`
        when only the loss is wanted."""
        self.totals = EvalTotals() if enabled else None
        self.outputs_wanted = keep_outputs

    @property
    def running(self) -> bool:
        """Whether an evaluation is adding up its totals (between `start` and `finish`)."""
        return self.totals is not None

    def finish(self, engine: Engine) -> float | None:
        """Stop adding up; the exact evaluation loss, or None when no batch was computed exactly."""
        totals, self.totals, self.outputs_wanted = self.totals, None, True
        if totals is None:
            return None
        # Each rank's own rows (see `add`), each batch's once: the ranks of a tensor-parallel group hold the same rows,
        # which `add_counts` counts once (gathering them would keep each several times).
        totals.add_over(engine.add_counts)
        return totals.value()

    def add(self, head: LossHead, terms: Terms) -> torch.Tensor:
        """Add one evaluation forward's S and C (every replica's gathered; the padding samples masked before, so
        every row is added) to this rank's totals of the set; this batch's S / C (and router term), as the loss of
        the batch."""
        if self.running:
            # The model's own loss holds its router term (a term of a subclass's own loss is held back: TRL's).
            router = None if head.route is Route.MODEL_LOSS else terms.router
            self.totals.add(head, terms.sums, terms.counts, router)
        loss = head.combine(terms.sums.sum(0), terms.counts.sum(0))
        return loss if terms.router is None else loss + head.router.loss(terms.router.sum(0))

    def add_loss(self, head: LossHead, loss: torch.Tensor) -> None:
        """Add the loss of one whole evaluation batch over every device (a loss over a batch's rows, not a sum over
        them: `hf_parallel.exact.coupled`) to the totals, whose value is then the mean over batches (every rank adds
        the same loss: added over the ranks, its sums and counts alike)."""
        if self.running:
            self.totals.add(head, loss.detach().reshape(1, 1), torch.ones(1, 1, dtype=torch.long, device=loss.device))


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
        """Add the rows of one batch (this rank's, duplicates masked)."""
        self.head = head
        self.sums = _added(self.sums, row_sums.detach().double().sum(0))
        self.counts = _added(self.counts, row_counts.detach().sum(0))
        if router is not None:
            self.router = _added(self.router, router.detach().double().sum(0))

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


def _added(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """`total + part` (on the total's device), or `part` where there is no total yet."""
    return part if total is None else total + part.to(total.device)
