"""
A step function in every replica of an `nn.DataParallel` wrapper (`run_in_replicas`): what the exact loss under
DataParallel runs its forward and loss terms through (`hf_parallel.exact.replicas`), and what a stock forward runs
under mixed precision (`replica_precision`).

The wrapper replicates whatever its `module` is at call time, so for one call `module` is a `ReplicaStep` around the
model: the labels are scattered with the same chunk sizes as the inputs, and each replica runs the step function on
its chunk. The parameters are the model's, so gradients flow back to them as they do for the model itself.

A wrapper whose class defines its own `forward` (a subclass that splits the batch and gathers the outputs its own way)
may gather what a replica returns differently from torch (a NamedTuple rebuilt from a generator, say). Its replicas
report their results to `run_in_replicas` directly, and hand the wrapper only what it would gather under stock: the
model's outputs where they are kept, an empty dict otherwise (`Reporting`).

Mixed precision: transformers applies autocast through accelerate's `prepare`, which it skips for a model it wrapped
in `nn.DataParallel`; and torch's `parallel_apply` carries only autocast's *enabled* flag into the replica threads,
where the default dtype of CUDA autocast is float16 (a bf16 run would compute in fp16, without a loss scaler). A
`ReplicaStep` enters autocast itself, inside the replica's thread, with the requested dtype.

```python
from hf_parallel.data_parallel.replicas import run_in_replicas

def step(model, inputs, labels):
    outputs = model(**inputs)
    return torch.nn.functional.cross_entropy(outputs.logits, labels["labels"], reduction="sum")

loss_sums = run_in_replicas(data_parallel_model, step, inputs, {"labels": labels})  # one sum per replica
loss = loss_sums.sum() / labels.numel()
```
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import torch
from accelerate.utils import convert_to_fp32
from torch import nn
from torch.nn.parallel.data_parallel import DataParallel as _TorchDataParallel

from ..upstream import temporarily

__all__ = [
    "AUTOCAST_DTYPES",
    "ReplicaStep",
    "Reporting",
    "caller_autocast",
    "gather_reports",
    "gathering_as_torch",
    "gathers_as_torch",
    "is_data_parallel",
    "replica_autocast",
    "replica_precision",
    "replica_step",
    "run_in_replicas",
    "stock_replica_precision",
]

#: accelerate's `mixed_precision` setting -> the autocast dtype of a replica.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: The attribute that marks a DataParallel `forward` as gathering its replicas' results with torch's `gather`.
_GATHERS_AS_TORCH = "_hf_parallel_gathers_as_torch"


def is_data_parallel(model: Any) -> bool:
    """Whether `model` is an `nn.DataParallel` wrapper (torch's, `ExactDataParallel`, `BalancedDataParallel`, any
    subclass). torch's class itself, not `torch.nn.DataParallel` as looked up now (which code may have replaced)."""
    return isinstance(model, _TorchDataParallel)


def gathers_as_torch(wrapper: nn.DataParallel) -> bool:
    """
    Whether `wrapper`'s forward hands the output device what its replicas return as torch's `gather` does (types
    kept, a NamedTuple included): torch's own `DataParallel.forward`, or one marked with `gathering_as_torch`. A
    subclass with a forward of its own is not trusted to (see `Reporting`).
    """
    forward = type(wrapper).forward
    return forward is _TorchDataParallel.forward or getattr(forward, _GATHERS_AS_TORCH, False)


def gathering_as_torch(forward: Callable) -> Callable:
    """Mark a DataParallel subclass's `forward` as gathering with torch's `gather` (`gathers_as_torch`)."""
    setattr(forward, _GATHERS_AS_TORCH, True)
    return forward


class Reporting:
    """
    How the replicas of a wrapper with a forward of its own (`gathers_as_torch` is False) send their results: each
    keeps its result in `results` (the lock guards replica threads) and hands the wrapper an empty dict, to gather as
    it gathers model outputs. With `pairs`, a replica's result is `(kept, shown)`: it keeps `kept` and hands the
    wrapper `shown` (an empty dict for None), and `run_in_replicas` returns the kept results, gathered on the output
    device, with what the wrapper returned. Where no replica ran (the wrapper's forward did not call its `module`),
    `run_in_replicas` returns `fallback(returned)`, and raises without a `fallback`.
    """

    def __init__(self, pairs: bool = False, fallback: Callable[[Any], Any] | None = None):
        self.results: list[Any] = []
        self.pairs, self.fallback = pairs, fallback
        self._lock = threading.Lock()

    def report(self, result: Any) -> Any:
        kept, shown = result if self.pairs else (result, None)
        with self._lock:
            self.results.append(kept)
        return shown if shown is not None else {}


