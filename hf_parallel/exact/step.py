"""
A run's steady training step: the short path every step after the first takes, for an engine and a head that need
nothing more than counting and one forward. Read top to bottom:

1. `pull_batches`: the step's micro-batches (the stock loop) and, only under an engine that pads an epoch's last
   global batch, whether the last one ends the epoch (that step takes the whole way, which marks the padding).
2. `SteadyStep.count`: the head counts the step's items C from the labels, added over the engine's ranks.
3. `SteadyStep.loss`, per micro-batch: the labels out of the forward (or in it, by the head's route), one forward,
   the head's loss sum S, and S / C times the engine's gradient factor.

`steady_step` says, once, whether a run's step can take it. Everything else goes the whole way
(`hf_parallel.exact.forward.micro_batch_loss`): the first step's check of the head against the model's own loss,
DataParallel replicas, the padded rows of an epoch's last step, a MoE router's term, batch-coupled and user losses,
a head that watches the model's loss call, evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .engine import Engine
from .heads import LossHead, Route
from .heads.base import sequence_length
from .heads.decoder import decoder_input_ids, needs_decoder_inputs
from .remainder import EpochEnd, epoch_end
from .terms import StepCounts

__all__ = ["SteadyStep", "pull_batches", "steady_step"]


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


class SteadyStep:
    """
    The steady step of one run: its engine and its head, fixed once the first step's check settled the head.

    Args:
        engine (`Engine`): the run's engine.
        head (`LossHead`): the settled head (route `RECOMPUTED`, `MODEL_LOSS` or `LABELS_IN_FORWARD`).
        main_input_name (`str`): the input whose second dimension is the sequence length.
        unwrap (`Callable`): takes a model out of its wrappers (an encoder-decoder's decoder inputs are built by it).
    """

    def __init__(self, engine: Engine, head: LossHead, main_input_name: str, unwrap: Callable[[nn.Module], nn.Module]):
        self.engine, self.head, self.main_input_name, self.unwrap = engine, head, main_input_name, unwrap
        self.model_loss = head.route is Route.MODEL_LOSS
        self.labels_in_forward = head.route is not Route.RECOMPUTED
        self.builds_decoder_inputs = head.builds_decoder_inputs and head.route is Route.RECOMPUTED  # labels out

    def count(self, batches: list[dict], device: torch.device | None = None) -> StepCounts:
        """C: the items of the step's `batches` per loss term, added over the engine's ranks."""
        counts = None
        for batch in batches:
            items = self.head.count(batch, sequence_length(batch, self.main_input_name)).to(device)
            counts = items if counts is None else counts + items
        engine = self.engine
        if engine.count_ranks > 1:
            counts = engine.add_counts(counts)
        return StepCounts(counts, engine.gradient_factor, len(batches))

    def loss(self, model: nn.Module, inputs: dict, step: StepCounts) -> tuple[torch.Tensor, Any]:
        """One micro-batch's loss, S / C of the step times the engine's gradient factor, and the model's outputs."""
        head = self.head
        inputs = dict(inputs)  # the caller's dict keeps its labels
        labels = head.pop_labels(inputs)
        if self.builds_decoder_inputs and needs_decoder_inputs(head, inputs):
            inputs["decoder_input_ids"] = decoder_input_ids(self.unwrap(model), labels["labels"])
        if self.model_loss:
            # The model divides its own loss sum by the step's count: S / C itself.
            outputs = model(**inputs, **labels, num_items_in_batch=step.counts.sum())
            loss = (outputs["loss"] if isinstance(outputs, dict) else outputs[0]).float() * step.scale
        else:
            outputs = model(**inputs, **labels) if self.labels_in_forward else model(**inputs)
            sums, _ = head.row_terms(outputs, labels)
            loss = head.combine(sums.sum(0), step.counts) * step.scale
        return self.engine.valued(loss), outputs


def steady_step(
    engine: Engine,
    head: LossHead | None,
    settled: bool,
    user_loss: bool,
    main_input_name: str,
    unwrap: Callable[[nn.Module], nn.Module],
) -> SteadyStep | None:
    """
    The steady step of a run whose engine and head need nothing more than counting and one forward, or None.

    Args:
        engine (`Engine`): the run's engine.
        head (`LossHead`, *optional*): the run's head (None: the stock loss).
        settled (`bool`): whether the check of the head against the model's own loss is decided.
        user_loss (`bool`): whether the Trainer has a `compute_loss_func`.
        main_input_name (`str`): the input whose second dimension is the sequence length.
        unwrap (`Callable`): takes a model out of its wrappers.
    """
    if head is None or not settled or user_loss or engine.replicas or engine.shards_sequence:
        return None
    if head.route is Route.USER_LOSS or head.needs_more_than_a_forward:
        return None
    return SteadyStep(engine, head, main_input_name, unwrap)
