"""
The one exact step: every training step (the Trainer's and `ExactLoop`'s, the first and every later one, under every
engine and for every head family) and every evaluation batch runs the same three stages. Read top to bottom:

1. `pull_batches`: the step's micro-batches (the stock loop) and, under an engine that pads an epoch's last global
   batch or shards the sequence, whether the last one ends the epoch; while the check of the head against the model's
   own loss is open, `calibrate_head` (`hf_parallel.exact.checked`) settles the head on the first of them.
2. `count_step`: C, the step's items per loss term, added over the engine's ranks, before any micro-batch runs.
3. `micro_batch_loss`, per micro-batch: the labels out of the forward (or in it, by the head's route), one forward,
   the head's loss sums S (`Terms`), and S / C times the engine's gradient factor (`reduce`); in evaluation S and C
   added to the totals of the set.

An engine or a family adds its part around these stages, never a path of its own: DataParallel runs the forward in
its replicas (`hf_parallel.exact.replicas`); a MoE router adds a declared term (`hf_parallel.exact.heads.router`); a
loss over the whole step's rows embeds them first (`hf_parallel.exact.coupled`); a head that reads the model's loss
call watches it (`LossCallWatch`); the padded rows of an epoch's last step are left out of the counts and sums
(`hf_parallel.exact.remainder`).

```python
from hf_parallel.exact import ExactLoss, RunContext, count_step, micro_batch_loss

exact = ExactLoss()
head = exact.head(model, batches[0])
step = count_step(exact, head, batches)
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

from .compare import fused_outputs
from .coupled import contrastive_loss
from .heads import LossHead, Route
from .heads.base import LOSS_CALL_KEY, index_in_step, sample_ids_of, sequence_length
from .heads.decoder import decoder_input_ids, needs_decoder_inputs
from .remainder import (
    TARGET_KEYS,
    EpochEnd,
    epoch_end,
    first_rows,
    mask_padding,
    real_batches,
    real_samples,
    row_mask,
)
from .replicas import forward_in_replicas, outputs_device, without_cache
from .terms import Terms, watching_loss_call

__all__ = [
    "RunContext",
    "StepCounts",
    "count_step",
    "micro_batch_loss",
    "model_labels",
    "pull_batches",
    "sample_terms",
    "split_labels",
]


def pull_batches(epoch_iterator, num_batches: int, gradient_state, reads_end: bool) -> tuple[list, EpochEnd | None]:
    """
    Up to `num_batches` batches of `epoch_iterator` (the stock loop) and, where `reads_end` (an engine that pads an
    epoch's last global batch, or shards the sequence), whether the last one ends the epoch: read from accelerate's
    `GradientState` right after it was pulled (its dataloader is gone once the iterator is spent).
    """
    batches, end = [], None
    for _ in range(num_batches):
        try:
            batches.append(next(epoch_iterator))
        except StopIteration:
            break
        if reads_end and gradient_state.end_of_dataloader:
            end = epoch_end(gradient_state)
    return batches, end


@dataclass(frozen=True, eq=False)
class StepCounts:
    """
    The item counts of one whole optimizer step (all micro-batches, all ranks), per loss term, and what else the step
    holds for its micro-batches.

    Args:
        counts (`torch.Tensor`): C per loss term, of `head`.
        total (`torch.Tensor`): their sum, made once: what stock code gets as `num_items_in_batch`.
        scale (`int`): the engine's gradient factor (DDP averages gradients: the number of processes; 1 without).
        micro_batches (`int`): this rank's micro-batches (a stock loss the check falls back to is divided by them).
        router (`torch.Tensor`, *optional*): a MoE router's `[E + 1]` statistics of the whole step, or None.
        batches (`tuple[dict, ...]`): this rank's micro-batches as counted (a loss over the whole step's rows embeds
            them all first).
        head (`LossHead`, *optional*): the head counted.
        shared (`torch.Tensor`, *optional*): a statistic of the whole step that every micro-batch's loss takes (KTO's
            KL reference point, `heads.trainers.KtoHead`).
        real_rows (`tuple[int | None, ...]`, *optional*): where an epoch's end padded the step, per micro-batch how
            many of its leading samples are real (None: all); empty where none is padding.
    """

    counts: torch.Tensor
    total: torch.Tensor
    scale: int = 1
    micro_batches: int = 1
    router: torch.Tensor | None = None
    batches: tuple[dict, ...] = ()
    head: LossHead | None = None
    shared: torch.Tensor | None = None
    real_rows: tuple[int | None, ...] = ()

    def real_rows_of(self, inputs: dict) -> int | None:
        """How many leading samples of the micro-batch `inputs` (one of `batches`) are real; None: all of them."""
        if not self.real_rows:
            return None
        return self.real_rows[index_in_step(self.batches, inputs, "exact_loss")]


def count_step(
    exact,
    head: LossHead,
    batches: list[dict],
    device: torch.device | None = None,
    main_input_name: str = "input_ids",
    model: nn.Module | None = None,
    real_rows: tuple[int | None, ...] = (),
) -> StepCounts:
    """
    The item counts of a whole optimizer step for `head` (settled: `calibrate_head` first, while its check is open):
    all `batches` of this rank (where an epoch's end padded them, the real samples alone: `real_rows`, per batch),
    added over the engine's ranks (one collective). With `model` (what the micro-batches run through) and a MoE router
    under gradient accumulation, also the router statistics of the whole step (`router_balance="step"`: a forward of
    each micro-batch without gradient).
    """
    marks = real_rows or (None,) * len(batches)
    counts = sum(
        _items(head, batch, main_input_name, real).to(device) for batch, real in zip(batches, marks, strict=True)
    )
    router = None
    if model is not None and head.router is not None and len(batches) > 1 and exact.router_balance == "step":
        router = _router_step(exact, head, model, batches, marks, counts.device)
    # C must be the count of the whole step on every rank; and DDP averages gradients over ranks, so each rank
    # scales its S / C by the engine's factor (the world size: the sum over ranks of S_r / C is the exact loss).
    engine = exact.engine
    counts = engine.add_counts(counts)
    return StepCounts(
        counts,
        counts.sum(),
        engine.gradient_factor,
        len(batches),
        router,
        tuple(batches),
        head=head,
        real_rows=tuple(real_rows),
    )


def _items(head: LossHead, batch: dict, main_input_name: str, real: int | None) -> torch.Tensor:
    """A batch's item counts per term, its samples from `real` on (an epoch's padding) left out."""
    seq_len = sequence_length(batch, main_input_name)
    if real is None:
        return head.count(batch, seq_len)
    if not head.label_keys:  # a head without labels (contrastive, a Trainer subclass's): its real rows cut out
        return head.count(real_samples(head, batch, real, cut=True), seq_len)
    # The last batch of an epoch under DDP: only its leading samples are real, the rest is padding.
    sample_ids = sample_ids_of(head, batch)
    if head.ignore_index_items:
        # What the forward will see: the padding's targets ignored (`split_labels`), so that a model given its
        # labels counts as this does.
        return head.count(mask_padding(batch, TARGET_KEYS, real, sample_ids), seq_len)
    return head.count(first_rows(batch, (*head.label_keys, "shift_labels"), real), seq_len)


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
        trainer_loss (`Callable`, *optional*): a Trainer subclass's own `compute_loss` (TRL's), for a head of
            `Route.TRAINER_LOSS`; also given the batch's `items` and whether it is all `padding` (an epoch's
            repeated samples).
    """

    owner: nn.Module | None = None
    loss_func: Callable | None = None
    autocast_dtype: torch.dtype | None = None
    main_input_name: str = "input_ids"
    trainer_loss: Callable | None = None


