"""
The counts of the exact loss: the item counts of one optimizer step (`StepCounts`), the running sums and counts of
an evaluation set (`EvalTotals`), and the sequence length of a batch its heads count with (`sequence_length`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .heads import LossHead

__all__ = ["EvalTotals", "StepCounts", "sequence_length"]


@dataclass(frozen=True)
class StepCounts:
    """
    The item counts of one whole optimizer step (all micro-batches, all ranks), per loss term.

    The Trainer hands it to `compute_loss` as `num_items_in_batch`; its type tells an exact step from a stock one.
    `scale` is the factor that undoes DDP's gradient averaging (the number of processes; 1 without DDP);
    `micro_batches` the micro-batches of this rank's step (a stock loss the check falls back to is divided by them).
    """

    counts: torch.Tensor
    scale: int = 1
    micro_batches: int = 1

    def total(self) -> torch.Tensor:
        return self.counts.sum()

    @staticmethod
    def as_stock(num_items_in_batch: Any) -> Any:
        """What the stock Trainer expects as `num_items_in_batch`: the total item count of the step."""
        return num_items_in_batch.total() if isinstance(num_items_in_batch, StepCounts) else num_items_in_batch


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

    def value(self) -> float | None:
        if self.sums is None:
            return None
        value = self.head.combine(self.sums, self.counts)
        if self.router is not None and self.head.router is not None:
            value = value + self.head.router.loss(self.router)  # the router term of the whole set, as one forward
        return value.item()


def sequence_length(batch: dict, main_input_name: str = "input_ids") -> int | None:
    """The sequence length of a batch, from its main input (or attention mask); None for inputs without one."""
    main = batch.get(main_input_name, batch.get("attention_mask"))
    return main.shape[1] if torch.is_tensor(main) and main.dim() > 1 else None
