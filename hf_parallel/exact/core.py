"""
`ExactLoss`: the state of a run's exact loss, apart from the Trainer that calls it: the head of each model (cached,
with one warning per reason when it falls back to the stock loss), the check of that head against the model's own
loss (`hf_parallel.exact.check`), the run's engine, and the evaluation totals. The one step of `hf_parallel.exact.step`
(`count_step`, `micro_batch_loss`) reads and updates it.

For one optimizer step made of micro-batches m on devices d, the loss to back-propagate is S_md / C, where S_md is
the micro-batch's loss **sum** and C the item **count** of the whole step (all micro-batches, all ranks), counted
before the step runs; under DDP each rank scales it by the world size, since DDP averages gradients. Evaluation adds
S and C up over the whole set and divides once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.utils import logging

from .check import ModelLossCheck
from .coupled import CONTRASTIVE_NEGATIVES
from .engine import pick_engine
from .evaluation import Evaluation
from .heads import LossHead, Route, routed
from .heads.router import ROUTER_BALANCES
from .remainder import EpochEnd, epoch_end, padded_rows
from .resolve import ProblemTypeUnsettled, UnsupportedHead, counting_head, resolve_head

__all__ = ["ExactLoss"]


logger = logging.get_logger("hf_parallel.exact")


class ExactLoss:
    """
    The exact loss's state of one run (a Trainer's, an `ExactLoop`'s): the head of each model and the fallback
    warnings, the check of that head (`check`), the engine the steps run on (`engine`), and the evaluation
    (`evaluation`). The step itself is `hf_parallel.exact.step`'s.

    Args:
        enabled (`bool`, *optional*, defaults to `True`): `TrainingArguments.exact_loss`.
        label_names (`list[str]`, *optional*): the Trainer's label names.
        label_smoothing (`float`, *optional*, defaults to 0): `TrainingArguments.label_smoothing_factor`.
        num_processes (`int`, *optional*, defaults to 1): DDP ranks; the loss is scaled by it.
        reduce_sum (`Callable`, *optional*): sums a tensor over ranks (needed when `num_processes > 1`).
        unwrap (`Callable`, *optional*): takes a model out of its wrappers before its head is resolved; run only
            when the head of that model is not cached yet.
        fallback (`str`, *optional*): what a fallback warning says happens instead (the Trainer's: its stock loss,
            `hf_parallel.fallback`); the caller's own loss when `None`.
        contrastive_negatives (`str`, *optional*, defaults to `"step"`): under gradient accumulation, a contrastive
            loss over every row of the step (`"step"`, the cached two-pass) or over each micro-batch's
            (`"micro_batch"`, as stock); see `hf_parallel.exact.coupled`.
        router_balance (`str`, *optional*, defaults to `"step"`): under gradient accumulation, a MoE router's
            load-balancing term over the whole step (`"step"`, a first pass without gradient) or each micro-batch's,
            averaged (`"micro_batch"`); see `hf_parallel.exact.heads.router`.
        process_group (`ProcessGroup`, *optional*): the group of the `num_processes` processes, which every collective
            of a step goes through (its engine's); None for the default group.
    """

    def __init__(
        self,
        enabled: bool = True,
        label_names: list[str] | None = None,
        label_smoothing: float = 0.0,
        num_processes: int = 1,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        unwrap: Callable[[nn.Module], nn.Module] | None = None,
        fallback: str | None = None,
        contrastive_negatives: str = "step",
        router_balance: str = "step",
        process_group=None,
    ):
        if contrastive_negatives not in CONTRASTIVE_NEGATIVES:
            raise ValueError(
                f"contrastive_negatives must be one of {CONTRASTIVE_NEGATIVES}, got {contrastive_negatives!r}."
            )
        if router_balance not in ROUTER_BALANCES:
            raise ValueError(f"router_balance must be one of {ROUTER_BALANCES}, got {router_balance!r}.")
        if num_processes > 1 and reduce_sum is None:
            raise ValueError(f"ExactLoss over {num_processes} processes needs reduce_sum to count the whole step.")
        self.enabled = enabled
        self.label_names = label_names
        self.label_smoothing = label_smoothing
        self.num_processes = num_processes
        #: The engine the steps run on (`hf_parallel.exact.engine`): its ranks' counts add up, its gradient factor
        #: scales S / C. One process or DDP from `num_processes` until the caller picks the run's own.
        self.engine = pick_engine(num_processes, reduce_sum=reduce_sum, group=process_group)
        self.reduce_sum = reduce_sum
        #: The evaluation of the run: its totals, each rank's rows added up, over the ranks at the end (the caller
        #: marks the padding rows: `evaluation_padding`; `hf_parallel.exact.evaluation`).
        self.evaluation = Evaluation()
        self.unwrap = unwrap or (lambda model: model)
        self.fallback = fallback or "The loss is left to the caller: the model's own loss."
        self._heads: dict[tuple, tuple[nn.Module, LossHead | None]] = {}
        self.contrastive_negatives = contrastive_negatives
        self.router_balance = router_balance
        #: Per model key, the state of a batch-coupled loss (`hf_parallel.exact.coupled`): checked, its cache.
        self.coupled: dict[tuple, dict] = {}
        #: The check of each model's head against the model's own loss.
        self.check = ModelLossCheck(reduce_sum if num_processes > 1 else None)
        self._warned: set[str] = set()

    # ---- Which head, or the stock loss ----
    def head(
        self,
        model: nn.Module,
        batch: dict | None = None,
        *,
        blocked: str | Callable[[], str | None] | None = None,
        loss_func: Callable | None = None,
        loss_func_shifts: bool = False,
    ) -> LossHead | None:
        """
        The head to compute exactly for `model`, or None for the stock loss (warned once per reason).

        Args:
            model (`nn.Module`): the model (unwrapped with `unwrap` on a cache miss).
            batch (`dict`, *optional*): a batch, whose labels settle a classifier's problem type.
            blocked (`str` or `Callable`, *optional*): why the caller cannot use the exact loss at all (e.g. an
                overridden `compute_loss`), or a function that says it (or None), run only when the head of `model`
                is not cached yet; falls back with that reason.
            loss_func (`Callable`, *optional*): the Trainer's `compute_loss_func`: on a model without a known head
                only its item count is needed, which is the stock one.
            loss_func_shifts (`bool`, *optional*): whether that count is of shifted labels.
        """
        if not self.enabled:
            return None
        key = self.key(model, loss_func)
        cached = self._heads.get(key)
        if cached is not None and cached[0] is model:  # the model itself, not a later one reusing its id
            return cached[1]
        reason = blocked() if callable(blocked) else blocked
        try:
            head = self._resolve(self.unwrap(model), batch, reason, loss_func, loss_func_shifts)
        except ProblemTypeUnsettled:
            if batch is None:
                return None  # settled at the first batch, which carries the labels
            raise
        except UnsupportedHead as reason:
            self.warn_fallback(str(reason))
            head = None
        if head is not None and loss_func is not None:
            head = routed(head, Route.USER_LOSS)  # the head counts the items; the user's function is the loss
        self._heads[self.key(model, loss_func)] = (model, head)  # problem_type may be settled now
        return head

    @property
    def checks_settled(self) -> bool:
        """
        Whether the check against the model's own loss (`ModelLossCheck`) is decided for every head chosen so far, so
        that no later forward carries it (a checked forward keeps the labels in the model's inputs and computes the
        candidate heads too). True before any head is chosen and for heads that need no check (the stock loss, a
        `compute_loss_func`'s head: `key(...)[2]`).
        """
        return all(head is None or key[2] or self.check.decided(key) for key, (_, head) in self._heads.items())

    @staticmethod
    def key(model: nn.Module, loss_func: Callable | None = None) -> tuple:
        """What the head of `model` is cached under: the model (model_init may make another), a classifier's
        problem_type (settled at its first labels), and whether a `compute_loss_func` computes the loss."""
        return (id(model), getattr(getattr(model, "config", None), "problem_type", None), loss_func is not None)

    def _resolve(self, model, batch, blocked, loss_func, loss_func_shifts) -> LossHead:
        if blocked is not None:
            raise UnsupportedHead(blocked)
        sample_labels = batch.get("labels") if batch is not None else None
        try:
            return resolve_head(model, self.label_names, self.label_smoothing, sample_labels)
        except UnsupportedHead:
            if loss_func is None or self.label_names != ["labels"]:
                raise
            # A user loss on a model we do not know: we only need its item count, which is the stock one.
            return counting_head(loss_func_shifts)

    def warn_fallback(self, reason: str) -> None:
        """Warn once per reason that the stock loss is used, and what of stock's multi-device error is removed."""
        self.warn_once(f"exact_loss: {reason} {self.fallback}")

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)

    def labels_present(self, head: LossHead | None, batches: list[dict]) -> bool:
        """Whether `head` applies to every batch; warns once when a batch lacks its labels."""
        if head is None:
            return False
        if all(head.has_labels(batch) for batch in batches):
            return True
        self.warn_fallback(f"a training batch lacks the label keys {list(head.label_keys)}.")
        return False

    def evaluation_padding(self, head: LossHead, inputs: dict, gradient_state, pads: bool) -> int | None:
        """
        How many leading rows of the last evaluation batch under DDP are real where accelerate repeated rows to fill
        it, for every head: each rank adds up its own rows (`hf_parallel.exact.evaluation`), so the repeated ones are
        masked before the loss, as in training. A cross-entropy head that takes the model's own loss (or may, from its
        check on) adds one sum per forward: its padding targets are masked, so the recomputed rows are 0 too. None
        without DDP. A Trainer subclass's head may say where the set ends (GRPO's, whose sampler gives each prompt
        several times where accelerate counts the prompts).
        """
        if self.num_processes == 1:
            return None
        end = epoch_end(gradient_state)
        if end is not None and head.route is Route.TRAINER_LOSS:  # where the subclass's own sampler ends the set
            end = EpochEnd(head.evaluation_remainder(gradient_state.active_dataloader, end.remainder))
        return (self.padded_rows(head, [inputs], end, pads) or (None,))[0]

    def padded_rows(
        self, head: LossHead, batches: list[dict], end: EpochEnd | None, pads: bool
    ) -> tuple[int | None, ...]:
        """Per batch, its real rows where an epoch's end padded it (`hf_parallel.exact.remainder.padded_rows`), for
        this rank's share of the data: its rank in the engine's group, a tensor-parallel group sharing its batch."""
        if self.num_processes == 1:
            return ()
        data_rank = self.engine.rank // self.engine.data_replicas
        return padded_rows(head, batches, end, data_rank, pads, self.warn_once)

    def forget_head(self, model: nn.Module) -> None:
        """The stock loss for `model` from now on (a check found its loss is not the head's; the caller warns)."""
        self._heads[self.key(model)] = (model, None)

    # ---- The check of the head against the model's own loss (hf_parallel.exact.check) ----
    def pending_check(self, head: LossHead | None, model: nn.Module, padded: bool) -> tuple[LossHead, ...] | None:
        """The candidate heads the next forward (of a batch with `padded` rows or not) checks `model`'s head with, or
        None (see `ModelLossCheck.pending`)."""
        return self.check.pending(head, self.key(model, None), padded)

    def watching_decoder(self, candidates: tuple[LossHead, ...] | None, model: nn.Module, inputs: dict):
        """Around a checked forward: what the decoder of `model` (out of its wrappers) is given."""
        return self.check.watching_decoder(candidates, self.unwrap(model) if candidates else model, inputs)

    def settle(self, candidates: tuple[LossHead, ...], model: nn.Module, check) -> LossHead | None:
        """
        Decide from the gathered `check` (`ReplicaCheck`) of every replica and rank: the head to compute `model`'s loss
        with from now on, or None for the stock loss (warned once). The choice is cached for `model`.
        """
        key, name = self.key(model, None), type(self.unwrap(model)).__name__
        settled = self.check.settle(candidates, key, name, check)
        if settled.head is None:
            self._heads[key] = (model, None)
            self.warn_fallback(settled.fallback)
            return None
        if settled.warning is not None:
            self.warn_once(settled.warning)
        if settled.changed:
            self._heads[key] = (model, settled.head)
            logger.info(f"exact_loss: {name}'s {settled.why} {settled.head}; using it.")
        return settled.head
