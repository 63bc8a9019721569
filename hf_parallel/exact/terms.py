"""
The numbers of the exact loss: what one forward contributes (`Terms`: loss sums S and item counts C, the
user's loss, a check's verdicts, a MoE router's statistics), and the watch on a model's own loss call a head may
declare (`watching_loss_call`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch
from accelerate.utils import find_device
from torch import nn

from .compare import ReplicaCheck
from .heads import LossHead, Route
from .heads.base import LossCallWatch

__all__ = ["Terms", "batch_device", "watching_loss_call"]


class Terms(NamedTuple):
    """
    What a forward contributes to the loss, computed where its outputs are (a NamedTuple: DataParallel gathers it
    field by field).

    Args:
        sums (`torch.Tensor`, *optional*): `[rows, terms]` loss sums: a row per sample, or one for a whole forward
            (the model's own loss, a packed row's sequences); DataParallel's replicas' rows one after the other.
        counts (`torch.Tensor`, *optional*): `[rows, terms]` item counts, row for row.
        user_loss (`torch.Tensor`, *optional*): `[1]`, the user loss (divided by the whole count already).
        check (`ReplicaCheck`, *optional*): what a checked forward says of the candidate heads.
        router (`torch.Tensor`, *optional*): `[1, 2E + 1]` per forward, a MoE model's router statistics
            (`hf_parallel.exact.heads.router`): one row per forward (the padding rows left out).
    """

    sums: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    user_loss: torch.Tensor | None = None
    check: ReplicaCheck | None = None
    router: torch.Tensor | None = None


@contextlib.contextmanager
def watching_loss_call(head: LossHead | None, model: nn.Module, unwrap: Callable, checked: bool = True):
    """Around a forward of `head`: a `LossCallWatch` on `model` (taken out of its wrappers by `unwrap`, only then)
    where the head declares a `LossCall` (the arguments of the model's own loss call, the outputs of its submodules);
    yields the watch, or None. Outside a `checked` forward, a declared `stand_in` spares the model its own loss; in a
    checked one the model's loss runs within the declared `own_context`."""
    call = head.loss_call if head is not None else None
    model = unwrap(model) if call is not None and head.route is not Route.USER_LOSS else None
    if model is None or not hasattr(model, "loss_function"):
        yield None
        return
    instead = None if checked else call.stand_in
    watch = LossCallWatch(model, call.arguments, call.submodules, instead, call.own_context if checked else None)
    try:
        yield watch
    finally:
        watch.remove()


def batch_device(*tensors: dict) -> torch.device:
    """The device a forward's rows are on (a DataParallel replica's): that of its first tensor; the CPU without one."""
    return find_device(list(tensors)) or torch.device("cpu")