def micro_batch_loss(
    exact,
    model: nn.Module,
    head: LossHead,
    inputs: dict,
    step: StepCounts | None,
    context: RunContext,
    *,
    return_outputs: bool = False,
    real: int | None = None,
) -> tuple[torch.Tensor, Any]:
    """
    The exact loss of one micro-batch (S / C of the step in training, `step` given; S / C of the batch in evaluation,
    added to the evaluation totals) and, when `return_outputs`, the model's outputs (None where a DataParallel
    forward gathered none: evaluation without predictions).

    Args:
        exact (`ExactLoss`): the run's loss state (head cache, check, engine, totals).
        model (`nn.Module`): what to call: the model, or its DDP / DataParallel wrapper.
        head (`LossHead`): `exact.head(owner)`.
        inputs (`dict`): the batch, with its labels (the caller's dict is not changed).
        step (`StepCounts`, *optional*): the counts of the whole optimizer step (`count_step`); None in evaluation.
        context (`RunContext`): what stays the same over the run.
        return_outputs (`bool`, *optional*): return the outputs too.
        real (`int`, *optional*): in evaluation, how many leading samples of the batch are real (an epoch's last
            batch under DDP, which accelerate filled with repeated ones); in training the step knows
            (`StepCounts.real_rows`).
    """
    if step is not None and step.real_rows:  # the step's padded micro-batch, found by its tensors
        real = step.real_rows_of(inputs)
    if head.batch_coupled:
        # Each row's loss depends on the others of the batch: computed on the whole step's embeddings.
        return contrastive_loss(exact, model, head, inputs, step, context, return_outputs, real)
    if head.route is Route.TRAINER_LOSS:
        return _trainer_loss(exact, model, head, inputs, step, context, return_outputs, real)
    if "skip_logits" in inputs and head.route is not Route.MODEL_LOSS:
        # Stock asks a Liger forward for no logits in evaluation without predictions (`skip_logits=True`); a recomputed
        # loss is made of them.
        inputs = {key: value for key, value in inputs.items() if key != "skip_logits"}
    keeps_labels = head.route is Route.MODEL_LOSS
    inputs, labels = split_labels(head, inputs, model, not keeps_labels, exact.unwrap, real)
    user_loss = head.route is Route.USER_LOSS and context.loss_func is not None
    total = None
    if user_loss:  # the count a user loss divides by: the step's, or the batch's in evaluation
        seq_len = sequence_length(inputs, context.main_input_name)
        total = step.total if step is not None else head.count(labels, seq_len).sum()
    replicas = exact.engine.replicas
    keep = return_outputs and (exact.evaluation.outputs_wanted or not replicas)
    run = PlainForward(exact, head, step, context, total, keep=keep, drop_cache=replicas, real=real)
    watch = watching_loss_call(head, model, exact.unwrap, checked=False) if head.loss_call is not None else None
    with watch or contextlib.nullcontext() as run.loss_call:
        if replicas:
            terms, outputs = forward_in_replicas(exact, model, run, inputs, labels, context.autocast_dtype, keep)
        else:
            terms, outputs = run(model, inputs, labels)
    return reduce(exact, head, terms, step), outputs


