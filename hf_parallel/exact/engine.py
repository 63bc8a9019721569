"""
The engines a training step runs on, each declared once: which ranks' item counts add up to the step's count C, the
factor its gradient combination needs (S / C times it), the value its loss is logged as, and which parts of the
package it needs (DataParallel replicas, the padded last step of a DDP epoch, sequence shards). A run picks its engine
once, at its first step (`pick_engine`); the step reads it, and no micro-batch asks again.

| engine | counts added over | gradient factor | logged as | needs |
|---|---|---|---|---|
| one process | this process | 1 | the loss | |
| DataParallel replicas | this process (the replicas' rows) | 1 | the loss | replicas |
| DDP, FSDP, DeepSpeed ZeRO | every rank | N (they average gradients) | the mean over ranks | epoch padding |
| Ulysses SP | every rank (its shard's targets) | N / SP | the mean over ranks, x SP | sequence shards |
| tensor parallel x TP | every rank, / TP (a TP group holds one batch) | N / TP | the mean over ranks | epoch padding |

Why the factors: DDP, FSDP and ZeRO average the ranks' gradients, so each rank back-propagates its sum over the
whole step's count times N, and the average is the one-device gradient; DeepSpeed's Ulysses averages over the
data-parallel ranks only and adds the sequence-parallel ranks' parts (ZeRO-3 before deepspeed 0.20.2 averages over
all of them: factor N). Under tensor parallelism (a model transformers shards at load time, `DistributedConfig(tp_size=
...)`, alone or with `fsdp_size`, `dp_replicate_size`, `ep_size`) the TP ranks of a group hold the same batch: their
counts are the group's, once; each computes the group's loss, whose sharded parameters' gradients the TP collectives
complete inside the backward, and FSDP2 (or HSDP) averages over the N / TP data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Engine", "pick_engine"]


@dataclass(frozen=True)
class Engine:
    """
    How one engine combines a step: declared, not probed.

    Args:
        name (`str`): what it is, for messages.
        count_ranks (`int`, *optional*, defaults to 1): the processes whose item counts add up to the step's count
            (`reduce_sum` adds them).
        gradient_factor (`int`, *optional*, defaults to 1): each rank back-propagates S / C times this.
        log_ranks (`int`, *optional*, defaults to 1): the ranks the Trainer's logged loss is a mean over; a rank's
            loss is logged x `log_ranks / gradient_factor` (its gradient unchanged).
        replicas (`bool`, *optional*): the forward runs in `nn.DataParallel` replicas (`hf_parallel.exact.replicas`).
        pads_epoch_end (`bool`, *optional*): accelerate fills an epoch's last global batch with repeated rows, to be
            told apart (`hf_parallel.exact.remainder`).
        shards_sequence (`bool`, *optional*): each rank holds a shard of other ranks' rows (Ulysses).
        data_replicas (`int`, *optional*, defaults to 1): the ranks that hold the same batch (a tensor-parallel
            group): added over every rank, their counts are divided by it, and a rank's share of the data is
            `process_index // data_replicas`.
        reduce_sum (`Callable`, *optional*): sums a tensor over the `count_ranks` processes.
        group (`ProcessGroup`, *optional*): their process group, which every collective of a step goes through
            (`reduce_sum`, `gather_rows`); None for the default group.
    """

    name: str
    count_ranks: int = 1
    gradient_factor: int = 1
    log_ranks: int = 1
    replicas: bool = False
    pads_epoch_end: bool = False
    shards_sequence: bool = False
    data_replicas: int = 1
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    group: Any = None

    @property
    def rank(self) -> int:
        """This process's rank among the `count_ranks` processes (0 in one process)."""
        return dist.get_rank(self.group) if self.count_ranks > 1 else 0

    def gather_rows(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (the same trailing shape, any number of rows) over the engine's `group`, in rank
        order, without gradient; `[tensor]` in one process."""
        if self.count_ranks <= 1:
            return [tensor]
        world = dist.get_world_size(self.group)
        rows = torch.tensor([tensor.shape[0]], device=tensor.device)
        sizes = [torch.zeros_like(rows) for _ in range(world)]
        dist.all_gather(sizes, rows, group=self.group)
        most = int(max(size.item() for size in sizes))
        padded = torch.cat([tensor, tensor.new_zeros((most - tensor.shape[0], *tensor.shape[1:]))])
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded.contiguous(), group=self.group)
        return [part[: int(size.item())] for part, size in zip(gathered, sizes, strict=True)]

    def add_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts` (or any per-rank totals) added over the `count_ranks` processes, each batch's once."""
        if self.count_ranks <= 1:
            return counts
        added = self.reduce_sum(counts)
        if self.data_replicas == 1:
            return added
        return added / self.data_replicas if added.is_floating_point() else added // self.data_replicas

    def as_logged(self, loss: torch.Tensor) -> torch.Tensor:
        """A rank's loss with the value the log expects of one rank's share of the step (its gradient unchanged)."""
        if self.log_ranks == self.gradient_factor:
            return loss
        return loss + loss.detach() * (self.log_ranks / self.gradient_factor - 1)


def pick_engine(
    processes: int,
    *,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    data_parallel: bool = False,
    deepspeed_stage: int | None = None,
    sequence_parallel: int = 1,
    deepspeed_version: tuple[int, ...] | None = None,
    tensor_parallel: int = 1,
    name: str | None = None,
    group: Any = None,
) -> Engine:
    """
    The engine of a run, from what it was launched with.

    Args:
        processes (`int`): the data-parallel processes (1 without a process group).
        reduce_sum (`Callable`, *optional*): sums a tensor over them (needed when `processes > 1`).
        data_parallel (`bool`, *optional*): the model runs in an `nn.DataParallel` wrapper.
        deepspeed_stage (`int`, *optional*): the ZeRO stage under DeepSpeed, None without it.
        sequence_parallel (`int`, *optional*, defaults to 1): DeepSpeed's Ulysses sequence-parallel size.
        deepspeed_version (`tuple[int, ...]`, *optional*): DeepSpeed's release (read where SP runs under ZeRO-3).
        tensor_parallel (`int`, *optional*, defaults to 1): the tensor-parallel size of a model sharded at load time
            (its ranks hold the same batch).
        name (`str`, *optional*): what the ranks run, for messages (accelerate's distributed type: `MULTI_GPU`,
            `FSDP`, ...); `DDP` when not given.
        group (`ProcessGroup`, *optional*): the processes' group (`Engine.group`); None for the default group.

    ```python
    from hf_parallel.exact.engine import pick_engine

    pick_engine(1).name  # 'one process'
    ```
    """
    if processes > 1 and reduce_sum is None:
        raise ValueError(f"An engine over {processes} processes needs reduce_sum to count the whole step.")
    if processes <= 1:
        return Engine("DataParallel replicas", replicas=True) if data_parallel else Engine("one process")
    ranks = {"reduce_sum": reduce_sum, "group": group}  # every engine over several processes counts through them
    if sequence_parallel > 1:
        # deepspeedai/DeepSpeed#8854 (in 0.20.2): ZeRO-3 adds the sequence-parallel ranks' gradients as ZeRO 1 and 2
        # do; before, it averaged them over every rank.
        averages_all = deepspeed_stage == 3 and (deepspeed_version or (0,)) < _ZERO3_ADDS_SP_FROM
        factor = processes if averages_all else processes // sequence_parallel
        name = f"DeepSpeed ZeRO-{deepspeed_stage} with Ulysses sequence parallelism x{sequence_parallel}"
        return Engine(name, processes, factor, processes, shards_sequence=True, **ranks)
    if tensor_parallel > 1:
        if processes % tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} does not divide the {processes} processes.")
        data = processes // tensor_parallel
        name = f"tensor parallel x{tensor_parallel}" + (f" with {data} data-parallel ranks" if data > 1 else "")
        return Engine(name, processes, data, data, pads_epoch_end=True, data_replicas=tensor_parallel, **ranks)
    if deepspeed_stage is not None:
        name = f"DeepSpeed ZeRO-{deepspeed_stage}"
    return Engine(name or "DDP", processes, processes, processes, pads_epoch_end=True, **ranks)


_ZERO3_ADDS_SP_FROM = (0, 20, 2)
