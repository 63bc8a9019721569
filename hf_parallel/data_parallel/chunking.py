"""
How many rows of a batch each `DataParallel` device gets, and which split evens out memory: plain arithmetic, no
torch.

`balanced_chunk_sizes` is the rule of `BalancedDataParallel`, `torch_chunk_sizes` what stock `nn.DataParallel`
does, `suggest_gpu0_bsz` the `gpu0_bsz` that evens out measured peak memory (`gpu0_balance`: whether any does), and
`check_split_options` the one check of the `gpu0_bsz` / `gpu0_weight` options.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

from ..launch.validation import check_whole_number

__all__ = [
    "Gpu0Balance",
    "balanced_chunk_sizes",
    "check_split_options",
    "gpu0_balance",
    "suggest_gpu0_bsz",
    "torch_chunk_sizes",
]


def check_split_options(gpu0_bsz: int | None, gpu0_weight: float | None) -> None:
    """
    Check the DataParallel split options, the one check behind `BalancedDataParallel`, `balanced_chunk_sizes` and
    `TrainingArguments`: at most one of them, `gpu0_bsz` a whole number >= 0, `gpu0_weight` a number in [0, 1].

    Args:
        gpu0_bsz (`int`, *optional*):
            Most rows GPU 0 may get.
        gpu0_weight (`float`, *optional*):
            GPU 0's share relative to each other GPU's.

    Raises:
        `ValueError`: naming the option, its value and the allowed values.

    ```python
    from hf_parallel.data_parallel.chunking import check_split_options

    check_split_options(gpu0_bsz=4, gpu0_weight=None)  # passes
    ```
    """
    if gpu0_bsz is not None and gpu0_weight is not None:
        raise ValueError(
            f"Set at most one of gpu0_bsz ({gpu0_bsz}) and gpu0_weight ({gpu0_weight}): gpu0_bsz fixes GPU 0's "
            "rows, gpu0_weight its share relative to each other GPU."
        )
    if gpu0_bsz is not None:
        check_whole_number("gpu0_bsz", gpu0_bsz, 0)
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
    check_whole_number("batch_size", batch_size, 0)
    check_whole_number("num_devices", num_devices, 1)
    check_split_options(gpu0_bsz, gpu0_weight)
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
    from hf_parallel.data_parallel.chunking import torch_chunk_sizes

    torch_chunk_sizes(6, 4)  # [2, 2, 2]
    ```
    """
    check_whole_number("batch_size", batch_size, 0)
    check_whole_number("num_devices", num_devices, 1)
    if batch_size == 0:
        # torch.empty(0).chunk(k) gives k empty chunks.
        return [0] * num_devices
    step = -(-batch_size // num_devices)
    return [min(step, batch_size - start) for start in range(0, batch_size, step)]


class Gpu0Balance(NamedTuple):
    """
    The split that evens out peak memory across GPUs under the linear memory model of `gpu0_balance`.

    Args:
        rows (`float`):
            GPU 0's rows that equalise its peak and the mean of the others, unrounded and unclamped: below 0 when
            even `gpu0_bsz=0` leaves GPU 0 the highest, above the even share when GPU 0 is not the highest.
        gpu0_empty (`float`):
            GPU 0's predicted peak with no rows (`gpu0_bsz=0`): its fixed part.
        others_full (`float`):
            The other GPUs' predicted mean peak when they share the whole batch.
    """

    rows: float
    gpu0_empty: float
    others_full: float


def gpu0_balance(peak_memory: Sequence[float], chunk_sizes: Sequence[int], static_memory: float = 0.0) -> Gpu0Balance:
    """
    The rows of GPU 0 that even out peak memory across GPUs, from the peaks measured under a known split, unclamped,
    with the peaks predicted at `gpu0_bsz=0`: what `suggest_gpu0_bsz` rounds and clamps, and what tells whether any
    `gpu0_bsz` evens the load at all.

    The model: each GPU's peak is a constant part plus a per-row part that is the same on every GPU; GPU 0's
    constant part is larger (master weights, gradients, optimizer state, gathered outputs, the loss). The per-row
    cost `c` is estimated on the other GPUs as `(mean peak - static_memory) / mean rows`, where `static_memory` is
    the part of their peak that does not grow with rows (at least the replica's weights). GPU 0 with `g` rows then
    peaks at `peak_0 + c * (g - rows_0)`, and the others, sharing the rest, at their mean peak plus `c` times their
    change in mean rows. `rows` is the `g` where the two meet. It is below 0 exactly when `gpu0_empty` is above
    `others_full`: GPU 0's fixed part alone is above what the others reach with the whole batch, so no `gpu0_bsz`
    evens the load.

    Args:
        peak_memory (`Sequence[float]`):
            As in `suggest_gpu0_bsz`: each GPU's peak, GPU 0 first.
        chunk_sizes (`Sequence[int]`):
            As in `suggest_gpu0_bsz`: each GPU's rows when the peaks were measured.
        static_memory (`float`, *optional*, defaults to `0.0`):
            As in `suggest_gpu0_bsz`: the other GPUs' memory that does not grow with rows.

    Returns:
        `Gpu0Balance`: `rows`, `gpu0_empty` and `others_full`, in the unit of `peak_memory`.

    Raises:
        `ValueError`: for measurements that do not fit the model (lengths, values, no rows on the other GPUs, a
        `static_memory` not below their peak), naming the values.

    ```python
    from hf_parallel.data_parallel.chunking import gpu0_balance

    # 32 rows split [8, 8, 8, 8]: GPU 0 peaks at 70 GB, the others at 30 GB, of which 10 GB are the weights.
    gpu0_balance([70e9, 30e9, 30e9, 30e9], [8, 8, 8, 8], static_memory=10e9)
    # rows -4.0: with no rows GPU 0 would still peak at 50 GB, the others at about 36.7 GB with all 32 rows
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
    return Gpu0Balance(
        rows=(batch_size + (n - 1) * ((other_peak - peaks[0]) / per_row - (other_rows - rows[0]))) / n,
        gpu0_empty=peaks[0] - per_row * rows[0],
        others_full=other_peak + per_row * (batch_size / (n - 1) - other_rows),
    )


def suggest_gpu0_bsz(peak_memory: Sequence[float], chunk_sizes: Sequence[int], static_memory: float = 0.0) -> int:
    """
    The `gpu0_bsz` that evens out peak memory across GPUs, from the peaks measured under a known split: the rows of
    `gpu0_balance` (see its memory model), rounded down and kept within `[0, batch // n]`; the largest value means
    no `gpu0_bsz` is needed.

    When even `gpu0_bsz=0` leaves GPU 0 the highest, no value evens the load: GPU 0's fixed part (weights,
    gradients, optimizer state) is the limit, not its rows. The result is then 0, the closest there is, but it does
    not even the load out; `gpu0_balance(...).rows < 0` tells this case apart, and its `gpu0_empty` and
    `others_full` say by how much.

    With `static_memory` below the true constant part (the default 0 is the extreme), the per-row cost is
    overestimated and the suggestion moves fewer rows off GPU 0 than needed: it errs towards the current split.

    Args:
        peak_memory (`Sequence[float]`):
            Peak memory of each GPU, GPU 0 first (bytes, or any unit used throughout).
        chunk_sizes (`Sequence[int]`):
            Rows each GPU had per batch when the peaks were measured (same length).
        static_memory (`float`, *optional*, defaults to `0.0`):
            Memory of a GPU other than GPU 0 that does not depend on its rows, e.g. the model's parameter bytes.

    Returns:
        `int`: the suggested `gpu0_bsz` for batches of `sum(chunk_sizes)` rows.

    ```python
    from hf_parallel.data_parallel.chunking import suggest_gpu0_bsz

    # 32 rows split [16, 16]: GPU 0 peaks at 20 GB, GPU 1 at 12 GB, of which 4 GB are the weights.
    suggest_gpu0_bsz([20e9, 12e9], [16, 16], static_memory=4e9)  # 8: both would then peak at 16 GB
    ```
    """
    balance = gpu0_balance(peak_memory, chunk_sizes, static_memory)
    batch_size, n = sum(chunk_sizes), len(chunk_sizes)
    # A hair of tolerance, so that an exact balance is not floored one row short by float rounding.
    return max(0, min(batch_size // n, math.floor(balance.rows + 1e-9)))
