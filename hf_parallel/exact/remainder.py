"""
The last step of an epoch under DDP: which rows of it are real.

When an epoch's length is not a multiple of the global batch, accelerate (`even_batches=True`, its default) completes
the last global batch with rows from the start of the epoch, so that every rank gets a full batch. Those duplicates
must add nothing to the loss sums, the item count or the gradient, or the last step is not what one device computes
on the leftover rows. accelerate knows how many rows of that last global batch are real (its `remainder`); ranks hold
consecutive slices of it, real rows first, so rank r's batch of b rows starts with `clamp(remainder - r * b, 0, b)`
real rows. That holds for map-style datasets (the remainder is the dataset length modulo the global batch) and for
iterable ones whose batches rank 0 dispatches (the remainder is the size of the last batch it read). For iterable
datasets each rank reads itself (`dispatch_batches=False`) accelerate does not know it, and the samples are counted
instead (`hf_parallel.exact.streams`); without that count (dataloader worker processes) they train as stock does.

The step keeps how many leading samples of each padded micro-batch are real (`StepCounts.real_rows`; an evaluation
batch's is handed to its loss): the counts and sums take those samples only. The batches themselves carry no mark.

A packed batch (`DataCollatorWithFlattening`: one row holding several sequences, each restarting its
`position_ids` at 0) is a batch of samples too: its samples are told apart by their position ids, so that padding
and evaluation's duplicate removal work on samples, not on the one row.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import DistributedSampler

from ..upstream import temporarily
from .heads import IGNORE_INDEX
from .heads.base import packed_sample_ids, sample_ids_of
from .heads.contrastive import rows_of
from .streams import count_samples, stream_remainder

__all__ = [
    "TARGET_KEYS",
    "EpochEnd",
    "LoopPadding",
    "epoch_end",
    "first_rows",
    "padded_rows",
    "mask_padding",
    "packed_sample_ids",
    "real_rows",
    "ragged_gathers",
    "real_batches",
    "real_samples",
    "row_mask",
    "sample_ids_of",
    "samples_in",
]

#: The cross-entropy targets a padding row is masked in.
TARGET_KEYS = ("labels", "shift_labels")


@dataclass(frozen=True)
class EpochEnd:
    """The dataloader reached the end of the epoch with the last pulled batch; `remainder` as accelerate reports it
    (rows of the last global batch that are real; 0: none padded; -1: unknown), or as counted for an iterable dataset
    each rank reads itself (`counted`: then the last batch is padded whenever `remainder > 0`, whatever
    `even_batches` and `dataloader_drop_last` say, as the Trainer does not pass the latter to such a dataloader)."""

    remainder: int
    counted: bool = False


def epoch_end(gradient_state) -> EpochEnd | None:
    """Whether the batch accelerate's active dataloader gave last ends its epoch, and how much of it is real."""
    if not gradient_state.end_of_dataloader:
        return None
    counted = stream_remainder(gradient_state)
    return EpochEnd(gradient_state.remainder, False) if counted is None else EpochEnd(counted, True)


def real_rows(rows: int, remainder: int, process_index: int) -> int | None:
    """
    How many leading rows of this rank's last batch (of `rows` rows) are real, or None when none is padding or it
    cannot be known (`remainder` 0 or -1).

    ```python
    from hf_parallel.exact.remainder import real_rows

    # 10 rows, 2 ranks x 4 rows: the last global batch holds rows 8 and 9, then 6 duplicates.
    real_rows(4, remainder=2, process_index=0), real_rows(4, remainder=2, process_index=1)  # (2, 0)
    ```
    """
    if remainder <= 0:
        return None
    return max(0, min(rows, remainder - process_index * rows))


def first_rows(batch: dict, keys: tuple[str, ...], count: int) -> dict:
    """The entries `keys` of `batch` (those present), cut to their first `count` rows."""
    return {key: batch[key][:count] for key in keys if key in batch}