def gather_reports(results: list[Any], device: torch.device | None) -> Any:
    """
    The replicas' results as torch's `gather` would hand them to `device` (None: where the first tensor is): tensors
    concatenated along dim 0 (0-dim ones stacked), dicts by key, NamedTuples and sequences field by field, None kept;
    through `.to(device)`, so gradients flow back to each replica. Replicas that ran one after another report in the
    order of their rows; threads report as they finish (training sums the terms, whatever their order).
    """
    first = results[0]
    if torch.is_tensor(first):
        target = device if device is not None else first.device
        moved = [result.to(target) for result in results]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved)
    if isinstance(first, dict):
        return type(first)(**{key: gather_reports([result[key] for result in results], device) for key in first})
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)._make(gather_reports(list(parts), device) for parts in zip(*results, strict=True))
    if isinstance(first, (tuple, list)):
        return type(first)(gather_reports(list(parts), device) for parts in zip(*results, strict=True))
    return first


class ReplicaStep(nn.Module):
    """
    What a DataParallel wrapper replicates for one call: the model, run by `step(model, inputs, labels)` on each
    replica's chunk, under autocast with `autocast_dtype` when given.

    Args:
        model (`nn.Module`):
            The wrapped model (its parameters are this module's).
        step (`Callable`):
            `step(model, inputs, labels)`: runs the model on a chunk and returns what the replica sends to GPU 0.
        label_keys (`tuple[str, ...]`, *optional*):
            The keyword arguments of a call that are labels, handed to `step` apart from the model's inputs.
        autocast_dtype (`torch.dtype`, *optional*):
            The autocast dtype of the model's forward (`None`: no autocast).
        device_type (`str`, *optional*, defaults to `"cuda"`):
            The device type the replicas compute on (autocast's first argument). Given, not read from the
            replica: torch's replicas have no parameters (`next(replica.parameters())` raises `StopIteration`).
        reporting (`Reporting`, *optional*):
            Where the replicas report their results, past a wrapper's own gather; None: they return them.
    """

    def __init__(
        self,
        model: nn.Module,
        step: Callable[[nn.Module, dict, dict], Any],
        label_keys: tuple[str, ...] = (),
        autocast_dtype: torch.dtype | None = None,
        device_type: str = "cuda",
        reporting: Reporting | None = None,
    ):
        super().__init__()
        self.model = model
        self.step = step
        self.label_keys = label_keys
        self.autocast_dtype = autocast_dtype
        self.device_type = device_type
        self.reporting = reporting  # shared by the replicas: torch copies a module's attributes shallowly

    def forward(self, **batch: Any) -> Any:
        labels = {key: batch.pop(key) for key in self.label_keys if key in batch}
        result = self.step(_Autocast(self.model, self.autocast_dtype, self.device_type), batch, labels)
        return result if self.reporting is None else self.reporting.report(result)


class _Autocast:
    """A callable that runs `model` under autocast with `dtype` on `device_type`; outputs in fp32."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, device_type: str):
        self.model, self.dtype, self.device_type = model, dtype, device_type

    def __call__(self, **inputs: Any) -> Any:
        if self.dtype is None:
            return self.model(**inputs)
        with torch.autocast(self.device_type, dtype=self.dtype):
            outputs = self.model(**inputs)
        # As accelerate does for a prepared model: downstream code (losses, metrics) sees fp32 outputs.
        return convert_to_fp32(outputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def replica_step(
    wrapper: nn.DataParallel,
    step: Callable[[nn.Module, dict, dict], Any],
    label_keys: tuple[str, ...] = (),
    autocast_dtype: torch.dtype | None = None,
    reporting: Reporting | None = None,
) -> ReplicaStep:
    """The `ReplicaStep` of `wrapper`'s model: its device type is that of the wrapper's devices."""
    if wrapper.device_ids:
        device_type = wrapper.src_device_obj.type
    else:  # no accelerator: the wrapper runs the model itself, where it is
        first = next(chain(wrapper.module.parameters(), wrapper.module.buffers()), None)
        device_type = first.device.type if first is not None else "cpu"
    return ReplicaStep(wrapper.module, step, label_keys, autocast_dtype, device_type, reporting)


def replica_autocast(mixed_precision: str | None) -> torch.dtype | None:
    """The autocast dtype of a replica for accelerate's `mixed_precision` ("no", "bf16", "fp16", ...)."""
    return AUTOCAST_DTYPES.get(str(mixed_precision))


