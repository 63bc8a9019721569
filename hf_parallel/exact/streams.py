"""
Iterable datasets that each rank reads itself (`dispatch_batches=False`): which samples of their last batch are real.

Under DDP accelerate wraps such a dataset in an `IterableDatasetShard`: every rank iterates the whole dataset, cuts it
into global batches (`batch_size x num_processes` samples, or `batch_size` with `split_batches`) and keeps its slice
of each, rank r the r-th. Unless the dataloader drops it, the last, partial global batch is completed with samples
of the first one, so that every rank gets a full batch. accelerate does not know how many samples of that batch are
real: it reports -1 for a dataset without a length, and 0 for one with a length (it takes the per-rank length modulo
the per-rank batch), and its `gather_for_metrics` then keeps the repeated samples. Every rank sees every sample, so
counting what the dataset yields tells it: `count_samples` puts a `SampleCounter` between the shard and the dataset;
once the dataloader is at its end, `stream_remainder` reads the count. The samples of the gathered last batch are in
rank order, real ones first, as for a map-style dataset (`accelerator.gather_for_metrics` would keep the first
`remainder` of them), so an epoch's last step, in training and evaluation alike, marks its padding as for a map-style
dataset (`hf_parallel.exact.remainder`).

The count is taken where the shard iterates, which is this process only without dataloader worker processes
(`dataloader_num_workers=0`); with workers each one runs its own shard, and `count_samples` says it cannot count.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from accelerate.data_loader import IterableDatasetShard
from torch.utils.data import IterableDataset

__all__ = ["SampleCounter", "count_samples", "stream_remainder"]


class SampleCounter(IterableDataset):
    """
    An iterable dataset as it is, counting the samples it has yielded in this iteration (`count`, from 0 at each
    `iter`). Attributes are looked up on the dataset (accelerate asks it for `set_epoch` and `generator`).

    Args:
        dataset (`Iterable`): the dataset to count.
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        self.count = 0
        for sample in self.dataset:
            self.count += 1
            yield sample

    def __len__(self) -> int:
        return len(self.dataset)  # a TypeError for a dataset without a length, as without the counter

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion through the lookup below
            raise AttributeError(name)
        return getattr(self.dataset, name)


def count_samples(dataloader, dataset_name: str) -> str | None:
    """
    Count the samples of a prepared dataloader that reads an iterable dataset on each rank (`IterableDatasetShard`);
    any other dataloader is left as it is. Returns why the count cannot be taken (a warning naming the setting), or
    None.

    Args:
        dataloader (`DataLoader`): the dataloader `accelerator.prepare` returned.
        dataset_name (`str`): how the user passed its dataset (`train_dataset`, `eval_dataset`, ...), for the warning.
    """
    shard = getattr(dataloader, "dataset", None)
    if not isinstance(shard, IterableDatasetShard) or isinstance(shard.dataset, SampleCounter):
        return None
    workers = getattr(dataloader, "num_workers", 0)
    if workers > 0:
        # Each worker process iterates its own copy of the shard: a count taken there never reaches this process.
        return (
            f"exact_loss: {dataset_name} is iterable and each rank reads it itself (dispatch_batches=False) in "
            f"dataloader_num_workers={workers} worker processes, where its samples cannot be counted: the samples "
            "accelerate repeats to fill the last batch cannot be told apart, and count as stock counts them. Set "
            "dataloader_num_workers=0, or let rank 0 dispatch the batches (accelerator_config "
            "{'dispatch_batches': True})."
        )
    shard.dataset = SampleCounter(shard.dataset)
    return None


def stream_remainder(gradient_state) -> int | None:
    """
    At the end of a counted dataloader (`count_samples`), how many samples of its last global batch are real (0: none
    is padding); None anywhere else, where accelerate's own `remainder` holds.

    Args:
        gradient_state (`GradientState`): accelerate's state of the active dataloader.
    """
    if not gradient_state.end_of_dataloader:
        return None
    shard = getattr(gradient_state.active_dataloader, "dataset", None)
    if not isinstance(shard, IterableDatasetShard) or not isinstance(shard.dataset, SampleCounter):
        return None
    if shard.drop_last:
        return 0  # the last partial batch was dropped, not completed
    global_batch = shard.batch_size if shard.split_batches else shard.batch_size * shard.num_processes
    return shard.dataset.count % global_batch
