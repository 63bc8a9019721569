"""
The numbers of the exact loss: what one forward contributes (`Terms`: per-sample loss sums S and item counts C, the
user's loss, a check's verdicts, a MoE router's statistics), made from its outputs and labels where the outputs are
(`sample_terms`, `model_terms`, `forward_terms`, `router_terms`); the item counts of one optimizer step
(`StepCounts`), the running sums and counts of an evaluation set (`EvalTotals`), and the sequence length of a batch
its heads count with (`sequence_length`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from accelerate.utils import find_device
from torch import nn

from .compare import ReplicaCheck
from .heads import LossHead, Route
from .heads.base import LOSS_CALL_KEY, LossCallWatch, sequence_length
from .heads.decoder import decoder_input_ids, needs_decoder_inputs
from .remainder import REAL_ROWS_KEY, TARGET_KEYS, mask_padding, row_mask, sample_ids_of

__all__ = [
    "EvalTotals",
    "StepCounts",
    "Terms",
    "batch_device",
    "chosen_terms",
    "forward_terms",
    "model_labels",
    "model_terms",
    "sample_terms",
    "sequence_length",
    "split_labels",
    "user_loss_total",
    "watching_loss_call",
]


@dataclass(frozen=True)
class StepCounts:
    """
    The item counts of one whole optimizer step (all micro-batches, all ranks), per loss term.

    The Trainer hands it to `compute_loss` as `num_items_in_batch`; its type tells an exact step from a stock one.
    `scale` is the factor that undoes DDP's gradient averaging (the number of processes; 1 without DDP);
    `micro_batches` the micro-batches of this rank's step (a stock loss the check falls back to is divided by them);
    `router` a MoE router's `[E + 1]` T and n of the whole step (every micro-batch and rank), or None.
    """

    counts: torch.Tensor
    scale: int = 1
    micro_batches: int = 1
    router: torch.Tensor | None = None

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


class Terms(NamedTuple):
    """
    What a forward contributes to the loss, computed where its outputs are (a NamedTuple: DataParallel gathers it
    field by field, one row per replica or sample).

    Args:
        sums (`torch.Tensor`, *optional*): `[samples, terms]` loss sums.
        counts (`torch.Tensor`, *optional*): `[samples, terms]` item counts.
        user_loss (`torch.Tensor`, *optional*): `[1]`, the user loss (divided by the whole count already).
        check (`ReplicaCheck`, *optional*): what a checked forward says of the candidate heads.
        router (`torch.Tensor`, *optional*): `[samples, 2E + 1]`, a MoE model's router statistics
            (`hf_parallel.exact.heads.router`): one row per forward in training, per sample in evaluation.
    """

    sums: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    user_loss: torch.Tensor | None = None
    check: ReplicaCheck | None = None
    router: torch.Tensor | None = None


def _as_is(model: nn.Module) -> nn.Module:
    return model


def split_labels(
    head: LossHead, inputs: dict, model: nn.Module, build_decoder_inputs: bool = True, unwrap: Callable = _as_is
) -> tuple[dict, dict[str, torch.Tensor]]:
    """
    A copy of `inputs` without the labels, and the labels (the padding rows of an epoch's last step, marked, masked in
    a cross-entropy's targets); decoder inputs built when `model` (taken out of its wrappers by `unwrap`, only then)
    needs them, unless `build_decoder_inputs=False` (a forward that keeps the labels, where the model builds its own).
    """
    inputs = dict(inputs)  # the caller's dict keeps its labels
    labels = head.pop_labels(inputs)
    if REAL_ROWS_KEY in inputs:
        real = labels[REAL_ROWS_KEY] = inputs.pop(REAL_ROWS_KEY)
        if head.ignore_index_items:
            # Padding rows ignored in the targets themselves: also for a model that gets its labels.
            labels = mask_padding(labels, TARGET_KEYS, real, sample_ids_of(head, inputs))
    if build_decoder_inputs and needs_decoder_inputs(head, inputs):
        # The model builds decoder inputs from the labels it no longer receives.
        inputs["decoder_input_ids"] = decoder_input_ids(unwrap(model), labels["labels"])
    return inputs, labels


def model_labels(labels: dict) -> dict:
    """The labels as the model takes them: without the padding mark of an epoch's last step, nor what a forward's
    `LossCallWatch` recorded; labels a head packed by row (detection's `BoxTargets`) in the model's own form."""
    return {
        key: value.for_model() if callable(getattr(value, "for_model", None)) else value
        for key, value in labels.items()
        if key not in (REAL_ROWS_KEY, LOSS_CALL_KEY)
    }


@contextlib.contextmanager
def watching_loss_call(head: LossHead | None, model: nn.Module, unwrap: Callable = _as_is, checked: bool = True):
    """Around a forward of `head`: a `LossCallWatch` on `model` (taken out of its wrappers by `unwrap`, only then)
    where the head declares a `LossCall` (the arguments of the model's own loss call, the outputs of its submodules);
    yields the watch, or None. Outside a `checked` forward, a declared `stand_in` spares the model its own loss; in a
    checked one the model's loss runs within the declared `own_context`."""
    call = head.loss_call if head is not None else None
    if call is None or head.route is Route.USER_LOSS:
        yield None
        return
    model = unwrap(model)
    if not hasattr(model, "loss_function"):
        yield None
        return
    instead = None if checked else call.stand_in
    watch = LossCallWatch(model, call.arguments, call.submodules, instead, call.own_context if checked else None)
    try:
        yield watch
    finally:
        watch.remove()


def user_loss_total(head: LossHead, labels: dict, step: StepCounts | None, inputs: dict, main_input_name: str):
    """The item count a user loss (`compute_loss_func`) divides by: the step's, or the batch's in evaluation."""
    return step.total() if step is not None else head.count(labels, sequence_length(inputs, main_input_name)).sum()


def model_terms(head: LossHead, outputs, labels: dict, seq_len: int | None, count: torch.Tensor | int) -> Terms:
    """
    The terms of a forward whose loss is the model's own, given `count` as `num_items_in_batch`: `[[S]]` and `[[C]]`,
    S = loss x count, C counted from the labels.
    """
    loss = outputs.get("loss") if isinstance(outputs, dict) else (outputs[0] if outputs else None)
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ValueError(
            f"exact_loss: the {head.name} loss is taken from the model, given its labels, but its forward "
            f"returned no loss ({type(outputs).__name__}). Return the loss when labels are given, or set "
            "exact_loss=False."
        )
    sums = (loss.float() * (count.detach() if torch.is_tensor(count) else count)).reshape(1, 1)
    return Terms(sums, head.count(model_labels(labels), seq_len).to(sums.device).reshape(1, -1))


def forward_terms(head: LossHead, outputs, labels: dict, inputs: dict, per_sample: bool, loss_func=None, total=None):
    """
    What a forward contributes to the loss, computed where its outputs are (in a DataParallel replica: for its rows,
    on its device): `[samples, terms]` sums and counts (`sample_terms`), or the user loss of `loss_func`, called with
    `total` items. Per-sample tensors, so that replicas' terms concatenate.
    """
    if loss_func is not None:
        loss = loss_func(outputs, model_labels(labels)["labels"], num_items_in_batch=total)
        # [1], not 0-dim: DataParallel gathers 0-dim values into a vector, with a warning each time.
        return Terms(user_loss=loss.reshape(1) if loss.dim() == 0 else loss)
    return Terms(*sample_terms(head, outputs, labels, inputs, per_sample))


def sample_terms(head: LossHead, outputs, labels: dict, inputs: dict, per_sample: bool) -> tuple[torch.Tensor, ...]:
    """
    Loss sums and item counts per sample, `[samples, terms]`: per row, or per sequence of a packed row where
    `per_sample` (evaluation: training adds every sample up anyway, in one row, without counting the samples, which
    would read a value off the device every micro-batch); the padding samples of an epoch's last step
    (`REAL_ROWS_KEY`) add nothing, not to S, not to the gradient. `labels` loses that mark.
    """
    real = labels.pop(REAL_ROWS_KEY, None)
    sample_ids = sample_ids_of(head, inputs)
    if sample_ids is None:
        sums, counts = head.row_terms(outputs, labels)
        if real is not None:
            mask = row_mask(sums.shape[0], real, sums.device)
            # Chosen, not multiplied: a padding row's loss may be infinite (an infeasible CTC alignment), and inf x 0
            # is NaN.
            sums, counts = sums.where(mask, 0), counts.where(mask, 0)
        return sums, counts
    losses, valid = head.position_terms(outputs, labels)  # [1, positions]
    sample_ids = sample_ids.to(losses.device)
    keep = sample_ids.lt(real) if real is not None else torch.ones_like(valid[0])
    if not per_sample:
        return (losses[0] * keep).sum().reshape(1, 1), (valid[0] & keep).sum().reshape(1, 1)
    samples = int(sample_ids.max()) + 1
    sums = losses.new_zeros(samples).index_add(0, sample_ids, losses[0] * keep)
    counts = torch.zeros(samples, dtype=torch.long, device=losses.device).index_add(
        0, sample_ids, (valid[0] & keep).long()
    )
    return sums.unsqueeze(-1), counts.unsqueeze(-1)


def router_terms(head: LossHead, outputs, labels: dict, inputs: dict, per_sample: bool) -> torch.Tensor | None:
    """
    A MoE model's router statistics on this forward's rows (`hf_parallel.exact.heads.router`), the padding rows of an
    epoch's last step left out: `[1, 2E + 1]` in training, `[rows, 2E + 1]` where `per_sample` (evaluation); None
    for a head without a router, or outputs without router logits.
    """
    if head.router is None:
        return None
    rows = next(iter(model_labels(labels).values())).shape[0]
    stats = head.router.row_stats(outputs, inputs.get("attention_mask"), rows)
    if stats is None:
        return None
    real = labels.get(REAL_ROWS_KEY)
    if real is not None:
        stats = stats.where(row_mask(rows, real, stats.device).reshape(-1, 1), 0)
    return stats if per_sample else stats.sum(0, keepdim=True)


def chosen_terms(terms: Terms, index: int) -> Terms:
    """`terms` with candidate `index`'s sums and counts; in training, the sums with the graph to back-propagate."""
    check = terms.check
    sums, counts = check.sums[index], check.counts[index]
    if check.graph_sums is not None:
        sums = check.graph_sums[:, index : index + 1]  # one per replica: training adds them up anyway
    return terms._replace(sums=sums, counts=counts)


def batch_device(*tensors: dict) -> torch.device:
    """The device a forward's rows are on (a DataParallel replica's): that of its first tensor; the CPU without one."""
    return find_device(list(tensors)) or torch.device("cpu")
