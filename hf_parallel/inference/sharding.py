"""
Which rows each process embeds, and how the main process collects them in dataset order.

Every process takes contiguous blocks of `batch_size` rows by index (step `k`, rank `r` gets rows
`[k*B*W + r*B, k*B*W + (r+1)*B)`), so no row is duplicated (`DistributedSampler` pads the dataset with repeated rows
so that every rank has as many) and, at each step, the main process receives the next `B*W` rows of the dataset in
order. Each rank's block travels with a status flag that every rank receives, so that an exception on one rank
reaches all of them at the next step instead of leaving the others in a collective until the process-group timeout.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..launch.validation import check_whole_number

__all__ = ["OrderedGather", "shard_batches"]


def shard_batches(num_rows: int, batch_size: int, num_processes: int, process_index: int) -> list[range]:
    """
    The batches of rows one process embeds: at step `k`, process `r` takes rows `[k*B*W + r*B, k*B*W + (r+1)*B)`.

    Every row goes to exactly one process (no duplicates, unlike `DistributedSampler`'s padding), and at each step
    the processes together cover the next `B*W` rows in order, so the main process can write as it receives.
    A process's batches are a prefix of the `ceil(num_rows / (B*W))` steps; the last one may be short or absent.

    Args:
        num_rows (`int`): The dataset length.
        batch_size (`int`): Rows per batch per process (`B`).
        num_processes (`int`): The world size (`W`).
        process_index (`int`): This process's rank.

    Returns:
        `list[range]`: the row indices of each of this process's batches, in order.

    ```python
    from hf_parallel import shard_batches

    [list(b) for b in shard_batches(7, 2, 2, 0)]  # [[0, 1], [4, 5]]
    [list(b) for b in shard_batches(7, 2, 2, 1)]  # [[2, 3], [6]]
    ```
    """
    check_whole_number("num_rows", num_rows, 0)
    check_whole_number("batch_size", batch_size, 1)
    check_whole_number("num_processes", num_processes, 1)
    if isinstance(process_index, bool) or not isinstance(process_index, int) or not 0 <= process_index < num_processes:
        raise ValueError(
            f"process_index={process_index!r} is not a rank of {num_processes} processes; use 0..{num_processes - 1}."
        )
    stride = batch_size * num_processes
    return [
        range(start, min(start + batch_size, num_rows))
        for start in range(process_index * batch_size, num_rows, stride)
    ]


def _describe(error: BaseException) -> str:
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class OrderedGather:
    """
    Step by step, bring every rank's block of embeddings to the main process (rank 0), in dataset order.

    Each `step` is one all-gather of every rank's block plus a status row (1: this rank failed); the first step and
    `finish` add an all-reduce of `world + 1` integers (the flags, and the block width that ranks without rows at
    the first step must learn). A rank that caught an exception passes it to `step` (or `finish`) instead of
    raising it: every rank then raises the same `RuntimeError`, naming the failed ranks and their errors, and no
    rank is left waiting in a collective that the failed one would never join. With one process, `step` returns
    the block (or raises the error) as it is.

    Not accelerate's `gather_for_metrics`: it carries no status, so a rank that failed would leave the others waiting
    in the gather until the timeout; and it gathers whole results at the end, where this brings each step's blocks
    to rank 0 to be written as they come.

    Args:
        num_rows (`int`): The dataset length.
        batch_size (`int`): Rows per batch per process.
        num_processes (`int`): The world size.
        process_index (`int`): This process's rank.
        dtype (`torch.dtype`): The dtype of the blocks.
        device (`torch.device`): This process's device; used for the collectives unless the backend is gloo (CPU).

    ```python
    gather = OrderedGather(num_rows, batch_size, world, rank, torch.float32, device)
    for step in range(gather.num_steps):
        block = gather.step(step, local_block, error)  # (B*W rows, dim) on rank 0, None on the others
    gather.finish(error)  # a barrier that also raises everywhere if a rank failed after the last gather
    ```
    """

    def __init__(self, num_rows, batch_size, num_processes, process_index, dtype, device):
        self.num_rows, self.batch_size, self.dtype = num_rows, batch_size, dtype
        self.world, self.rank = num_processes, process_index
        self.num_steps = math.ceil(num_rows / (batch_size * num_processes))
        distributed = num_processes > 1 and dist.get_backend() != "gloo"
        self.device = torch.device(device) if distributed else torch.device("cpu")
        self.dim = 0

    def step(self, step: int, local: torch.Tensor | None, error: BaseException | None) -> torch.Tensor | None:
        """
        Gather step `step`'s blocks; raise on every rank if any rank failed.

        Args:
            step (`int`): The step, from 0 to `num_steps - 1`.
            local (`torch.Tensor` of shape `(rows, dim)`, *optional*): This rank's block; `None` when it has no rows
                at this step (or failed).
            error (`BaseException`, *optional*): The exception this rank caught, if any.

        Returns:
            `torch.Tensor`: the step's rows of every rank, in dataset order, on rank 0; `None` on the others.
        """
        if self.world == 1:
            self.finish(error)  # raises the error, if any
            return local
        if self.dim == 0:
            # The first step: ranks without rows (fewer rows than B*W) learn the width, as they must send blocks of
            # the same shape; a rank that failed while preparing says so here, before the blocks travel.
            self.dim = self._check_ranks(error, 0 if local is None else local.shape[1])
        # The block, padded to `batch_size` rows, then one row whose first value is this rank's status (1: failed):
        # the flag travels with the block, so the happy path costs no collective beyond the gather.
        send = torch.zeros(self.batch_size + 1, self.dim, dtype=self.dtype, device=self.device)
        send[-1, 0] = int(error is not None)
        if local is not None:
            send[: local.shape[0]] = local.to(self.device)
        # All ranks receive every block (not rank 0 alone) so that every rank sees every flag: W times the bytes of a
        # gather to rank 0, which for one batch of pooled vectors is small beside the forward that made them.
        received = [torch.empty_like(send) for _ in range(self.world)]
        dist.all_gather(received, send)
        self._raise_if_failed(error, torch.stack([tensor[-1, 0] for tensor in received]))
        if self.rank != 0:
            return None
        base = step * self.batch_size * self.world
        counts = [max(0, min(self.batch_size, self.num_rows - base - r * self.batch_size)) for r in range(self.world)]
        return torch.cat([tensor[:count] for tensor, count in zip(received, counts, strict=True)])

    def finish(self, error: BaseException | None) -> None:
        """After the last step: wait for every rank, and raise on all of them if any failed since the last step."""
        if self.world > 1:
            self._check_ranks(error, 0)
        elif error is not None:
            raise error

    def _check_ranks(self, error: BaseException | None, dim: int) -> int:
        # One small all-reduce: a flag per rank (1: failed) and the block width. The maximum of the widths is the
        # width of every rank that has rows (the same model).
        status = torch.zeros(self.world + 1, dtype=torch.int64, device=self.device)
        status[self.rank] = int(error is not None)
        status[-1] = dim
        dist.all_reduce(status, op=dist.ReduceOp.MAX)
        self._raise_if_failed(error, status[:-1])
        return int(status[-1])

    def _raise_if_failed(self, error: BaseException | None, flags: torch.Tensor) -> None:
        # `flags`: one per rank, nonzero where it failed. Every rank has the same flags and reached this same point,
        # so the messages travel only on failure.
        failed = torch.nonzero(flags).flatten().tolist()
        if not failed:
            return
        messages = [None] * self.world
        dist.all_gather_object(messages, None if error is None else _describe(error))
        detail = "; ".join(f"rank {rank}: {messages[rank]}" for rank in failed)
        raise RuntimeError(f"embed_dataset failed on {detail}") from error
