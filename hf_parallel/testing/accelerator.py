"""
The CPU shown to accelerate as an accelerator, for tests of engines that run only on device-backed launches
(DeepSpeed, DeepSpeed's sequence parallelism, tensor parallelism through a `ParallelismConfig`) on a machine with no
GPU.

On a CPU-only torch `torch.accelerator.current_accelerator()` is None, so accelerate's `PartialState` picks no
distributed backend for a launched process that does not say `cpu`, and a process that says `cpu` gets the MULTI_CPU
path, which ignores `ACCELERATE_USE_DEEPSPEED`. Under the Trainer's DeepSpeed config each rank then believes it runs
alone while DeepSpeed averages over every rank, and DeepSpeed's batch check stops it
(`train_batch_size ... 4 != 2 * 2 * 2`). Within `cpu_as_accelerator()` accelerate sees the CPU as a device with gloo
as its backend: it starts DeepSpeed's communication as on GPUs with NCCL and sets `DistributedType.DEEPSPEED`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import torch

__all__ = ["cpu_as_accelerator"]


@contextlib.contextmanager
def cpu_as_accelerator() -> Iterator[None]:
    """
    Within the block, accelerate takes the CPU for an accelerator whose distributed backend is gloo, so that a
    launched process (a rank of `spawn_cpu_ranks`, or one `torchrun` started) runs the device-backed paths of
    `PartialState`: DeepSpeed ZeRO and sequence parallelism through the Trainer, on CPU ranks.

    For tests only: a user's run never needs it, and it refuses to start on a machine that has an accelerator (there
    the real one is what to test). It must be entered before the process builds its first `TrainingArguments`,
    `Accelerator` or `PartialState`, which keep the backend they chose; it also lifts `ACCELERATE_USE_CPU` for its
    duration (accelerate's CPU path ignores DeepSpeed), so `TrainingArguments(use_cpu=...)` must stay False inside.

    Patched for the block and restored after it: `accelerate.state.get_torch_accelerator_backend`, which then returns
    `("cpu", torch.cpu)`, `accelerate.state.get_distributed_backend`, which then returns `"gloo"` for the CPU, and
    `transformers.training_args.is_torch_bf16_gpu_available`, which then says yes, so that `bf16=True` passes the
    arguments' check (the CPU computes in bf16; DeepSpeed runs its bf16 optimizer there), and
    `Accelerator.multi_device`, which then holds for MULTI_CPU ranks too, so that accelerate takes a
    `ParallelismConfig` there (it refuses one on CPU ranks: "ParallelismConfig is only compatible DistributedType.FSDP
    (version 2) or DistributedType.Multi{Device} ..."): the tensor parallelism of a model sharded at load time.

    ```python
    from hf_parallel.testing import cpu_as_accelerator, spawn_cpu_ranks


    def rank_body(output_dir):
        with cpu_as_accelerator():
            ...  # TrainingArguments(deepspeed={...}), Trainer(...).train()


    spawn_cpu_ranks(rank_body, args=("out",), num_processes=2)  # or spawn_cpu_ranks(..., cpu_as_accelerator=True)
    ```
    """
    import accelerate
    import accelerate.state as accelerate_state
    import transformers.training_args as training_args
    from accelerate.utils import DistributedType

    present = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if present is not None:
        raise RuntimeError(
            f"cpu_as_accelerator: this machine has an accelerator ({present}); the switch is for CPU-only machines. "
            "Test on the real device instead."
        )
    if accelerate_state.PartialState._shared_state:
        raise RuntimeError(
            "cpu_as_accelerator: accelerate's PartialState already exists in this process and keeps the backend it "
            "chose. Enter the switch before the first TrainingArguments, Accelerator or PartialState (in a fresh "
            "process, e.g. at the top of a spawn_cpu_ranks body)."
        )
    for name in ("get_torch_accelerator_backend", "get_distributed_backend"):
        if not hasattr(accelerate_state, name):
            raise RuntimeError(
                f"cpu_as_accelerator: accelerate {accelerate_state.__name__} has no {name} (accelerate "
                f"{accelerate.__version__}); the switch needs accelerate 1.16 or later."
            )
    get_distributed_backend = accelerate_state.get_distributed_backend
    multi_device = accelerate.Accelerator.multi_device

    def cpu_backend(*args, **kwargs):
        return "cpu", torch.cpu

    def distributed_backend(device_type):
        return "gloo" if device_type == "cpu" else get_distributed_backend(device_type)

    def cpu_ranks_too(self) -> bool:
        return multi_device.fget(self) or (self.use_distributed and self.distributed_type == DistributedType.MULTI_CPU)

    use_cpu = os.environ.pop("ACCELERATE_USE_CPU", None)
    try:
        with (
            mock.patch.object(accelerate_state, "get_torch_accelerator_backend", cpu_backend),
            mock.patch.object(accelerate_state, "get_distributed_backend", distributed_backend),
            # The CPU computes in bf16.
            mock.patch.object(training_args, "is_torch_bf16_gpu_available", lambda *args, **kwargs: True),
            mock.patch.object(accelerate.Accelerator, "multi_device", property(cpu_ranks_too)),
        ):
            yield
    finally:
        if use_cpu is not None:
            os.environ["ACCELERATE_USE_CPU"] = use_cpu