def mask_padding(labels: dict, keys: tuple[str, ...], real: int, sample_ids: torch.Tensor | None) -> dict:
    """
    `labels` with the targets of every padding sample set to the ignore index (-100): the rows from `real` on, or
    the positions of a packed row whose sample index (`sample_ids`) is `real` or more. Only `keys` are masked (the
    cross-entropy targets: `labels`, `shift_labels`); the tensors are copies.
    """
    masked = dict(labels)
    for key in keys:
        target = labels.get(key)
        if not torch.is_tensor(target):
            continue
        if sample_ids is None:
            padding = row_mask(target.shape[0], real, target.device).logical_not()
            padding = padding.reshape(-1, *([1] * (target.dim() - 1)))
        else:
            padding = sample_ids.to(target.device).ge(real).reshape(target.shape)
        masked[key] = target.masked_fill(padding, IGNORE_INDEX)
    return masked


def real_samples(head, batch: dict, real: int, cut: bool = False) -> dict:
    """
    `batch` without the padding samples of an epoch's last step, for a loss computed on the batch as it is (a Trainer
    subclass's own): a cross-entropy's padding targets ignored (its rows cut too, with `cut`); for any other head
    every tensor whose rows are the samples cut to its first `real` (a preference batch, `rows_per_sample` 2, the first
    `real` rows of each half). A batch of padding alone stays whole, unless `cut` (to count its items: none): its
    forward must still run (DDP's gradient hooks).
    """
    if head.ignore_index_items and not cut:
        return mask_padding(batch, TARGET_KEYS, real, sample_ids_of(head, batch))
    per = head.rows_per_sample
    samples = rows_of(batch) // per
    if real >= samples or (real == 0 and not cut):
        return batch

    def cut(value):
        if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] not in (samples, samples * per):
            return value
        return torch.cat([part[:real] for part in value.split(samples)])

    return {key: cut(value) for key, value in batch.items()}


def real_batches(head, batches: list[dict], real_rows: tuple[int | None, ...] = ()) -> list[dict]:
    """`batches` cut to their real samples (`real_samples`, rows cut; `real_rows` per batch, none padded where empty);
    a batch of an epoch's repeated samples alone dropped."""
    real = []
    for batch, rows in zip(batches, real_rows or (None,) * len(batches), strict=True):
        if rows is None or rows > 0:
            real.append(batch if rows is None else real_samples(head, batch, rows, cut=True))
    return real


@contextlib.contextmanager
def ragged_gathers(accelerator, padding: bool = False):
    """
    Within, `accelerator.gather` (and `gather_for_metrics`, which calls it) takes tensors whose rows differ between
    ranks, keeping each rank's rows once, in rank order: a subclass's own metrics gather its batch's rows, and a batch
    cut to its real samples on some ranks (`real_samples`) would otherwise stop gloo ("Received data size doesn't
    match expected size"). With `padding` (this rank's batch is all repeated samples, kept whole for its forward), this
    rank adds nothing to a gather, a single value (a batch's mean) included. One more small collective per gather; used
    on an epoch's last batch only.
    """
    gather = accelerator.gather

    def ragged(tensor):
        if not torch.is_tensor(tensor):
            return gather(tensor)
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        if padding:
            tensor = tensor[:0]
        sizes = gather(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
        padded = accelerator.pad_across_processes(tensor, dim=0)
        parts = gather(padded).split(padded.shape[0])
        return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])

    with temporarily(accelerator, "gather", ragged):
        yield


def row_mask(rows: int, real: int, device: torch.device) -> torch.Tensor:
    """`[rows, 1]`: 1 for the first `real` rows, 0 for the padding after them."""
    return (torch.arange(rows, device=device) < real).unsqueeze(-1)


def samples_in(batch: dict, label_key: str, sample_ids: torch.Tensor | None) -> int:
    """How many samples a batch holds: its rows, or the sequences of a packed row."""
    return int(sample_ids.max()) + 1 if sample_ids is not None else len(batch[label_key])


