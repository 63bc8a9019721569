"""
Balanced `nn.DataParallel`: GPU 0 gets a smaller share of each batch.

Under `nn.DataParallel`, GPU 0 holds the master weights, the gradients, the optimizer state and the gathered outputs
(and, with the exact loss, computes the loss on them), so with an even split it runs out of memory first while the
other GPUs sit partly empty. `BalancedDataParallel` gives GPU 0 fewer rows (`gpu0_bsz`, or a relative
`gpu0_weight`) and spreads the rest over the other GPUs.

The public versions of this class (transformer-xl's and its copies) use `unit = (bsz - gpu0_bsz) // (n - 1)` and
break on ordinary inputs: one device (`ZeroDivisionError`), `model(**batch)` (`IndexError`), a 0-dim tensor or the
Trainer's `[n_gpu, 1]` `num_items_in_batch` (`quit()`), and they give GPU 0 *more* than `gpu0_bsz` in some cases,
e.g. 10 rows, 3 GPUs, `gpu0_bsz=3` -> `[4, 4, 2]`. The rule here is in `balanced_chunk_sizes`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import parallel_apply
from torch.nn.parallel._functions import Scatter

__all__ = ["BalancedDataParallel", "balanced_chunk_sizes", "suggest_gpu0_bsz", "torch_chunk_sizes"]


def _check_split_options(gpu0_bsz: int | None, gpu0_weight: float | None) -> None:
    if gpu0_bsz is not None and gpu0_weight is not None:
        raise ValueError(
            f"Set at most one of gpu0_bsz ({gpu0_bsz}) and gpu0_weight ({gpu0_weight}): gpu0_bsz fixes GPU 0's "
            "rows, gpu0_weight its share relative to each other GPU."
        )
    if gpu0_bsz is not None:
        if isinstance(gpu0_bsz, bool) or not isinstance(gpu0_bsz, int):
            raise ValueError(f"gpu0_bsz must be a whole number of rows, got {gpu0_bsz!r}.")
        if gpu0_bsz < 0:
            raise ValueError(f"gpu0_bsz must be >= 0 (0 keeps GPU 0 for gathering only), got {gpu0_bsz}.")
    if gpu0_weight is not None:
        if isinstance(gpu0_weight, bool) or not isinstance(gpu0_weight, (int, float)):
            raise ValueError(f"gpu0_weight must be a number in [0, 1], got {gpu0_weight!r}.")
        if not math.isfinite(gpu0_weight) or not 0 <= gpu0_weight <= 1:
            raise ValueError(
                "gpu0_weight must be a finite number in [0, 1] (GPU 0's share relative to each other GPU; 1 is an "
                f"even split), got {gpu0_weight}."
            )


def balanced_chunk_sizes(
    batch_size: int, num_devices: int, gpu0_bsz: int | None = None, gpu0_weight: float | None = None
) -> list[int]:
    """
    Rows of a batch given to each device, GPU 0 first, when GPU 0 should get fewer rows than the others.

    GPU 0 gets `min(gpu0_bsz, floor(batch_size * w / (w + num_devices - 1)), batch_size // num_devices)` rows (the
    terms for the options not set are left out), so never more than `gpu0_bsz` and never more than its even share.
    The other devices share the rest and differ by at most one row, the extra rows going to the lower indices. The
    sizes sum to `batch_size` and none is negative. One device takes the whole batch whatever the options. Without
    either option the split is even (GPU 0 gets `batch_size // num_devices`).

    `gpu0_bsz` above GPU 0's even share is not an error here: the last batch of an epoch is often smaller than the
    others, and GPU 0 then simply gets its even share of it.

    Args:
        batch_size (`int`):
            Rows in the batch (>= 0).
        num_devices (`int`):
            Devices to split over (>= 1).
        gpu0_bsz (`int`, *optional*):
            Most rows GPU 0 may get (>= 0).
        gpu0_weight (`float`, *optional*):
            GPU 0's share relative to each other device's, in [0, 1]. Set at most one of the two options.

    Returns:
        `list[int]`: `num_devices` row counts, GPU 0 first.

    ```python
    from hf_parallel import balanced_chunk_sizes

    balanced_chunk_sizes(52, 3, gpu0_bsz=16)  # [16, 18, 18]
    balanced_chunk_sizes(53, 3, gpu0_bsz=16)  # [16, 19, 18]
    balanced_chunk_sizes(10, 3, gpu0_weight=0.5)  # [2, 4, 4]
    ```
    """
    for name, value, low in (("batch_size", batch_size, 0), ("num_devices", num_devices, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}.")
    _check_split_options(gpu0_bsz, gpu0_weight)
    if num_devices == 1:
        return [batch_size]
    gpu0 = batch_size // num_devices
    if gpu0_bsz is not None:
        gpu0 = min(gpu0, gpu0_bsz)
    if gpu0_weight is not None:
        # Exact rational arithmetic on the decimal the user wrote (repr), so 0.3 means 3/10 and a split that is
        # exact on paper is not floored one row short by binary rounding.
        weight = Fraction(repr(float(gpu0_weight)))
        gpu0 = min(gpu0, math.floor(batch_size * weight / (weight + num_devices - 1)))
    unit, extra = divmod(batch_size - gpu0, num_devices - 1)
    return [gpu0] + [unit + 1] * extra + [unit] * (num_devices - 1 - extra)


def torch_chunk_sizes(batch_size: int, num_devices: int) -> list[int]:
    """
    Rows per device that stock `nn.DataParallel` gives a batch: `tensor.chunk` semantics, which can use fewer
    devices than it has (6 rows on 4 devices -> `[2, 2, 2]`; 5 rows on 4 -> `[2, 2, 1]`).

    Args:
        batch_size (`int`):
            Rows in the batch (>= 0).
        num_devices (`int`):
            Devices available (>= 1).

    Returns:
        `list[int]`: one row count per device that gets a chunk.

    ```python
    from hf_parallel.data_parallel import torch_chunk_sizes

    torch_chunk_sizes(6, 4)  # [2, 2, 2]
    ```
    """
    for name, value, low in (("batch_size", batch_size, 0), ("num_devices", num_devices, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}.")
    if batch_size == 0:
        # torch.empty(0).chunk(k) gives k empty chunks.
        return [0] * num_devices
    step = -(-batch_size // num_devices)
    return [min(step, batch_size - start) for start in range(0, batch_size, step)]


def suggest_gpu0_bsz(peak_memory: Sequence[float], chunk_sizes: Sequence[int], static_memory: float = 0.0) -> int:
    """
    The `gpu0_bsz` that evens out peak memory across GPUs, from the peaks measured under a known split.

    The model: each GPU's peak is a constant part plus a per-row part that is the same on every GPU; GPU 0's
    constant part is larger (master weights, gradients, optimizer state, gathered outputs, the loss). The per-row
    cost is estimated on the other GPUs as `(mean peak - static_memory) / mean rows`, where `static_memory` is the
    part of their peak that does not grow with rows (at least the replica's weights). Then GPU 0 gets the rows `g`
    that equalise `peak_0 + cost * (g - rows_0)` and the mean of the others once they share the rest, rounded down
    and kept within `[0, batch // n]`; the largest `g` means no `gpu0_bsz` is needed.

    With `static_memory` below the true constant part (the default 0 is the extreme), the per-row cost is
    overestimated and the suggestion moves fewer rows off GPU 0 than needed: it errs towards the current split.

    Args:
        peak_memory (`Sequence[float]`):
            Peak memory of each GPU, GPU 0 first (bytes, or any unit used throughout).
        chunk_sizes (`Sequence[int]`):
            Rows each GPU had per batch when the peaks were measured (same length).
        static_memory (`float`, *optional*, defaults to 0):
            Memory of a GPU other than GPU 0 that does not depend on its rows, e.g. the model's parameter bytes.

    Returns:
        `int`: the suggested `gpu0_bsz` for batches of `sum(chunk_sizes)` rows.

    ```python
    from hf_parallel.data_parallel import suggest_gpu0_bsz

    # 32 rows split [16, 16]: GPU 0 peaks at 20 GB, GPU 1 at 12 GB, of which 4 GB are the weights.
    suggest_gpu0_bsz([20e9, 12e9], [16, 16], static_memory=4e9)  # 8: both would then peak at 16 GB
    ```
    """
    peaks, rows = list(peak_memory), list(chunk_sizes)
    if len(peaks) != len(rows) or len(peaks) < 2:
        raise ValueError(
            f"Give one peak and one row count per GPU, at least two GPUs: got {len(peaks)} peaks and {len(rows)} "
            "row counts."
        )
    if any(isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p < 0 for p in peaks):
        raise ValueError(f"peak_memory must hold finite numbers >= 0, got {peaks}.")
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in rows):
        raise ValueError(f"chunk_sizes must hold whole numbers >= 0, got {rows}.")
    if not math.isfinite(static_memory) or static_memory < 0:
        raise ValueError(f"static_memory must be a finite number >= 0, got {static_memory}.")
    n = len(peaks)
    batch_size = sum(rows)
    other_rows = sum(rows[1:]) / (n - 1)
    other_peak = sum(peaks[1:]) / (n - 1)
    if other_rows == 0:
        raise ValueError(
            f"The GPUs other than GPU 0 had no rows ({rows}), so the memory cost of a row cannot be measured on them."
        )
    per_row = (other_peak - static_memory) / other_rows
    if per_row <= 0:
        raise ValueError(
            f"The other GPUs' mean peak ({other_peak:.4g}) is not above static_memory ({static_memory:.4g}), so "
            "the memory cost of a row cannot be measured: lower static_memory."
        )
    best = (batch_size + (n - 1) * ((other_peak - peaks[0]) / per_row - (other_rows - rows[0]))) / n
    # A hair of tolerance, so that an exact balance is not floored one row short by float rounding.
    return max(0, min(batch_size // n, math.floor(best + 1e-9)))


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _walk_tensors(obj: Any, path: str):
    """Yield `(path, tensor)` for every tensor in `obj`, visiting containers the way torch's `scatter` does."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif _is_namedtuple(obj):
        for field_name, value in zip(obj._fields, obj, strict=True):
            yield from _walk_tensors(value, f"{path}.{field_name}")
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from _walk_tensors(value, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk_tensors(value, f"{path}[{key!r}]")


def scatter_structure(
    obj: Any,
    num_chunks: int,
    split: Callable[[torch.Tensor], Sequence[Any]],
    copy: Callable[[Any], Sequence[Any]],
    strict: bool = True,
) -> list[Any]:
    """
    Split `obj` into `num_chunks` pieces, walking tuples, lists, dicts and namedtuples like torch's `scatter`:
    tensors with at least one dimension go through `split`, 0-dim tensors through `copy`, anything else is shared.

    Unlike torch's, every branch must by default give exactly `num_chunks` pieces (`zip(strict=True)`): a tensor
    that splits into fewer pieces raises instead of silently dropping rows. The caller validates sizes first.
    `strict=False` is torch's own behaviour (the shortest branch wins), which the CPU simulation reproduces.
    """

    def walk(value):
        if isinstance(value, torch.Tensor):
            pieces = copy(value) if value.dim() == 0 else split(value)
            return list(pieces)
        if _is_namedtuple(value):
            return [type(value)(*args) for args in zip(*map(walk, value), strict=strict)]
        if isinstance(value, tuple) and len(value) > 0:
            return list(zip(*map(walk, value), strict=strict))
        if isinstance(value, list) and len(value) > 0:
            return [list(i) for i in zip(*map(walk, value), strict=strict)]
        if isinstance(value, dict) and len(value) > 0:
            return [type(value)(i) for i in zip(*map(walk, value.items()), strict=strict)]
        return [value for _ in range(num_chunks)]

    return walk(obj)


class BalancedDataParallel(nn.DataParallel):
    """
    `nn.DataParallel` that gives GPU 0 fewer rows of each batch than the other GPUs.

    GPU 0 also gathers the outputs and computes the loss, so with an even split it fills up first. Here it gets
    at most `gpu0_bsz` rows (or `gpu0_weight` times another GPU's share), never more than its even share; the
    other GPUs share the rest and differ by at most one row (see `balanced_chunk_sizes`).

    Inputs: positional and keyword arguments (`model(**batch)`) are both split along `dim`. `None`, bools and other
    non-tensors are passed to every device as they are, 0-dim tensors are copied to every device. Any other tensor
    must have the batch size along `dim`: a tensor with another size raises a `ValueError` naming it (torch's own
    `scatter_kwargs` silently drops rows in that case). A device whose share is 0 rows is not used; when that is
    GPU 0, it still holds the master copy of the model and gathers the outputs. An empty batch, or a call without any
    tensor that has a batch dimension, runs once on GPU 0. With one device (or none), it behaves exactly as
    `nn.DataParallel`.

    Attributes the wrapper does not have are looked up on the wrapped model, so `save_pretrained`, `config` and
    `generate` work on the wrapper (they act on the wrapped model, on one device).

    Args:
        module (`nn.Module`):
            The model, its parameters on `device_ids[0]`.
        device_ids (`list[int]`, *optional*):
            CUDA devices, GPU 0 first (defaults to all).
        output_device (`int`, *optional*):
            Where outputs are gathered (defaults to `device_ids[0]`).
        dim (`int`, *optional*, defaults to 0):
            Batch dimension of the inputs.
        gpu0_bsz (`int`, *optional*):
            Most rows GPU 0 gets from each batch.
        gpu0_weight (`float`, *optional*):
            GPU 0's share relative to each other GPU's, in [0, 1]. Set at most one of the two; with neither the
            split is even (GPU 0 never gets more than another GPU).

    The source document's form, `BalancedDataParallel(gpu0_bsz, model, dim=0)`, works too.

    ```python
    from hf_parallel import BalancedDataParallel

    model = BalancedDataParallel(model.cuda(), gpu0_bsz=8)  # 8 rows on GPU 0, the rest spread over the others
    outputs = model(**batch)
    model.save_pretrained("out")  # saves the wrapped model, without a `module.` prefix
    ```
    """

    def __init__(self, *args: Any, gpu0_bsz: int | None = None, gpu0_weight: float | None = None, **kwargs: Any):
        # The source document's form: BalancedDataParallel(gpu0_bsz, model, ...).
        if (
            args
            and not isinstance(args[0], nn.Module)
            and ("module" in kwargs or (len(args) > 1 and isinstance(args[1], nn.Module)))
        ):
            if gpu0_bsz is not None:
                raise ValueError(
                    f"gpu0_bsz given twice: {args[0]!r} as the first argument and {gpu0_bsz!r} by name. Use "
                    "BalancedDataParallel(model, gpu0_bsz=...)."
                )
            gpu0_bsz, args = args[0], args[1:]
        module = args[0] if args else kwargs.get("module")
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"BalancedDataParallel wraps an nn.Module, got {type(module).__name__}. Use "
                "BalancedDataParallel(model, gpu0_bsz=...)."
            )
        _check_split_options(gpu0_bsz, gpu0_weight)
        super().__init__(*args, **kwargs)
        self.gpu0_bsz = gpu0_bsz
        self.gpu0_weight = gpu0_weight

    def __getattr__(self, name: str) -> Any:
        # nn.Module.__getattr__ only runs when normal lookup fails; it finds parameters, buffers and submodules.
        # Anything else falls through to the wrapped model (`save_pretrained`, `config`, `generate`), which
        # nn.DataParallel does not do: `nn.DataParallel(model).save_pretrained(...)` raises AttributeError.
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def chunk_sizes(self, batch_size: int) -> list[int]:
        """Rows of a batch of `batch_size` rows given to each entry of `device_ids`."""
        return balanced_chunk_sizes(batch_size, len(self.device_ids), self.gpu0_bsz, self.gpu0_weight)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.device_ids) <= 1:
            return super().forward(*inputs, **kwargs)
        with torch.autograd.profiler.record_function("BalancedDataParallel.forward"):
            self._check_module_device()
            positions, sizes = self._plan(inputs, kwargs)
            device_ids = [self.device_ids[p] for p in positions]
            inputs, module_kwargs = self._scatter_chunks(inputs, kwargs, device_ids, sizes)
            if positions[0] != 0:
                # GPU 0 gets no rows but keeps the master copy: replicate from it and drop its replica (torch's
                # broadcast needs the source tensors on the first device of the list).
                replicas = self.replicate(self.module, [self.device_ids[0], *device_ids])[1:]
            else:
                replicas = self.replicate(self.module, device_ids)
            outputs = self.parallel_apply(replicas, inputs, module_kwargs, device_ids)
            return self.gather(outputs, self.output_device)

    def parallel_apply(
        self,
        replicas: Sequence[nn.Module],
        inputs: Sequence[Any],
        kwargs: Any,
        device_ids: Sequence[int] | None = None,
    ) -> list[Any]:
        # nn.DataParallel runs replica i on device_ids[i]; with skipped devices the used ids are passed explicitly.
        if device_ids is None:
            device_ids = self.device_ids[: len(replicas)]
        return parallel_apply(replicas, inputs, kwargs, device_ids)

    def _check_module_device(self) -> None:
        for t in chain(self.module.parameters(), self.module.buffers()):
            if t.device != self.src_device_obj:
                raise RuntimeError(
                    f"module must have its parameters and buffers on device {self.src_device_obj} "
                    f"(device_ids[0]) but found one of them on device: {t.device}"
                )

    def _plan(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
        """
        Validate the inputs and split the batch: `(positions, chunk_sizes)`, positions indexing `device_ids` and
        leaving out the devices that get no rows.
        """
        tensors = chain(_walk_tensors(tuple(inputs), "inputs"), _walk_tensors(kwargs, "kwargs"))
        batch_name, batch_size = None, None
        for path, tensor in tensors:
            if tensor.dim() == 0:
                continue
            name = _display_name(path)
            if tensor.dim() <= self.dim:
                raise ValueError(
                    f"{name} has {tensor.dim()} dimension(s), so no batch dimension dim={self.dim} to split along. "
                    "Pass it as a 0-dim tensor to copy it to every device, or give it a batch dimension."
                )
            rows = tensor.size(self.dim)
            if batch_size is None:
                batch_name, batch_size = name, rows
            elif rows != batch_size:
                hint = ""
                if path.endswith("['num_items_in_batch']"):
                    hint = (
                        " The stock Trainer loss passes num_items_in_batch to models that accept loss kwargs as an "
                        "[n_gpu, 1] tensor, one row per GPU, which a balanced split cannot follow. "
                        "hf_parallel.Trainer with exact_loss=True (the default) does not pass it for the heads it "
                        "computes exactly; for "
                        "a model it cannot (it warns, naming it), unset gpu0_bsz/gpu0_weight."
                    )
                raise ValueError(
                    f"{name} has {rows} rows along dim {self.dim} but the batch has {batch_size} (from "
                    f"{batch_name}). BalancedDataParallel splits every tensor argument along dim {self.dim}; pass "
                    f"per-batch values as 0-dim tensors or non-tensors.{hint}"
                )
        if not batch_size:
            # Nothing to split (an empty batch, or no tensor with a batch dimension): run once, on GPU 0, as on one
            # device. Stock would run every device on a copy of the call (and fail on a 0-dim tensor).
            return [0], [0]
        sizes = self.chunk_sizes(batch_size)
        positions = [p for p, size in enumerate(sizes) if size > 0]
        return positions, [sizes[p] for p in positions]

    def _scatter_chunks(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], device_ids: Sequence[int], chunk_sizes: Sequence[int]
    ) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
        """
        Send the chunks to their devices: tensors split along `dim` with `chunk_sizes`, 0-dim tensors copied,
        the rest shared. The one place that moves data, so `hf_parallel.testing` can swap in its CPU version.
        """
        device_type = self.src_device_obj.type

        def split(tensor):
            return Scatter.apply(list(device_ids), list(chunk_sizes), self.dim, tensor)

        def copy(tensor):
            return [tensor.to(torch.device(device_type, d)) for d in device_ids]

        return _scatter_inputs(inputs, kwargs, len(device_ids), split, copy)


def _scatter_inputs(inputs, kwargs, num_chunks, split, copy):
    scattered_inputs = scatter_structure(tuple(inputs), num_chunks, split, copy) if inputs else []
    scattered_kwargs = scatter_structure(kwargs, num_chunks, split, copy) if kwargs else []
    scattered_inputs = scattered_inputs or [() for _ in range(num_chunks)]
    scattered_kwargs = scattered_kwargs or [{} for _ in range(num_chunks)]
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def _display_name(path: str) -> str:
    """`kwargs['input_ids']` -> `input_ids`; `inputs[0]` -> `positional argument 0`, for error messages."""
    if path.startswith("kwargs['"):
        end = path.index("']")
        return f"`{path[8:end]}{path[end + 2 :]}`"
    if path.startswith("inputs["):
        end = path.index("]")
        return f"positional argument {path[7:end]}" + (f" (`{path[end + 1 :]}`)" if path[end + 1 :] else "")
    return f"`{path}`"
