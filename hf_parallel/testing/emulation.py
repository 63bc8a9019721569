"""
torch's own `nn.DataParallel` on N virtual devices that are all the CPU: test DataParallel code without GPUs.

Inside `simulate_data_parallel(n)`, every `nn.DataParallel` (torch's class, and any subclass such as
`hf_parallel.BalancedDataParallel`) runs torch's own Python code: `DataParallel.forward`, `scatter_kwargs`,
`replicate` (replicas without parameters, whose parameters are non-leaf copies made by `Broadcast`), `parallel_apply`
(one thread per replica, entering autocast with the caller's *enabled* flag and CUDA's thread default dtype, float16)
and `gather`, with the autograd functions `Broadcast`, `ReduceAddCoalesced`, `Scatter` and `Gather` and their
backwards (so a parameter a replica did not use gets a **zero** gradient from `Broadcast`'s backward, as on GPUs).
Only what touches a CUDA device is replaced, each by the same operation on the CPU:

- the C++ copies `torch._C._broadcast_coalesced` (the source tensors for the first device, detached copies for the
  others), `torch._C._scatter` (split or chunk: views of the source for the pieces bound for its device, virtual
  device 0, repeated ids included; copies for the others) and `torch._C._gather` (one buffer of the first piece's
  dtype, each piece copied into it);
- `comm.reduce_add`, whose only CPU-capable branch is not reachable with CPU tensors (a plain sum);
- the "not implemented for CPU tensors" checks at the top of `Broadcast.forward` and `Gather.forward` (the rest of
  both is done here as torch does it);
- the device discovery of `DataParallel.__init__` (`n` virtual devices; the module stays on the CPU);
- in `parallel_apply`, the accelerator's device and stream contexts (no-ops that record which virtual device each
  replica runs on) and its autocast, entered on the CPU with the dtype CUDA's would have; in `Scatter`, the copy
  streams it would set up on a machine that has a GPU.

Limits: every virtual device is the same CPU, so nothing checks that a tensor is used on the device it was sent to,
memory is not split, and replica threads share the CPU's cores. The records of an `Emulation` (chunk sizes, bytes
gathered, replicas run) say what a run on GPUs would have moved.

```python
import tempfile

from hf_parallel import Trainer
from hf_parallel.testing import simulate_data_parallel, simulated_training_args

with tempfile.TemporaryDirectory() as output_dir, simulate_data_parallel(3) as emulation:
    args = simulated_training_args(3, output_dir=output_dir, per_device_train_batch_size=2, gpu0_bsz=1)
    Trainer(model=model, args=args, train_dataset=train_ds).train()  # batches of 6 rows split [1, 3, 2]
    emulation.chunk_sizes[-1]  # [1, 3, 2]
```
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any
from unittest import mock

import torch
from torch._prims_common import suggest_memory_format
from torch.nn.parallel import _functions, comm

from ..launch.validation import check_whole_number

__all__ = ["Emulation", "simulate_data_parallel", "simulated_training_args"]

_data_parallel_module = sys.modules["torch.nn.parallel.data_parallel"]
_parallel_apply_module = sys.modules["torch.nn.parallel.parallel_apply"]


@dataclass
class Emulation:
    """
    What the DataParallel calls inside one `simulate_data_parallel` block did, as GPUs would have done it.

    Attributes:
        n_devices (`int`): the virtual devices.
        chunk_sizes (`list[list[int]]`): the rows of each piece, for every tensor scattered: the inputs of a
            forward, and in backward the gradients of the gathered outputs, scattered back to the replicas.
        gathered_bytes (`list[int]`): for every tensor gathered on the output device, its bytes: the outputs of a
            forward, and in backward the gradients of inputs that require them.
        replica_devices (`list[int]`): for every replica run, its virtual device, in replica order.
        autocast_dtypes (`list[torch.dtype | None]`): for every replica run, its autocast dtype (None: off).
    """

    n_devices: int
    chunk_sizes: list[list[int]] = field(default_factory=list)
    gathered_bytes: list[int] = field(default_factory=list)
    replica_devices: list[int] = field(default_factory=list)
    autocast_dtypes: list[torch.dtype | None] = field(default_factory=list)
    #: Guards the records, which the replica threads append to.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def check_devices(self, devices: Sequence[int]) -> None:
        bad = [d for d in devices if not 0 <= d < self.n_devices]
        if bad:
            raise RuntimeError(f"Invalid device {bad[0]}: the emulation has virtual devices 0..{self.n_devices - 1}.")

    # ---- The C++ copies, on the CPU ----
    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], devices: Sequence[int], buffer_size: int):
        self.check_devices(devices)
        if devices[0] != 0:
            # The module lives on virtual device 0 (the CPU); torch requires the source device first.
            raise RuntimeError(f"All tensors must be on devices[0]: {devices[0]} (the module is on virtual device 0).")
        with torch.no_grad():
            copies = [[t.detach().clone() for t in tensors] for _ in devices[1:]]
        return [list(tensors), *copies]

    def scatter(self, tensor, devices, chunk_sizes, dim, streams):
        pieces = tensor.split(list(chunk_sizes), dim) if chunk_sizes is not None else tensor.chunk(len(devices), dim)
        self.chunk_sizes.append([piece.size(dim) for piece in pieces])
        # As torch::cuda::scatter does: a piece bound for the source's own device (virtual device 0: the CPU) stays a
        # view of the tensor, as every piece does with device_ids=[0, 0] on one GPU; a piece bound for another device
        # is copied there (`.to(device, memory_format=torch.preserve_format)`, i.e. a clone keeping dense strides).
        # Views share the batch's version counter: an in-place op in one replica can break another's backward, on one
        # GPU as here. Not strict: chunk gives fewer pieces than devices when the rows run out (5 rows on 4: 3 pieces).
        return [piece if device == 0 else piece.clone() for piece, device in zip(pieces, devices, strict=False)]

    def gather(self, tensors, dim, destination):
        # As torch::cuda::gather does: one buffer of the first piece's dtype and memory format, each piece copied
        # into it, so a piece of another dtype is cast to the first's (torch.cat would promote them all instead).
        first = tensors[0]
        dim = dim + first.dim() if dim < 0 else dim
        for i, tensor in enumerate(tensors):
            if tensor.dim() != first.dim() or any(
                tensor.size(d) != first.size(d) for d in range(first.dim()) if d != dim
            ):
                # copy_ would broadcast a piece of another shape where torch raises.
                raise RuntimeError(
                    f"Input tensor at index {i} has invalid shape {list(tensor.shape)}, but expected "
                    f"{list(first.shape)} except along dimension {dim}"
                )
        size = list(first.shape)
        size[dim] = sum(tensor.size(dim) for tensor in tensors)
        # torch::cuda::gather keeps the pieces' suggested memory format when they all have the same, else contiguous.
        formats = {suggest_memory_format(tensor) for tensor in tensors}
        memory_format = formats.pop() if len(formats) == 1 else torch.contiguous_format
        gathered = torch.empty(size, dtype=first.dtype, memory_format=memory_format)
        for piece, tensor in zip(gathered.split([t.size(dim) for t in tensors], dim), tensors, strict=True):
            piece.copy_(tensor)
        self.gathered_bytes.append(gathered.numel() * gathered.element_size())
        return gathered


def _reduce_add(inputs, destination=None):
    # comm.reduce_add on CPU tensors (torch's asserts GPUs); same size checks.
    size = inputs[0].size()
    for i, tensor in enumerate(inputs):
        if tensor.size() != size:
            raise ValueError(f"input {i} has invalid size: got {tuple(tensor.size())}, but expected {tuple(size)}")
    # One input is returned as it is (reduce's initial value), as torch's reduce_add does.
    with torch.autocast("cpu", enabled=False):
        return functools.reduce(torch.add, inputs[1:], inputs[0])


def _broadcast_forward(ctx, target_gpus, *inputs):
    # Broadcast.forward without its CPU check.
    ctx.target_gpus = [torch._utils._get_device_index(x, True) for x in target_gpus]
    if not inputs:
        return ()
    ctx.num_inputs = len(inputs)
    ctx.input_device = inputs[0].get_device()
    ctx.complex_mask = [tensor.is_complex() for tensor in inputs]
    outputs = comm.broadcast_coalesced(inputs, ctx.target_gpus)
    for device_outputs in outputs:
        for i, is_complex in enumerate(ctx.complex_mask):
            if is_complex:
                device_outputs[i] = torch.view_as_complex(device_outputs[i])
    constant = [out[i] for i, wanted in enumerate(ctx.needs_input_grad[1:]) if not wanted for out in outputs]
    ctx.mark_non_differentiable(*constant)
    return tuple(chain.from_iterable(outputs))


def _gather_forward(ctx, target_device, dim, *inputs):
    # Gather.forward without its CPU check. A CPU source (-1, what Scatter records for CPU inputs) is device 0 here.
    if target_device == "cpu" or target_device == -1:
        target_device = 0
    ctx.target_device = torch._utils._get_device_index(target_device, True)
    ctx.dim = dim
    ctx.input_gpus = tuple(tensor.get_device() for tensor in inputs)
    ctx.unsqueezed_scalar = dim == 0 and all(tensor.dim() == 0 for tensor in inputs)
    if ctx.unsqueezed_scalar:
        inputs = tuple(tensor.view(1) for tensor in inputs)
        warnings.warn(
            "Was asked to gather along dimension 0, but all input tensors were scalars; will instead unsqueeze and "
            "return a vector.",
            stacklevel=2,
        )
    ctx.input_sizes = tuple(tensor.size(dim) for tensor in inputs)
    output = comm.gather(inputs, dim, ctx.target_device)
    return torch.view_as_complex(output) if inputs and inputs[0].is_complex() else output


class _TorchWith:
    """
    What a module of `torch.nn.parallel` sees as `torch`: the real module, except for the attributes given. For
    `_functions`, an accelerator that is not available, so that `Scatter` does not set up CUDA copy streams for the CPU
    tensors it splits (on a machine that has a GPU); for `parallel_apply`, an accelerator of virtual devices (device
    and stream contexts that only record the device) and CUDA-like autocast on the CPU.
    """

    def __init__(self, **attributes: Any):
        self.__dict__.update(attributes)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_autocast_enabled(device_type: str | None = None) -> bool:
    # The caller's CUDA autocast is the CPU's here.
    return torch.is_autocast_enabled("cpu" if device_type in (None, "cuda") else device_type)


class _VirtualAccelerator:
    def __init__(self, emulation: Emulation):
        self._emulation = emulation

    def is_available(self) -> bool:
        return True

    def current_accelerator(self) -> torch.device:
        return torch.device("cuda")

    def current_stream(self, device: int | None = None) -> contextlib.nullcontext:
        # parallel_apply asks for each replica's stream on the caller's thread, in replica order, before starting the
        # threads: the place to record which devices run (the threads themselves start in any order).
        if device is not None:
            self._emulation.check_devices([device])
            self._emulation.replica_devices.append(device)
        # Every virtual device computes on the CPU, in order: a stream context that does nothing.
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def device_index(self, device: int):
        self._emulation.check_devices([device])
        yield


def _cuda_like_autocast(emulation: Emulation, device_type: str, enabled: bool = True, **kwargs: Any):
    # CUDA autocast entered in a new thread without a dtype takes that thread's CUDA default, float16 (the CPU's
    # would be bfloat16): the emulation computes with the dtype GPUs would use.
    if device_type == "cuda":
        kwargs.setdefault("dtype", torch.get_autocast_dtype("cuda"))
        device_type = "cpu"
    with emulation.lock:
        emulation.autocast_dtypes.append(kwargs["dtype"] if enabled else None)
    return torch.autocast(device_type, enabled=enabled, **kwargs)


def _init_over(emulation: Emulation, init):
    @functools.wraps(init)
    def emulated_init(self, module, device_ids=None, output_device=None, dim=0):
        init(self, module, device_ids, output_device, dim)
        if self.device_ids:
            emulation.check_devices(self.device_ids)
            # torch makes it torch.device(type, device_ids[0]); the module's parameters are on the plain CPU device.
            self.src_device_obj = torch.device("cpu")

    return emulated_init


@contextlib.contextmanager
def simulate_data_parallel(n_devices: int) -> Iterator[Emulation]:
    """
    Within the block, torch's `nn.DataParallel` (and every subclass) runs on `n_devices` virtual devices, all the
    CPU, through torch's own code (see the module docstring for what is replaced). Both the stock
    `transformers.Trainer` (which wraps the model in `nn.DataParallel` when `args.n_gpu > 1`) and `hf_parallel.Trainer`
    then take their DataParallel path; give them arguments from `simulated_training_args(n_devices, ...)`. Yields the
    `Emulation`, whose records say what moved. Blocks do not nest.

    Args:
        n_devices (`int`):
            Virtual devices (>= 1).

    ```python
    import torch
    from hf_parallel.testing import simulate_data_parallel

    with simulate_data_parallel(2) as emulation:
        torch.nn.DataParallel(model)(torch.randn(5, 4)).sum().backward()  # replicas on virtual devices 0 and 1
    emulation.chunk_sizes  # [[3, 2], ...]
    ```
    """
    check_whole_number("n_devices", n_devices, 1)
    if getattr(_data_parallel_module, "_hf_parallel_emulation", None) is not None:
        raise RuntimeError("simulate_data_parallel blocks do not nest: leave the enclosing one first.")
    emulation = Emulation(n_devices)
    data_parallel = torch.nn.DataParallel
    replica_threads = _TorchWith(
        accelerator=_VirtualAccelerator(emulation),
        amp=types.SimpleNamespace(autocast=functools.partial(_cuda_like_autocast, emulation)),
        is_autocast_enabled=_cpu_autocast_enabled,
    )
    patches = [
        (_data_parallel_module, "_hf_parallel_emulation", emulation),
        (torch._C, "_broadcast_coalesced", emulation.broadcast_coalesced),
        (torch._C, "_scatter", emulation.scatter),
        (torch._C, "_gather", emulation.gather),
        (comm, "reduce_add", _reduce_add),
        (_functions.Broadcast, "forward", staticmethod(_broadcast_forward)),
        (_functions.Gather, "forward", staticmethod(_gather_forward)),
        (_data_parallel_module, "_get_available_device_type", lambda: "cpu"),
        (_data_parallel_module, "_get_all_device_indices", lambda: list(range(n_devices))),
        (data_parallel, "__init__", _init_over(emulation, data_parallel.__init__)),
        (_parallel_apply_module, "torch", replica_threads),
        (_functions, "torch", _TorchWith(accelerator=types.SimpleNamespace(is_available=lambda: False))),
    ]
    # mock.patch.object restores what it found as it found it: a class keeps its staticmethod objects, and an
    # attribute that did not exist (a copy a CPU build of torch lacks) is removed again.
    with contextlib.ExitStack() as stack:
        for obj, name, value in patches:
            stack.enter_context(mock.patch.object(obj, name, value, create=True))
        yield emulation


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