def padded_rows(
    head, batches: list[dict], end: EpochEnd | None, process_index: int, pads: bool, warn_once: Callable[[str], None]
) -> tuple[int | None, ...]:
    """
    Per batch of `batches`, how many of its leading samples are real where an epoch's end padded the last global
    batch (see `hf_parallel.exact.remainder`), so that the rest is left out of the counts and sums (None for the
    others); empty where none is padding. Every rank marks its last batch alike, its padding or not, so that what
    depends on it (the check of a head skips a padded forward) takes the same collectives on every rank.

    Args:
        head (`LossHead`): the step's head.
        batches (`list[dict]`): this rank's micro-batches of the step; only the last can hold padding.
        end (`EpochEnd`, *optional*): set when the last batch ends the epoch.
        process_index (`int`): this rank.
        pads (`bool`): whether the dataloader pads its last global batch (accelerate's `even_batches`, without
            `dataloader_drop_last`).
        warn_once (`Callable`): warns once per message (an iterable set whose samples could not be counted).
    """
    if end is None or not (pads or end.counted) or not batches:
        return ()
    if end.remainder < 0:
        warn_once(
            "exact_loss: the dataset is iterable, each rank reads it itself (dispatch_batches=False) and its "
            "samples could not be counted, so the rows accelerate repeats to fill the last batch of an epoch (or "
            "of an evaluation) cannot be told apart; they count, as stock counts them. Set "
            "dataloader_num_workers=0 or let rank 0 dispatch the batches."
        )
        return ()
    last = batches[-1]
    if head.label_keys:
        samples = samples_in(last, head.label_keys[0], sample_ids_of(head, last))
    else:  # a contrastive or preference batch, without labels
        samples = rows_of(last) // head.rows_per_sample
    real = real_rows(samples, end.remainder, process_index)
    return () if real is None else (None,) * (len(batches) - 1) + (real,)


class LoopPadding:
    """
    The samples a hand-written loop's dataloader repeats, told apart as its batches come:
    accelerate's, which fills the last global batch with rows from the epoch's start (`even_batches`) unless the
    dataloader drops it, in a dataloader accelerate prepared; a `DistributedSampler`'s otherwise, which repeats samples
    to give every rank as many (`drop_last=False`): the padded index list is dealt out round-robin, so rank r's real
    samples are the first ceil((N - r) / W) it reads in an epoch (a dataloader accelerate did not prepare).
    Under accelerate the samples of an iterable dataset each rank reads itself are counted first
    (`hf_parallel.exact.streams`; warned where they cannot be).
    """

    def __init__(self, exact, dataloader, name: str, accelerator, process_index: int, num_processes: int):
        self.exact, self.accelerator = exact, accelerator
        if accelerator is not None:
            cannot = count_samples(dataloader, name)
            if cannot is not None:
                exact.warn_once(cannot)
        sampler = getattr(dataloader, "sampler", None)
        if not isinstance(sampler, DistributedSampler):
            sampler = getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)
        #: This rank's real samples of an epoch under a padding `DistributedSampler` (None: none is padding), and the
        #: samples read so far.
        self.sampler_real = None
        pads = isinstance(sampler, DistributedSampler) and sampler.total_size > len(sampler.dataset)
        if pads and not sampler.drop_last and num_processes > 1:
            self.sampler_real = max(0, math.ceil((len(sampler.dataset) - process_index) / num_processes))
            self.epoch_samples = sampler.num_samples  # every rank's samples of an epoch, the padding included
        self.seen = 0

    def mark(self, head, batches: list[dict], end: EpochEnd | None) -> tuple[int | None, ...]:
        """Per batch of `batches`, how many of its leading samples are real (on every rank, its last of the epoch,
        as `padded_rows` marks it); empty where none is padding."""
        if self.accelerator is not None:
            loader = self.accelerator.gradient_state.active_dataloader
            pads = self.accelerator.even_batches and not getattr(loader, "_drop_last", False)
            return self.exact.padded_rows(head, batches, end, pads)
        marks = []
        for batch in batches:  # the sampler's real samples as they come
            rows = len(batch[head.label_keys[0]]) if head.label_keys else rows_of(batch)
            real = rows if self.sampler_real is None else min(rows, max(0, self.sampler_real - self.seen))
            self.seen += rows
            ends = self.sampler_real is not None and self.seen >= self.epoch_samples
            marks.append(real if real < rows or ends else None)
        return tuple(marks) if any(mark is not None for mark in marks) else ()
