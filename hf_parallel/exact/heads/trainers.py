"""
Trainer subclasses that compute their own loss (TRL's SFT, DPO and reward trainers) as head families. The subclass's
`compute_loss` stays the micro-batch's loss, with its fused LM head, its loss types and its metrics; the head says what
an item of the step is and how that loss makes the micro-batch's sum S (`Route.TRAINER_LOSS`). The step then divides
by the whole step's items, as for every head:

| trainer | an item | its loss, given `num_items_in_batch` = n | S |
|---|---|---|---|
| `SFTTrainer` (`nll`, `dft`) | a label token after the causal shift | S / n, times TRL's DDP factor f | loss x n / f |
| `DPOTrainer`, `RewardTrainer` | a preference pair (a chosen, a rejected row) | its pairs' mean | loss x pairs |

A trainer whose loss is neither keeps its own loss, warned naming why: KTO (its KL reference point is estimated on
each micro-batch), GRPO, RLOO, distillation (their own normalisations), DPO with its `sft` term (a token mean of each
micro-batch). The trainer is known by the class that defines `compute_loss` (TRL's own, not a user's override of it).
"""

from __future__ import annotations

import torch

from .base import REAL_ROWS_KEY, LossHead, Route
from .contrastive import rows_of
from .tokens import CrossEntropyHead

__all__ = ["PairMeanHead", "TokenSumHead", "trainer_loss_head"]


class TokenSumHead(CrossEntropyHead):
    """
    SFT's loss: the sum of its per-token losses (negative log-likelihood, or DFT's weighted one) over the label tokens
    after the causal shift, divided by the `num_items_in_batch` it is given and multiplied by `factor` (TRL's, under
    DDP with `average_tokens_across_devices`).
    """

    route = Route.TRAINER_LOSS

    def __init__(self, name: str, factor: int):
        super().__init__(("labels",), name, shift=True, per_position=True, shift_ambiguous=False)
        self.factor = factor

    def sums(self, loss: torch.Tensor, given: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """S of a micro-batch from the subclass's loss, given `given` as its `num_items_in_batch`."""
        return loss.float() * given.to(loss.device) / self.factor


class PairMeanHead(LossHead):
    """
    A loss that is the mean over a batch's preference pairs of a per-pair loss (DPO's loss types and their weighted
    sums, the reward model's Bradley-Terry loss with its margin and centring term). A batch holds each pair as two
    rows, the chosen ones first: `[chosen; rejected]` (`rows_per_sample` 2).
    """

    route = Route.TRAINER_LOSS
    rows_per_sample = 2

    def __init__(self, name: str):
        super().__init__(label_keys=(), name=name)

    def count(self, batch: dict, seq_len: int | None = None) -> torch.Tensor:
        """The pairs of a batch, those an epoch's last step repeated (`REAL_ROWS_KEY`) left out."""
        pairs = rows_of(batch) // self.rows_per_sample
        real = batch.get(REAL_ROWS_KEY)
        return torch.tensor([pairs if real is None else min(int(real), pairs)])

    def sums(self, loss: torch.Tensor, given: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """S of a micro-batch of `items` pairs from the subclass's loss, their mean."""
        return loss.float() * items


def _loss_types(args) -> list[str]:
    loss_type = getattr(args, "loss_type", None)
    return list(loss_type) if isinstance(loss_type, (list, tuple)) else [loss_type]


def trainer_loss_head(owner: type, args, ranks: int) -> LossHead | str | None:
    """
    The head of the loss `owner.compute_loss` computes (`owner` the class that defines it; `args` its arguments;
    `ranks` the data-parallel processes), why there is none where the trainer is known but its loss is not a sum over
    items (a sentence for the warning), or None for a class this module does not know.
    """
    if not owner.__module__.startswith("trl."):
        return None
    name = owner.__name__
    if name == "SFTTrainer":
        if _loss_types(args) not in (["nll"], ["dft"]):
            return f"its loss_type={args.loss_type!r} is not one of 'nll' and 'dft'."
        return TokenSumHead("trl_sft", ranks if args.average_tokens_across_devices else 1)
    if name == "DPOTrainer":
        if "sft" in _loss_types(args):
            return (
                "its 'sft' loss term is a mean over the chosen tokens of each micro-batch, which the other terms' "
                "per-pair means cannot be told apart from."
            )
        return PairMeanHead("trl_dpo")
    if name == "RewardTrainer":
        return PairMeanHead("trl_reward")
    reasons = {
        "KTOTrainer": "its KL reference point is estimated on each micro-batch.",
        "GRPOTrainer": "its loss is normalised by its own token counts (loss_type).",
        "RLOOTrainer": "its loss is normalised by its own token counts.",
        "DistillationTrainer": "its loss is normalised by its own token counts.",
    }
    return reasons.get(name)