def caller_autocast() -> torch.dtype | None:
    """The dtype of the autocast the caller runs under (CUDA's, else the CPU's), where a replica can take it; None."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            return dtype if dtype in AUTOCAST_DTYPES.values() else None
    return None


def stock_replica_precision(model: nn.Module, mixed_precision: str | None):
    """
    For the stock loss under DataParallel: accelerate's `mixed_precision` in every replica (`replica_precision`); a
    no-op for another model, or without mixed precision.
    """
    dtype = replica_autocast(mixed_precision)
    if dtype is None or not is_data_parallel(model):
        return contextlib.nullcontext()
    return replica_precision(model, dtype)


@contextlib.contextmanager
def replica_precision(wrapper: nn.DataParallel, autocast_dtype: torch.dtype) -> Iterator[None]:
    """
    Within the block, each call of `wrapper` runs its model's forward under autocast with `autocast_dtype` in every
    replica (the stock loss's forward, which computes no terms in the replicas).

    Only the call is changed, not `wrapper.module`: code around the call (transformers' `compute_loss`) unwraps the
    model to read its class name (the label smoother shifts the labels of a causal LM only), which must be the
    model's, not `ReplicaStep`'s.
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError(
                f"{type(wrapper).__name__} takes keyword inputs under mixed precision; got {len(args)} "
                "positional ones. Pass the batch as keywords: model(**inputs)."
            )
        step = replica_step(wrapper, lambda run, inputs, labels: run(**inputs), (), autocast_dtype)
        with temporarily(wrapper, "module", step):
            return type(wrapper).forward(wrapper, **kwargs)

    own = wrapper.__dict__.get("forward")  # an instance's own forward (rare), put back after the block
    wrapper.forward = forward
    try:
        yield
    finally:
        if own is None:
            del wrapper.forward
        else:
            wrapper.forward = own


def run_in_replicas(
    wrapper: nn.DataParallel,
    step: Callable[[nn.Module, dict, dict], Any],
    inputs: dict,
    labels: dict,
    autocast_dtype: torch.dtype | None = None,
    reporting: Reporting | None = None,
) -> Any:
    """
    Run `step(model, inputs, labels)` in every replica of `wrapper` on its chunk of `inputs` and `labels` (split
    alike), and return what the replicas returned, gathered on the output device as the wrapper gathers outputs.

    Args:
        wrapper (`nn.DataParallel`):
            The DataParallel wrapper (stock, balanced, simulated, or a subclass with a forward of its own).
        step (`Callable`):
            Runs in each replica: `step(model, inputs, labels)`, `model` being callable like the model, under
            autocast when `autocast_dtype` is given.
        inputs (`dict`):
            The model's keyword inputs.
        labels (`dict`):
            The labels (kept out of the model's inputs), split like the inputs.
        autocast_dtype (`torch.dtype`, *optional*):
            The dtype of the model's forward in the replicas.
        reporting (`Reporting`, *optional*):
            For a wrapper with a forward of its own, how its replicas report (`Reporting()` when not given); unused
            for torch's forward, which gathers the replicas' results as they are.
    """
    overlap = set(inputs) & set(labels)
    if overlap:
        raise ValueError(f"Keys {sorted(overlap)} are both model inputs and labels; pass each once.")
    # The wrapper replicates the step (around its model) instead of the model itself, for this call.
    reporting = None if gathers_as_torch(wrapper) else reporting or Reporting()
    with temporarily(wrapper, "module", replica_step(wrapper, step, tuple(labels), autocast_dtype, reporting)):
        returned = wrapper(**inputs, **labels)
    if reporting is None:
        return returned
    if not reporting.results:
        if reporting.fallback is None:
            raise RuntimeError(
                "The DataParallel wrapper's forward did not call its `module`, so no replica ran hf_parallel's step. "
                "Call self.module (or replicas of it) in the forward, or set exact_loss=False."
            )
        return reporting.fallback(returned)
    # Where torch's forward would gather: the wrapper's output device; without devices, where the first result is.
    device = torch.device(wrapper.src_device_obj.type, wrapper.output_device) if wrapper.device_ids else None
    gathered = gather_reports(reporting.results, device)
    return (gathered, returned) if reporting.pairs else gathered
