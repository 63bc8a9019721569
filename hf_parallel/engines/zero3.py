"""
Saving a model whose parameters DeepSpeed ZeRO-3 partitioned: each rank holds a slice of every parameter, and the
module's own tensors are empty (`shape [0]`) outside DeepSpeed's gathers. `model.save_pretrained(...)` on such a model
(the unwrapped one, as `trainer.accelerator.unwrap_model(trainer.model)` gives it) writes those empty tensors: a
checkpoint `from_pretrained` cannot load, written without a word (measured: transformers 5.25, deepspeed 0.19.8).

`gather_on_save(model)`, which `hf_parallel.Trainer` applies under ZeRO-3, makes that model's `save_pretrained` gather
each partitioned parameter (one all-gather per parameter, copied to rank 0's CPU memory) and write the full weights
from rank 0. Like transformers' save of an FSDP model, it needs every rank to call it; a rank that calls it alone is
told so after `RANKS_DEADLINE_S` seconds instead of waiting in a collective forever. A `state_dict` given explicitly
(what `Trainer.save_model` passes) is written as given.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import types

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "RANKS_DEADLINE_S",
    "gather_on_save",
    "gathered_parameters",
    "gathered_state_dict",
    "is_partitioned",
    "wait_for_every_rank",
]

#: How long a rank waits for the others to call a gathering save before it stops with an error naming the cause.
RANKS_DEADLINE_S = 120.0


def is_partitioned(model: nn.Module) -> bool:
    """Whether ZeRO-3 partitioned any of `model`'s parameters (they carry DeepSpeed's `ds_id`)."""
    return any(hasattr(parameter, "ds_id") for parameter in model.parameters())


def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """
    The full state dict of a ZeRO-3 partitioned `model` on rank 0 (CPU tensors, keys and order of
    `model.state_dict()`, tied parameters gathered once) and `{}` on the other ranks. Every rank must call it: each
    partitioned parameter is gathered in turn, so at most one full parameter is in device memory at a time.
    """
    import deepspeed

    keep = not dist.is_initialized() or dist.get_rank() == 0
    state = model.state_dict(keep_vars=True)
    copies: dict[int, torch.Tensor | None] = {}
    for value in state.values():
        if id(value) not in copies:
            if hasattr(value, "ds_id"):
                with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
                    copies[id(value)] = value.detach().cpu().clone() if keep else None
            else:
                copies[id(value)] = value.detach().cpu() if keep else None
    return {name: copies[id(value)] for name, value in state.items()} if keep else {}


_ARRIVALS: dict[str, int] = {}


def wait_for_every_rank(what: str, fix: str) -> None:
    """
    Return once every rank has arrived here for the same call of `what` (counted per name, through the process
    group's store: no collective); after `RANKS_DEADLINE_S` seconds withdraw this rank's arrival and raise a
    `RuntimeError` naming `what` and `fix`. Nothing to wait for without a process group.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    _ARRIVALS[what] = calls = _ARRIVALS.get(what, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    key = f"hf_parallel/{what}/{calls}"
    world = dist.get_world_size()
    arrived = store.add(key, 1)
    start = time.monotonic()
    while arrived < world:
        if time.monotonic() - start > RANKS_DEADLINE_S:
            # Withdraw this arrival, so that the next call of every rank meets under the same key again.
            store.add(key, -1)
            _ARRIVALS[what] = calls - 1
            raise RuntimeError(
                f"{what}: rank {dist.get_rank()} waited {RANKS_DEADLINE_S:.0f} s for the other ranks ({arrived} of "
                f"{world} arrived). Under ZeRO-3 each rank holds a slice of every parameter, so {fix}"
            )
        time.sleep(0.05)
        arrived = store.add(key, 0)


def gathered_parameters(model: nn.Module):
    """A context in which a ZeRO-3 partitioned `model` holds its full parameters (every rank enters it together)."""
    if not is_partitioned(model):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def save_pretrained(self, *args, **kwargs):
    """
    `save_pretrained` of a model ZeRO-3 may partition (installed by `gather_on_save`): the class's own, given the
    gathered full weights on rank 0 when no `state_dict` is passed and the parameters are partitioned.
    """
    original = type(self).save_pretrained.__get__(self)
    bound = inspect.signature(original).bind(*args, **kwargs)
    if bound.arguments.get("state_dict") is None and is_partitioned(self):
        wait_for_every_rank(
            f"{type(self).__name__}.save_pretrained",
            "every rank must call save_pretrained (transformers writes from rank 0 only); do not guard the call "
            "with `if trainer.is_world_process_zero()`. trainer.save_model(...) on every rank does the same.",
        )
        bound.arguments["state_dict"] = gathered_state_dict(self)
        main = not dist.is_initialized() or dist.get_rank() == 0
        bound.arguments["is_main_process"] = bound.arguments.get("is_main_process", True) and main
    return original(*bound.args, **bound.kwargs)


def gather_on_save(model: nn.Module) -> None:
    """
    Make `model.save_pretrained` write full weights while ZeRO-3 partitions its parameters (see the module's
    docstring). A method bound to the model, so that a deep copy saves itself; a model without `save_pretrained` is
    left as it is.
    """
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = types.MethodType(save_pretrained, model)
