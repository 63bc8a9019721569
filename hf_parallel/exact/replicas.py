"""
The exact loss under DataParallel: each replica computes the loss terms of its own rows, on its own device.

`nn.DataParallel` runs one replica of the module per device and gathers their outputs on GPU 0. Computing the loss
there, from the gathered logits, is exact but puts the whole batch's logits on GPU 0, in fp32, with their
log-softmax and, in backward, their gradient: for a causal LM with a 128k vocabulary that is tens of GiB, whatever
share of the rows GPU 0 got. So the replica runs the model *and* the loss head on its rows
(`hf_parallel.data_parallel.replicas.run_in_replicas`); only `[rows, terms]` loss sums and item counts travel to GPU 0,
where the step's count divides them. The model's outputs travel only when the caller asks for them (evaluation that
keeps predictions).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from ..data_parallel.replicas import Reporting, gathers_as_torch, run_in_replicas

__all__ = ["forward_in_replicas", "outputs_device", "takes_use_cache", "without_cache"]

# Output keys that hold a model's cache (transformers 5 names it `cache`; earlier `past_key_values`).
_CACHE_KEYS = ("cache", "past_key_values", "cache_params")


def without_cache(outputs: Any) -> Any:
    """`outputs` without the model's cache (`cache`, formerly `past_key_values`): of no use after a forward with
    labels, and gathering it from every replica would cost GPU 0 the keys and values of the whole batch."""
    if not isinstance(outputs, dict):
        return outputs
    dropped = [key for key, value in outputs.items() if key in _CACHE_KEYS or isinstance(value, Cache)]
    if not dropped:
        return outputs
    return type(outputs)(**{key: value for key, value in outputs.items() if key not in dropped})


def takes_use_cache(model: nn.Module) -> bool:
    """Whether the model's `forward` has a `use_cache` parameter (so a forward whose outputs are not kept can skip
    building the cache)."""
    return _forward_has(type(model), "use_cache")


@functools.cache
def _forward_has(model_class: type, name: str) -> bool:
    try:
        return name in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        return False


def outputs_device(outputs: Any, labels: dict) -> torch.device:
    """The device a replica computes on: that of its labels (else of its logits), where its loss terms are made."""
    for value in (*labels.values(), outputs.get("logits") if isinstance(outputs, dict) else None):
        if torch.is_tensor(value):
            return value.device
    return torch.device("cpu")


def forward_in_replicas(exact, wrapper: nn.DataParallel, run, inputs: dict, labels: dict, autocast_dtype, keep: bool):
    """
    A forward of the exact step (`run`: `run(model, inputs, labels) -> (Terms, outputs)`) in every replica of
    `wrapper` (`run_in_replicas`): the gathered `Terms` and the outputs it keeps.
    """
    if not gathers_as_torch(wrapper):
        # A forward of its own splits the batch as it likes: only the tensors of the batch go in, as under stock. Its
        # replicas send their `Terms` past the wrapper's gather, which may not keep a NamedTuple's type; the wrapper
        # gathers only what it gathers under stock: the model's outputs where they are kept (and from there they are
        # taken, in the wrapper's order), an empty dict otherwise.
        def fallback(returned: Any) -> tuple[Any, Any]:
            # A forward that never calls its `module` returns the model's outputs on the whole batch, given its
            # labels: the terms are computed from them, where they were gathered (exact, at the cost of the whole
            # batch's outputs there), warned once.
            exact.warn_once(
                "exact_loss: the forward of the DataParallel wrapper does not call its `module`, so its replicas "
                "cannot compute their own loss terms; the loss is computed from the outputs the wrapper gathered "
                "(exact, but the whole batch's logits are gathered on the first device). The model's own loss is not "
                "checked against the head."
            )
            # `run.plain` calls the model: here, one already called.
            return run.plain(lambda **_: returned, inputs, labels)

        report = Reporting(pairs=True, fallback=fallback)
        terms, outputs = run_in_replicas(wrapper, run, inputs, labels, autocast_dtype, report)
        return terms, (outputs if keep else None)
    if not keep and "use_cache" not in inputs and takes_use_cache(wrapper.module):
        inputs = {**inputs, "use_cache": False}  # nothing reads a cache of a forward whose outputs are dropped
    return run_in_replicas(wrapper, run, inputs, labels, autocast_dtype)