def _trainer_loss(exact, model, head, inputs: dict, step, context: RunContext, return_outputs: bool, real):
    """
    A micro-batch's loss where a Trainer subclass computes it (`Route.TRAINER_LOSS`, TRL's trainers): its own
    `compute_loss` on the batch without an epoch's padding samples, given the step's count (the batch's in evaluation)
    as `num_items_in_batch`; the head makes S of it, reduced as every head's S.
    """
    items = _items(head, inputs, context.main_input_name, real)
    if real is not None:
        inputs = real_samples(head, inputs, real)
    # In evaluation, the batch's own count; a batch of none (an epoch's repeats alone) gives 0, not 0 / 0.
    count = step.total if step is not None else items.sum().clamp(min=1)
    if head.router is not None:
        inputs = {**inputs, "output_router_logits": True}
    within = head.router.first_forward(exact.unwrap(model)) if head.router is not None else contextlib.nullcontext([])
    with within as router:
        result = context.trainer_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=count, items=items, padding=real == 0
        )
    loss, outputs = result if return_outputs else (result, None)
    items = items.to(loss.device)
    sums = head.sums(loss, count, items)
    stats = None
    if router:  # the policy's router statistics, the padding rows of an epoch's last step (SFT's, kept) left out
        uncut = real is not None and (head.ignore_index_items or real == 0)  # rows not cut (SFT's; a batch of padding)
        stats = head.router.forward_stats(router[0], real if uncut else None)
    return reduce(exact, head, Terms(sums.reshape(1, -1), items.reshape(1, -1), router=stats), step), outputs


