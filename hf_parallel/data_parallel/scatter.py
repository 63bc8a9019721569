"""
How a `DataParallel` call is split into one call per device: the structure walker and the row check.

A call's arguments are a structure of tensors and other objects (tuples, lists, dicts, namedtuples).
`scatter_structure` splits it into one piece per device the way torch's `scatter` walks it, with the tensor work
given as functions (`split` and `copy`: torch's `Scatter` and a copy per device); `batch_rows` checks first that
every tensor has the batch's rows.

Not torch's `scatter_kwargs` itself, for two reasons: it cannot take chunk sizes of our choosing (it splits like
`tensor.chunk`: 6 rows on 4 devices give [2, 2, 2], and `BalancedDataParallel` needs GPU 0's share), and it zips the
pieces without `strict`, so one tensor with fewer rows silently drops rows of every other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch

# Whether an object is a namedtuple instance (torch's `scatter` and `gather` rebuild those by field): accelerate's
# test is the same one (a tuple with `_asdict` and `_fields`); re-exported here under its old name.
from accelerate.utils import is_namedtuple

__all__ = ["batch_rows", "is_namedtuple", "scatter_structure"]


def _walk_tensors(obj: Any, path: str):
    """Yield `(path, tensor)` for every tensor in `obj`, visiting containers the way torch's `scatter` does."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif is_namedtuple(obj):
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
) -> list[Any]:
    """
    Split `obj` into `num_chunks` pieces, walking tuples, lists, dicts and namedtuples like torch's `scatter`:
    tensors with at least one dimension go through `split`, 0-dim tensors through `copy`, anything else is shared.

    Unlike torch's, every branch must give exactly `num_chunks` pieces (`zip(strict=True)`): a tensor that splits
    into fewer pieces raises instead of silently dropping rows (torch's own zip lets the shortest branch win). The
    caller validates sizes first.

    Args:
        obj (`Any`):
            A tensor, or containers of tensors and other objects.
        num_chunks (`int`):
            Pieces to make.
        split (`Callable`):
            Splits a tensor with at least one dimension into its pieces.
        copy (`Callable`):
            Gives a 0-dim tensor's pieces (one per chunk).

    Returns:
        `list`: one piece of `obj` per chunk.

    ```python
    import torch
    from hf_parallel.data_parallel.scatter import scatter_structure

    pieces = scatter_structure({"x": torch.arange(4), "note": "a"}, 2, lambda t: t.chunk(2), lambda t: [t, t])
    [p["x"].tolist() for p in pieces]  # [[0, 1], [2, 3]]
    ```
    """

    def walk(value):
        if isinstance(value, torch.Tensor):
            return list(copy(value) if value.dim() == 0 else split(value))
        if is_namedtuple(value):
            return [type(value)(*args) for args in zip(*map(walk, value), strict=True)]
        if isinstance(value, tuple) and len(value) > 0:
            return list(zip(*map(walk, value), strict=True))
        if isinstance(value, list) and len(value) > 0:
            return [list(i) for i in zip(*map(walk, value), strict=True)]
        if isinstance(value, dict) and len(value) > 0:
            return [type(value)(i) for i in zip(*map(walk, value.items()), strict=True)]
        return [value for _ in range(num_chunks)]

    return walk(obj)


def batch_rows(inputs: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> int | None:
    """
    The rows of a call's batch along `dim`, after checking that every tensor with a dimension has them.

    0-dim tensors and non-tensors are skipped (they are copied or shared, not split). A tensor with no dimension
    `dim`, or with another size along it, raises a `ValueError` naming it: torch's own `scatter_kwargs` would
    silently drop rows.

    Args:
        inputs (`tuple`):
            Positional arguments.
        kwargs (`dict`):
            Keyword arguments.
        dim (`int`):
            The batch dimension.

    Returns:
        `int` or `None`: the rows, or `None` when no tensor has a batch dimension.
    """
    batch_name, batch_size = None, None
    for path, tensor in chain(_walk_tensors(tuple(inputs), "inputs"), _walk_tensors(kwargs, "kwargs")):
        if tensor.dim() == 0:
            continue
        name = _display_name(path)
        if tensor.dim() <= dim:
            raise ValueError(
                f"{name} has {tensor.dim()} dimension(s), so no batch dimension dim={dim} to split along. "
                "Pass it as a 0-dim tensor to copy it to every device, or give it a batch dimension."
            )
        rows = tensor.size(dim)
        if batch_size is None:
            batch_name, batch_size = name, rows
        elif rows != batch_size:
            raise ValueError(
                f"{name} has {rows} rows along dim {dim} but the batch has {batch_size} (from {batch_name}). "
                f"BalancedDataParallel splits every tensor argument along dim {dim}; pass per-batch values as 0-dim "
                f"tensors or non-tensors.{_mismatch_hint(path)}"
            )
    return batch_size


def _mismatch_hint(path: str) -> str:
    if not path.endswith("['num_items_in_batch']"):
        return ""
    return (
        " The stock Trainer loss passes num_items_in_batch to models that accept loss kwargs as an [n_gpu, 1] tensor, "
        "one row per GPU, which a balanced split cannot follow. hf_parallel.Trainer with exact_loss=True (the "
        "default) does not pass it for the heads it computes exactly; for a model it cannot (it warns, naming it), "
        "unset gpu0_bsz/gpu0_weight."
    )


def _display_name(path: str) -> str:
    """`kwargs['input_ids']` -> `input_ids`; `inputs[0]` -> `positional argument 0`, for error messages."""
    if path.startswith("kwargs['"):
        end = path.index("']")
        return f"`{path[8:end]}{path[end + 2 :]}`"
    if path.startswith("inputs["):
        end = path.index("]")
        return f"positional argument {path[7:end]}" + (f" (`{path[end + 1 :]}`)" if path[end + 1 :] else "")
    return f"`{path}`"
