"""
`ExactLoss`: the exact loss of a training run, apart from the Trainer that calls it.

For one optimizer step made of micro-batches m on devices d, the loss to back-propagate is S_md / C, where S_md is
the micro-batch's loss **sum** and C the item **count** of the whole step (all micro-batches, all ranks), counted
before the step runs; under DDP each rank scales it by the world size, since DDP averages gradients. Evaluation adds
S and C up over the whole set and divides once. `ExactLoss` owns the choice of head (cached per model, with one
warning per reason when it falls back to the stock loss), the step counts, the loss and the evaluation totals.
Its check of the head against the model's own loss is `SelfCheck`'s (`hf_parallel.exact.selfcheck`).

```python
from hf_parallel.exact import ExactLoss

exact = ExactLoss(label_names=["labels"])
head = exact.head(model, batches[0])
step = exact.count_step(head, batches)  # C of the whole step
for batch in batches:
    inputs, labels = exact.split_labels(head, batch, model)
    exact.loss(head, model(**inputs), labels, step, inputs).backward()  # S_m / C
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from .counts import EvalTotals, StepCounts, sequence_length
from .decoder import decoder_input_ids, needs_decoder_inputs
from .fallback import FALLBACK_NOTE
from .heads import CrossEntropyHead, LossHead
from .remainder import (
    REAL_ROWS_KEY,
    EpochEnd,
    first_rows,
    mask_padding,
    packed_sample_ids,
    real_rows,
    row_mask,
    samples_in,
)
from .resolve import ProblemTypeUnsettled, UnsupportedHead, resolve_head
from .selfcheck import SelfCheck

__all__ = ["EvalTotals", "ExactLoss", "StepCounts", "sequence_length"]

# The cross-entropy targets a padding row is masked in.
_TARGET_KEYS = ("labels", "shift_labels")

logger = logging.get_logger("hf_parallel.trainer")


class ExactLoss(SelfCheck):
    """
    The exact loss of one Trainer: head choice, step counts, the loss, evaluation totals.

    Args:
        enabled (`bool`, *optional*, defaults to `True`): `TrainingArguments.exact_loss`.
        label_names (`list[str]`, *optional*): the Trainer's label names.
        label_smoothing (`float`, *optional*, defaults to 0): `TrainingArguments.label_smoothing_factor`.
        num_processes (`int`, *optional*, defaults to 1): DDP ranks; the loss is scaled by it.
        reduce_sum (`Callable`, *optional*): sums a tensor over ranks (needed when `num_processes > 1`).
        gather_rows (`Callable`, *optional*): gathers per-row tensors from all ranks for evaluation, dropping the
            rows a distributed sampler duplicated (accelerate's `gather_for_metrics`); identity when not given.
        unwrap (`Callable`, *optional*): takes a model out of its wrappers before its head is resolved; run only
            when the head of that model is not cached yet.
        fallback (`str`, *optional*): what a fallback warning says happens instead (the Trainer's stock loss when
            `None`).
    """

    def __init__(
        self,
        enabled: bool = True,
        label_names: list[str] | None = None,
        label_smoothing: float = 0.0,
        num_processes: int = 1,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        gather_rows: Callable[[Any], Any] | None = None,
        unwrap: Callable[[nn.Module], nn.Module] | None = None,
        fallback: str | None = None,
    ):
        if num_processes > 1 and reduce_sum is None:
            raise ValueError(f"ExactLoss over {num_processes} processes needs reduce_sum to count the whole step.")
        self.enabled = enabled
        self.label_names = label_names
        self.label_smoothing = label_smoothing
        self.num_processes = num_processes
        self.reduce_sum = reduce_sum
        self.gather_rows = gather_rows or (lambda rows: rows)
        self.unwrap = unwrap or (lambda model: model)
        self.fallback = fallback or (
            "The loss is left to the Trainer: the stock transformers loss, or a subclass's own. " + FALLBACK_NOTE
        )
        self._heads: dict[tuple, tuple[nn.Module, LossHead | None]] = {}
        # Per cached head: how many forwards checked it against the model's own loss so far; -1 once decided.
        self._checks: dict[tuple, int] = {}
        # While a checked forward runs: what the model's decoder receives (see `SelfCheck.watching_decoder`).
        self._decoder_watch = None
        # The last step's counts and micro-batches (the check may change the head, then the count).
        self._counted: tuple[StepCounts, list[dict], torch.device | None, str] | None = None
        self._warned: set[str] = set()
        self._eval_totals: EvalTotals | None = None
        #: Whether the model's outputs are wanted besides the loss (False in evaluation with prediction_loss_only).
        self.outputs_wanted = True

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
        key = self._key(model, loss_func)
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
        self._heads[self._key(model, loss_func)] = (model, head)  # problem_type may be settled now
        return head

    @property
    def checks_settled(self) -> bool:
        """
        Whether the check against the model's own loss (`SelfCheck`) is decided for every head chosen so far, so that
        no later forward carries it (a checked forward keeps the labels in the model's inputs: its backward holds
        several logits-sized buffers per replica where a plain one holds one). True before any head is chosen and for
        heads that need no check (the stock loss, a `compute_loss_func`'s head: `_key(...)[2]`).
        """
        return all(head is None or key[2] or self._checks.get(key, 0) < 0 for key, (_, head) in self._heads.items())

    @staticmethod
    def _key(model: nn.Module, loss_func: Callable | None) -> tuple:
        # Asked twice a micro-batch, keyed on what can change: the model (model_init), a classifier's problem_type.
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
            return CrossEntropyHead(name="compute_loss_func", shift=loss_func_shifts)

    def warn_fallback(self, reason: str) -> None:
        """Warn once per reason that the stock loss is used, and what of stock's multi-device error is removed."""
        self.warn_once(f"exact_loss: {reason} {self.fallback}")

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)

    def usable(self, head: LossHead | None, batches: list[dict]) -> bool:
        """Whether `head` applies to every batch; warns once when a batch lacks its labels."""
        if head is None:
            return False
        if all(head.has_labels(batch) for batch in batches):
            return True
        self.warn_fallback(f"a training batch lacks the label keys {list(head.label_keys)}.")
        return False

    # ---- Training: count the step, then each micro-batch's S / C ----
    def count_step(
        self, head: LossHead, batches: list[dict], device: torch.device | None = None, main_input_name="input_ids"
    ) -> StepCounts:
        """The item counts of a whole optimizer step (all `batches` of this rank, summed over ranks)."""
        counts = sum(self._count(head, batch, main_input_name).to(device) for batch in batches)
        if self.num_processes == 1:
            step = StepCounts(counts, 1)
        else:
            # C must be the count of the whole step on every rank; and DDP averages gradients over ranks, so each
            # rank scales its S / C by the world size (the sum over ranks of S_r / C is the exact loss).
            step = StepCounts(self.reduce_sum(counts), self.num_processes)
        self._counted = (step, batches, device, main_input_name)
        return step

    def mark_padding(
        self, head: LossHead, batches: list[dict], end: EpochEnd | None, process_index: int, pads: bool
    ) -> None:
        """
        Mark the padding rows of an epoch's last batch (see `hf_parallel.exact.remainder`), so that they are left out
        of the counts and sums.

        Args:
            head (`LossHead`): the step's head.
            batches (`list[dict]`): this rank's micro-batches of the step; only the last can hold padding.
            end (`EpochEnd`, *optional*): set when the last batch ends the epoch.
            process_index (`int`): this rank.
            pads (`bool`): whether the dataloader pads its last global batch (accelerate's `even_batches`, without
                `dataloader_drop_last`).
        """
        if end is None or not (pads or end.counted) or self.num_processes == 1 or not batches:
            return
        if end.remainder < 0:
            self.warn_once(
                "exact_loss: the training set is iterable, each rank reads it itself (dispatch_batches=False) and "
                "its samples could not be counted, so the rows accelerate repeats to fill the last step of an epoch "
                "cannot be told apart; that step trains on them, as stock does. Set dataloader_num_workers=0 or let "
                "rank 0 dispatch the batches."
            )
            return
        last = batches[-1]
        samples = samples_in(last, head.label_keys[0], self._sample_ids(head, last))
        real = real_rows(samples, end.remainder, process_index)
        if real is not None and real < samples:
            last[REAL_ROWS_KEY] = real

    @staticmethod
    def _sample_ids(head: LossHead, batch: dict) -> torch.Tensor | None:
        # Only per-position heads are packed (several sequences in one row).
        return packed_sample_ids(batch) if getattr(head, "per_position", False) else None

    @staticmethod
    def _count(head: LossHead, batch: dict, main_input_name: str) -> torch.Tensor:
        seq_len = sequence_length(batch, main_input_name)
        real = batch.get(REAL_ROWS_KEY)
        if real is None:
            return head.count(batch, seq_len)
        # The last batch of an epoch under DDP: only its leading samples are real, the rest is padding.
        sample_ids = ExactLoss._sample_ids(head, batch)
        if isinstance(head, CrossEntropyHead):
            # What the forward will see: the padding's targets ignored (`split_labels`), so that a model given its
            # labels counts as this does.
            return head.count(mask_padding(batch, _TARGET_KEYS, real, sample_ids), seq_len)
        return head.count(first_rows(batch, (*head.label_keys, "shift_labels"), real), seq_len)

    def split_labels(
        self, head: LossHead, inputs: dict, model: nn.Module, build_decoder_inputs: bool = True
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        """
        A copy of `inputs` without the labels, and the labels; decoder inputs built when the model (unwrapped with
        `unwrap`, only then) needs them, unless `build_decoder_inputs=False` (a forward that keeps the labels, where
        the model builds its own).
        """
        inputs = dict(inputs)  # the caller's dict keeps its labels
        labels = head.pop_labels(inputs)
        if REAL_ROWS_KEY in inputs:
            real = labels[REAL_ROWS_KEY] = inputs.pop(REAL_ROWS_KEY)
            if isinstance(head, CrossEntropyHead):
                # Padding rows ignored in the targets themselves: also for a model that gets its labels.
                labels = mask_padding(labels, _TARGET_KEYS, real, self._sample_ids(head, inputs))
        if build_decoder_inputs and needs_decoder_inputs(head, inputs):
            # The model builds decoder inputs from the labels it no longer receives.
            inputs["decoder_input_ids"] = decoder_input_ids(self.unwrap(model), labels["labels"])
        return inputs, labels

    def loss(
        self,
        head: LossHead,
        outputs,
        labels: dict[str, torch.Tensor],
        step: StepCounts | None,
        inputs: dict,
        *,
        loss_func: Callable | None = None,
        main_input_name: str = "input_ids",
    ) -> torch.Tensor:
        """
        The loss of one micro-batch on one device: S / C of the step in training (`step` given), S / C of the batch
        otherwise (evaluation, where S and C are also added to the totals). `terms` then `reduce`, in one place.
        """
        total = self.user_loss_total(head, labels, step, inputs, main_input_name) if loss_func is not None else None
        return self.reduce(head, self.terms(head, outputs, labels, inputs, loss_func=loss_func, total=total), step)

    def user_loss_total(
        self, head: LossHead, labels: dict, step: StepCounts | None, inputs: dict, main_input_name: str = "input_ids"
    ) -> torch.Tensor:
        """The item count a user loss (`compute_loss_func`) divides by: the step's, or the batch's in evaluation."""
        return step.total() if step is not None else head.count(labels, sequence_length(inputs, main_input_name)).sum()

    def model_terms(
        self, head: LossHead, outputs, labels: dict, seq_len: int | None, count: torch.Tensor | int
    ) -> dict[str, torch.Tensor]:
        """
        The terms of a forward whose loss is the model's own, given `count` as `num_items_in_batch` (see
        `hf_parallel.exact.forward`): `{"sums": [[S]], "counts": [[C]]}`, S = loss x count, C counted from the labels.
        """
        loss = outputs.get("loss") if isinstance(outputs, dict) else (outputs[0] if outputs else None)
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(
                f"exact_loss: the {head.name} loss is taken from the model, given its labels, but its forward "
                f"returned no loss ({type(outputs).__name__}). Return the loss when labels are given, or set "
                "exact_loss=False."
            )
        targets = {key: value for key, value in labels.items() if key != REAL_ROWS_KEY}
        sums = (loss.float() * (count.detach() if torch.is_tensor(count) else count)).reshape(1, 1)
        return {"sums": sums, "counts": head.count(targets, seq_len).to(sums.device).reshape(1, -1)}

    def terms(
        self,
        head: LossHead,
        outputs,
        labels: dict[str, torch.Tensor],
        inputs: dict,
        *,
        loss_func: Callable | None = None,
        total: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """
        What a forward contributes to the loss, computed where its outputs are (in a DataParallel replica: for its
        rows, on its device): `{"sums": [samples, terms], "counts": [samples, terms]}`, or `{"user_loss": loss}` for a
        user `loss_func`, called with `total` items. Per-sample tensors, so that replicas' terms concatenate.
        """
        if loss_func is not None:
            loss = loss_func(outputs, labels["labels"], num_items_in_batch=total)
            # [1], not 0-dim: DataParallel gathers 0-dim values into a vector, with a warning each time.
            return {"user_loss": loss.reshape(1) if loss.dim() == 0 else loss}
        sums, counts = self._sample_terms(head, outputs, labels, inputs)
        return {"sums": sums, "counts": counts}

    def reduce(self, head: LossHead, terms: dict[str, torch.Tensor], step: StepCounts | None) -> torch.Tensor:
        """
        The loss from `terms` (one forward's, or every replica's gathered): S / C of the step in training (`step`
        given), S / C of the batch otherwise, S and C then added to the evaluation totals.
        """
        if "user_loss" in terms:
            # One value per replica under DataParallel (each divided by the whole count already): their sum.
            return terms["user_loss"].sum() * (step.scale if step is not None else 1)
        row_sums, row_counts = terms["sums"], terms["counts"]
        if step is not None:
            return head.combine(row_sums.sum(0), step.counts) * step.scale
        if self._eval_totals is not None:
            if getattr(head, "uses_model_loss", False):
                # One S and C per forward, duplicates masked before it (the caller marks them): added over ranks.
                self._eval_totals.add(head, *self.sum_over_ranks(row_sums.detach().sum(0), row_counts.sum(0)))
            else:
                # Per-row terms, so that gathering drops the rows a distributed sampler duplicated.
                self._eval_totals.add(head, *self.gather_rows((row_sums.detach(), row_counts)))
        return head.combine(row_sums.sum(0), row_counts.sum(0))

    def sum_over_ranks(self, sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[1, terms]` sums and counts, each added over the DDP ranks (one collective)."""
        if self.num_processes == 1:
            return sums.reshape(1, -1), counts.reshape(1, -1)
        both = self.reduce_sum(torch.cat([sums.double(), counts.to(sums.device).double()]))
        terms = sums.numel()
        return both[:terms].reshape(1, -1), both[terms:].round().long().reshape(1, -1)

    def _sample_terms(self, head, outputs, labels, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Loss sums and item counts per sample, `[samples, terms]`: per row, or per sequence of a packed row; the
        padding samples of an epoch's last step (`REAL_ROWS_KEY`) add nothing, not to S, not to the gradient.
        """
        real = labels.pop(REAL_ROWS_KEY, None)
        sample_ids = self._sample_ids(head, inputs)
        if sample_ids is None:
            sums, counts = head.row_terms(outputs, labels)
            if real is not None:
                mask = row_mask(sums.shape[0], real, sums.device)
                sums, counts = sums * mask, counts * mask
            return sums, counts
        losses, valid = head.position_terms(outputs, labels)  # [1, positions]
        sample_ids = sample_ids.to(losses.device)
        keep = sample_ids.lt(real) if real is not None else torch.ones_like(valid[0])
        if self._eval_totals is None:
            # Training adds every sample up anyway: one row, without counting the samples (reading that count back
            # from the device would synchronise every micro-batch).
            return (losses[0] * keep).sum().reshape(1, 1), (valid[0] & keep).sum().reshape(1, 1)
        samples = int(sample_ids.max()) + 1
        sums = losses.new_zeros(samples).index_add(0, sample_ids, losses[0] * keep)
        counts = torch.zeros(samples, dtype=torch.long, device=losses.device).index_add(
            0, sample_ids, (valid[0] & keep).long()
        )
        return sums.unsqueeze(-1), counts.unsqueeze(-1)

    # ---- Evaluation: sum of S / sum of C over the whole set ----
    @property
    def evaluating(self) -> bool:
        """Whether an evaluation is adding up its totals (between `start_evaluation` and `finish_evaluation`)."""
        return self._eval_totals is not None

    def start_evaluation(self, keep_outputs: bool = True) -> None:
        """Start adding up S and C of every evaluation batch; `keep_outputs=False` when only the loss is wanted."""
        self._eval_totals = EvalTotals() if self.enabled else None
        self.outputs_wanted = keep_outputs

    def finish_evaluation(self) -> float | None:
        """Stop adding up; the exact evaluation loss, or None when no batch was computed exactly."""
        totals, self._eval_totals = self._eval_totals, None
        self.outputs_wanted = True
        return totals.value() if totals is not None else None