def split_labels(
    head: LossHead,
    inputs: dict,
    model: nn.Module,
    build_decoder_inputs: bool = True,
    unwrap: Callable = lambda m: m,
    real: int | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """
    A copy of `inputs` without the labels, and the labels (the samples from `real` on, an epoch's padding, masked in
    a cross-entropy's targets); decoder inputs built when `model` (taken out of its wrappers by `unwrap`, only then)
    needs them, unless `build_decoder_inputs=False` (a forward that keeps the labels, where the model builds its own).
    """
    inputs = dict(inputs)  # the caller's dict keeps its labels
    labels = head.pop_labels(inputs)
    if real is not None and head.ignore_index_items:
        # Padding rows ignored in the targets themselves: also for a model that gets its labels.
        labels = mask_padding(labels, TARGET_KEYS, real, sample_ids_of(head, inputs))
    if build_decoder_inputs and head.builds_decoder_inputs and needs_decoder_inputs(head, inputs):
        # The model builds decoder inputs from the labels it no longer receives.
        inputs["decoder_input_ids"] = decoder_input_ids(unwrap(model), labels["labels"])
    return inputs, labels


def model_labels(labels: dict) -> dict:
    """The labels as the model takes them: without what a forward's `LossCallWatch` recorded; labels a head packed by
    row (detection's `BoxTargets`) in the model's own form."""
    return {
        key: value.for_model() if callable(getattr(value, "for_model", None)) else value
        for key, value in labels.items()
        if key != LOSS_CALL_KEY
    }


class PlainForward:
    """
    One forward of the head's route and its `Terms`, run where the outputs are: in the caller, or in each
    DataParallel replica on its rows; the check's forward wraps it (`hf_parallel.exact.checked.CheckedForward`).

    Args:
        exact (`ExactLoss`): the run's loss state.
        head (`LossHead`): the head; its route says what the model is given.
        step (`StepCounts`, *optional*): the step's counts (None in evaluation).
        context (`RunContext`): what stays the same over the run.
        total (`torch.Tensor`, *optional*): the count a user loss divides by; None without a user loss.
        keep (`bool`, *optional*): return the model's outputs (without their cache where `drop_cache`).
        drop_cache (`bool`, *optional*): drop the outputs' cache (a DataParallel gather would carry it).
        real (`int`, *optional*): how many leading samples are real (an epoch's padding after them); None: all.
    """

    def __init__(self, exact, head, step, context: RunContext, total=None, *, keep=False, drop_cache=False, real=None):
        self.exact, self.head, self.step, self.context, self.total = exact, head, step, context, total
        self.real = real
        self.loss_func = context.loss_func if total is not None else None
        self.keep, self.drop_cache = keep, drop_cache
        #: The watch on the model's loss call, for a head that declares one (`LossCallWatch`).
        self.loss_call = None
        self.plain = self

    def __call__(self, run, inputs: dict, labels: dict):
        outputs, labels, count = self.forward(run, inputs, labels)
        return self.terms(outputs, labels, inputs, count), self.kept(outputs)

    def forward(self, run, inputs: dict, labels: dict, count=None, with_labels: bool = False):
        """
        The model's outputs, the labels with what its loss call passed (`LOSS_CALL_KEY`), and the count it was given.
        The model gets its labels where the route keeps them in (or `with_labels`), and as `num_items_in_batch` the
        step's count C where its own loss is the head's (S / C of the step in training, S in evaluation), else `count`.
        """
        head = self.head
        targets = model_labels(labels)
        if head.route is Route.MODEL_LOSS and self.step is not None:
            count = self.step.total
            device = next(iter(targets.values())).device  # a replica's, under DataParallel
            count = count if count.device == device else count.to(device)
        elif head.route is Route.MODEL_LOSS:
            count = 1
        extra = targets if with_labels or head.route in (Route.MODEL_LOSS, Route.LABELS_IN_FORWARD) else {}
        if count is not None:
            extra = {**extra, "num_items_in_batch": count}
        outputs = run(**inputs, **extra)
        if self.loss_call is not None:
            seen = self.loss_call.take()
            if not seen and head.loss_call.inferred is not None:
                # A model that computes its loss inline passes nothing: its arguments as it computes them.
                seen = head.loss_call.inferred(getattr(run, "module", run), inputs)
            labels = {**labels, LOSS_CALL_KEY: seen}
        return outputs, labels, count

    def from_model_loss(self, outputs, count) -> bool:
        """Whether the terms are read off the model's own loss: its route, or fused outputs (no logits) and a count."""
        return self.head.route is Route.MODEL_LOSS or (count is not None and fused_outputs(outputs))

    def terms(self, outputs, labels: dict, inputs: dict, count=None) -> Terms:
        """The forward's `Terms`: read off the model's own loss (`from_model_loss`), the user loss, or the head's sums
        from the outputs, with a MoE router's statistics where the head has a router."""
        head = self.head
        if self.from_model_loss(outputs, count):
            return _model_terms(head, outputs, labels, sequence_length(inputs, self.context.main_input_name), count)
        if self.loss_func is not None:
            total = self.total.to(outputs_device(outputs, labels)) if torch.is_tensor(self.total) else self.total
            loss = self.loss_func(outputs, model_labels(labels)["labels"], num_items_in_batch=total)
            # [1], not 0-dim: DataParallel gathers 0-dim values into a vector, with a warning each time.
            terms = Terms(user_loss=loss.reshape(1) if loss.dim() == 0 else loss)
        else:
            terms = Terms(*sample_terms(head, outputs, labels, inputs, self.real))
        if head.router is None:
            return terms
        rows = next(iter(model_labels(labels).values())).shape[0]
        stats = head.router.row_stats(outputs, inputs.get("attention_mask"), rows)
        return terms._replace(router=head.router.forward_stats(stats, self.real))

    def kept(self, outputs):
        """The outputs to return: None unless kept, without their cache where it must not travel."""
        if not self.keep:
            return None
        return without_cache(outputs) if self.drop_cache else outputs


def _model_terms(head: LossHead, outputs, labels: dict, seq_len: int | None, count: torch.Tensor | int) -> Terms:
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


def sample_terms(
    head: LossHead, outputs, labels: dict, inputs: dict, real: int | None = None
) -> tuple[torch.Tensor, ...]:
    """
    Loss sums and item counts per row, `[rows, terms]`; a packed row's sequences added up in its one row (in training
    and evaluation alike: both add every sample up, and counting the samples would read a value off the device every
    micro-batch); the samples from `real` on (an epoch's padding: a row, or a sequence of a packed row) add nothing,
    not to S, not to the gradient.
    """
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
    return (losses[0] * keep).sum().reshape(1, 1), (valid[0] & keep).sum().reshape(1, 1)


def reduce(exact, head: LossHead, terms: Terms, step: StepCounts | None) -> torch.Tensor:
    """
    The loss from `terms` (one forward's, or every replica's gathered): S / C of the step in training (`step` given),
    S / C of the batch otherwise, S and C then added to the evaluation totals.
    """
    if terms.user_loss is not None:
        # One value per replica under DataParallel (each divided by the whole count already): their sum.
        return terms.user_loss.sum() * (step.scale if step is not None else 1)
    if step is None:
        return exact.evaluation.add(head, terms)
    loss = head.combine(terms.sums.sum(0), step.counts) * step.scale
    if terms.router is None:
        return loss
    return loss + _router_term(exact, head, terms.router.sum(0), step)


# ---- A MoE router's term (`hf_parallel.exact.heads.router`), added to its head's ----
def _router_step(exact, head: LossHead, model: nn.Module, batches: list[dict], marks, device) -> torch.Tensor:
    """The router statistics of the whole step, over every rank: a forward of each micro-batch without gradient, under
    the random state the training forwards then draw from again."""
    forward = exact.unwrap(model) if exact.engine.replicas else model  # a DataParallel's: on one device
    if head.route is Route.TRAINER_LOSS:  # its backbone, on the real samples (an epoch's repeated rows out)
        forward, batches = head.router_forward(exact.unwrap(model)), real_batches(head, batches, marks)
        marks = (None,) * len(batches)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        router = head.router.step_stats(forward, batches, head.label_keys, marks)
    return exact.engine.add_counts(router.to(device))


def _router_term(exact, head: LossHead, own: torch.Tensor, step: StepCounts) -> torch.Tensor:
    """
    A MoE model's router term of one micro-batch in training: with the step's router statistics
    (`router_balance="step"`), this micro-batch's share of the whole step's term; otherwise over the micro-batch of
    every replica and rank (T and n added over ranks: one collective), scaled like the head's sums, and averaged over
    the step's micro-batches (warned once).
    """
    if step.router is not None:
        return head.router.loss(own, step.router) * step.scale
    engine = exact.engine
    everyone = engine.add_counts(head.router.shared(own)) if engine.count_ranks > 1 else None
    if step.micro_batches > 1:
        exact.warn_once(
            "exact_loss: the router auxiliary loss of a mixture-of-experts model is taken over each micro-batch "
            f"of every device, and averaged over the {step.micro_batches} micro-batches of a step "
            "(router_balance='micro_batch'; stock adds them up). The cross-entropy is exact over the whole step. "
            "router_balance='step' (the default) gives the router loss of one forward over the whole step, at "
            "the cost of one more forward without gradient per micro-batch."
        )
    return head.router.loss(own, everyone) * (step.scale / step.micro_batches)
