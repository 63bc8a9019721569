"""
A CPU simulation of `nn.DataParallel` over N virtual devices, to test DataParallel code paths without GPUs and to
dry-run a DataParallel training on any machine.

`CpuTransport` does a DataParallel wrapper's device work on the CPU (see `hf_parallel.transport`), reproducing what
`nn.DataParallel` does to the *values*: the same splitting (without chunk sizes, `tensor.chunk` semantics: 6 rows on
4 devices -> `[2, 2, 2]`, 5 rows -> `[2, 2, 1]`, so fewer replicas run than there are devices,
`device_ids[:len(chunks)]`), non-tensors shared by every chunk, torch's `scatter_kwargs` zipping without `strict` (so
a tensor argument that splits into fewer chunks than the others silently drops the extra chunks, as on GPUs), tuples,
lists, dicts, namedtuples and `ModelOutput`s gathered the same way, and 0-dim outputs gathered into a vector, one
entry per replica (the per-GPU loss vector). The "replicas" are the wrapped module itself, run on each chunk in turn,
so the gradients of the chunks sum into the parameters exactly as the backward of DataParallel's broadcast sums the
replicas' gradients. `SimulatedDataParallel` is `nn.DataParallel` over that transport (torch's own `forward`), and
`SimulatedBalancedDataParallel` is `BalancedDataParallel` over it: all their splitting and validation is the real one.

Limits (what it does not reproduce):
- no concurrency: replicas run one after the other on one device, so no speed-up, no thread or stream effects;
- nothing moves: the module must sit on one device (any, CPU included), where it was when wrapped;
- in-place updates in `forward` persist: on GPUs they are lost on replicas 1..N-1 (`nn.DataParallel` keeps only
  replica 0's, e.g. BatchNorm running statistics); here every chunk updates the one module, so BatchNorm running
  statistics are updated N times a step instead of once;
- dropout and other random ops draw from one RNG stream in chunk order, not from per-device CUDA streams;
- forward/backward hooks run once per chunk, as on GPUs, but in a fixed order;
- the replicas' parameters are the module's own (leaf tensors with `.grad`); on GPUs they are broadcast copies whose
  gradients flow back to the module's, which code that inspects replica parameters in `forward` can notice;
- torch's warning when it gathers 0-dim outputs into a vector is not emitted;
- memory is not split: peak memory is that of the whole batch on one device.

```python
import tempfile

from hf_parallel import Trainer
from hf_parallel.testing import simulate_data_parallel, simulated_training_args

with tempfile.TemporaryDirectory() as output_dir, simulate_data_parallel(3):
    args = simulated_training_args(3, output_dir=output_dir, per_device_train_batch_size=2, gpu0_bsz=1)
    Trainer(model=model, args=args, train_dataset=train_ds).train()  # batches of 6 rows split [1, 3, 2]
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..data_parallel import BalancedDataParallel
from ..transport import TransportDataParallel
from ..validation import check_whole_number
from . import cpu_transport
from .cpu_transport import CpuTransport

__all__ = [
    "SimulatedBalancedDataParallel",
    "SimulatedDataParallel",
    "simulate_data_parallel",
    "simulated_training_args",
]


class SimulatedDataParallel(TransportDataParallel):
    """
    `nn.DataParallel` over virtual devices, on the device the module is on (CPU included): torch's own `forward`,
    its device work done by a `CpuTransport`. See the module docstring for what it reproduces and its limits.

    Args:
        module (`nn.Module`):
            The model.
        device_ids (`list[int]`, *optional*):
            Virtual device ids (only their number matters; `[0, 0]` is two devices). Defaults to
            `range(n_devices)`.
        output_device (`int`, *optional*):
            Accepted for compatibility, unused: everything stays where it is.
        dim (`int`, *optional*, defaults to `0`):
            Batch dimension.
        n_devices (`int`, *optional*):
            Number of virtual devices when `device_ids` is not given; defaults to the one of the enclosing
            `simulate_data_parallel`.

    ```python
    from hf_parallel.testing import SimulatedDataParallel

    dp = SimulatedDataParallel(model, n_devices=4)
    logits = dp(input_ids=ids).logits  # 5 rows run as chunks [2, 2, 1] on 3 replicas, as on 4 GPUs
    dp.last_chunk_sizes  # [2, 2, 1]
    dp.last_gathered_bytes  # what GPU 0 would receive: here the whole batch's logits
    ```
    """

    # The transport of wrappers built for this class while it stands in for torch.nn.DataParallel.
    transport_class = CpuTransport

    def __init__(self, *args: Any, n_devices: int | None = None, **kwargs: Any):
        super().__init__(*args, transport=CpuTransport(n_devices), **kwargs)

    @property
    def last_chunk_sizes(self) -> list[int | None]:
        """The rows each replica got in the last forward (see `CpuTransport`)."""
        return self.transport.last_chunk_sizes

    @property
    def last_gathered_bytes(self) -> int:
        """The bytes of the tensors the last forward gathered, which on GPUs travel to GPU 0 (see `CpuTransport`)."""
        return self.transport.last_gathered_bytes


class SimulatedBalancedDataParallel(BalancedDataParallel, SimulatedDataParallel):
    """
    `BalancedDataParallel` over virtual devices: its own chunk sizes, validation, device skipping and `forward`, its
    device work done by the `CpuTransport` of `SimulatedDataParallel` (tensors are split in place, 0-dim tensors
    shared). Same arguments as `BalancedDataParallel`, plus `n_devices` as in `SimulatedDataParallel`.

    ```python
    from hf_parallel.testing import SimulatedBalancedDataParallel

    dp = SimulatedBalancedDataParallel(model, gpu0_bsz=1, n_devices=3)
    dp(input_ids=ids)  # 6 rows -> chunks [1, 3, 2]
    dp.last_chunk_sizes  # [1, 3, 2]
    ```
    """


@contextlib.contextmanager
def simulate_data_parallel(n_devices: int) -> Iterator[type[SimulatedDataParallel]]:
    """
    Within the block, `torch.nn.DataParallel` is `SimulatedDataParallel` over `n_devices` virtual devices. Both the
    stock `transformers.Trainer` (which calls `nn.DataParallel(model)` when `args.n_gpu > 1`) and `hf_parallel.Trainer`
    (whose `BalancedDataParallel`, when `gpu0_bsz`/`gpu0_weight` is set, takes the transport of the
    `torch.nn.DataParallel` in use) then run their DataParallel path on CPU. Give the Trainer arguments from
    `simulated_training_args(n_devices, ...)` so that `args.n_gpu == n_devices`.

    Only code that looks `torch.nn.DataParallel` (or `torch.nn.parallel.DataParallel`) up at call time sees the
    simulation: transformers and accelerate do. A `BalancedDataParallel` built directly inside the block is not
    simulated; build `SimulatedBalancedDataParallel` instead.

    Args:
        n_devices (`int`):
            Virtual devices (>= 1).

    ```python
    import tempfile

    from transformers import Trainer
    from hf_parallel.testing import simulate_data_parallel, simulated_training_args

    with tempfile.TemporaryDirectory() as output_dir, simulate_data_parallel(2):
        args = simulated_training_args(2, output_dir=output_dir, per_device_train_batch_size=4)
        Trainer(model=model, args=args, train_dataset=ds).train()  # batches of 8 rows on 2 virtual GPUs
    ```
    """
    check_whole_number("n_devices", n_devices, 1)
    saved = (cpu_transport.active_devices, torch.nn.DataParallel, torch.nn.parallel.DataParallel)
    cpu_transport.active_devices = n_devices
    torch.nn.DataParallel = SimulatedDataParallel
    torch.nn.parallel.DataParallel = SimulatedDataParallel
    try:
        yield SimulatedDataParallel
    finally:
        cpu_transport.active_devices, torch.nn.DataParallel, torch.nn.parallel.DataParallel = saved


def simulated_training_args(n_devices: int, args_class: type | None = None, **kwargs: Any):
    """
    `TrainingArguments` that report `n_gpu == n_devices` on a machine without GPUs, so that a Trainer takes its
    DataParallel path (per-step batch `per_device_train_batch_size * n_devices`, a DataParallel wrapper, the
    per-device loss vector). Use it with `simulate_data_parallel(n_devices)`.

    The device set-up is run first (`use_cpu=True` unless given) and then `_n_gpu` is set: `n_gpu` is computed once
    by the cached `_setup_devices`, so it is not overwritten afterwards.

    Args:
        n_devices (`int`):
            Virtual devices (>= 1).
        args_class (`type`, *optional*, defaults to `hf_parallel.TrainingArguments`):
            The arguments class, e.g. `transformers.TrainingArguments` for the stock Trainer.
        kwargs:
            Passed to `args_class`.

    ```python
    import tempfile

    import transformers
    from hf_parallel.testing import simulated_training_args

    with tempfile.TemporaryDirectory() as output_dir:
        args = simulated_training_args(3, transformers.TrainingArguments, output_dir=output_dir)
        args.n_gpu, args.train_batch_size  # (3, 24): 8 rows per device by default
    ```
    """
    check_whole_number("n_devices", n_devices, 1)
    if args_class is None:
        from ..training_args import TrainingArguments as args_class
    kwargs.setdefault("use_cpu", True)
    args = args_class(**kwargs)
    _ = args._setup_devices  # cached: computes (and sets) _n_gpu now, never again
    if args.parallel_mode.value == "distributed":
        raise ValueError(
            "simulated_training_args simulates DataParallel in one process, but these arguments set up a "
            f"distributed run (world_size={args.world_size}). Run it without a launcher."
        )
    args._n_gpu = n_devices
    return args
