"""
A CPU simulation of `nn.DataParallel` over N virtual devices, to test DataParallel code paths without GPUs and to
dry-run a DataParallel training on any machine.

`SimulatedDataParallel` reproduces what `nn.DataParallel` does to the *values*: the same splitting (without chunk
sizes, `tensor.chunk` semantics: 6 rows on 4 devices -> `[2, 2, 2]`, 5 rows -> `[2, 2, 1]`, so fewer replicas run
than there are devices, `device_ids[:len(chunks)]`), non-tensors shared by every chunk, torch's
`scatter_kwargs` zipping without `strict` (so a tensor argument that splits into fewer chunks than the others
silently drops the extra chunks, as on GPUs), tuples, lists, dicts, namedtuples and `ModelOutput`s gathered the same
way, and 0-dim outputs gathered into a vector, one entry per replica (the per-GPU loss vector). The "replicas" are
the wrapped module itself, run on each chunk in turn, so the gradients of the chunks sum into the parameters exactly
as the backward of DataParallel's broadcast sums the replicas' gradients. `SimulatedBalancedDataParallel` is
`BalancedDataParallel` with only the device transfer swapped, so all its splitting and validation logic is the real
one.

Limits (what it does not reproduce):
- no concurrency: replicas run one after the other on one device, so no speed-up, no thread or stream effects;
- device placement is not checked (`nn.DataParallel` requires the parameters on `device_ids[0]`), nothing moves;
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
from hf_parallel import Trainer
from hf_parallel.testing import simulate_data_parallel, simulated_training_args

args = simulated_training_args(3, output_dir="out", per_device_train_batch_size=2, gpu0_bsz=1)
with simulate_data_parallel(3):
    Trainer(model=model, args=args, train_dataset=train_ds).train()  # batches of 6 rows split [1, 3, 2]
```
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .data_parallel import BalancedDataParallel, _is_namedtuple, _scatter_inputs, scatter_structure

__all__ = [
    "SimulatedBalancedDataParallel",
    "SimulatedDataParallel",
    "simulate_data_parallel",
    "simulated_gather",
    "simulated_scatter",
    "simulated_scatter_kwargs",
    "simulated_training_args",
    "spawn_cpu_ranks",
]

# Devices a SimulatedDataParallel built without device_ids uses: set by simulate_data_parallel().
_active_devices: int | None = None


def simulated_scatter(inputs: Any, num_devices: int, dim: int = 0) -> list[Any]:
    """
    What `torch.nn.parallel.scatter(inputs, list(range(num_devices)), dim)` returns, computed on CPU.

    Tensors are split with `tensor.chunk(num_devices, dim)` (what `comm.scatter` does without chunk sizes), so they
    can give fewer chunks than devices; containers are zipped without `strict`, so the shortest branch wins;
    anything else is repeated once per device.

    Args:
        inputs (`Any`):
            A tensor, or tuples, lists, dicts and namedtuples of them and of other objects.
        num_devices (`int`):
            Virtual devices to split over.
        dim (`int`, *optional*, defaults to 0):
            Dimension to split tensors along.

    ```python
    import torch
    from hf_parallel.testing import simulated_scatter

    [t.shape[0] for t in simulated_scatter(torch.zeros(5, 2), 4)]  # [2, 2, 1]
    ```
    """

    def chunk(tensor: torch.Tensor):
        return tensor.chunk(num_devices, dim)  # a 0-dim tensor raises here, as in torch's Scatter

    return scatter_structure(inputs, num_devices, split=chunk, copy=chunk, strict=False)


def simulated_scatter_kwargs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, num_devices: int, dim: int = 0
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """
    What `torch.nn.parallel.scatter_gather.scatter_kwargs` returns, computed on CPU, quirks included: positional
    and keyword inputs are scattered separately, then the shorter list is padded with `()` / `{}` (torch compares
    the kwargs list with `len(inputs)`, the number of positional arguments, and this does too).

    Args:
        inputs (`tuple`):
            Positional arguments.
        kwargs (`dict`, *optional*):
            Keyword arguments.
        num_devices (`int`):
            Virtual devices to split over.
        dim (`int`, *optional*, defaults to 0):
            Dimension to split tensors along.

    ```python
    import torch
    from hf_parallel.testing import simulated_scatter_kwargs

    args, kwargs = simulated_scatter_kwargs((), {"x": torch.zeros(6, 1), "flag": True}, 4)
    len(kwargs)  # 3: six rows chunk into three pieces
    ```
    """
    scattered_inputs = simulated_scatter(inputs, num_devices, dim) if inputs else []
    scattered_kwargs = simulated_scatter(kwargs, num_devices, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def _gather_tensors(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    # torch's Gather: when every input is 0-dim and dim == 0, they are viewed as 1-element vectors first (and
    # torch warns "Was asked to gather along dimension 0, but all input tensors were scalars").
    if dim == 0 and all(t.dim() == 0 for t in tensors):
        tensors = [t.view(1) for t in tensors]
    return torch.cat(list(tensors), dim=dim)


def simulated_gather(outputs: Sequence[Any], dim: int = 0) -> Any:
    """
    What `torch.nn.parallel.gather(outputs, target_device, dim)` returns, computed on CPU: tensors concatenated along
    `dim` (0-dim tensors into a vector), dicts and `ModelOutput`s key by key, namedtuples, tuples and lists element by
    element, `None` stays `None`.

    Args:
        outputs (`Sequence`):
            One output per replica.
        dim (`int`, *optional*, defaults to 0):
            Dimension to concatenate tensors along.

    ```python
    import torch
    from hf_parallel.testing import simulated_gather

    simulated_gather([torch.tensor(1.0), torch.tensor(2.0)])  # tensor([1., 2.]): the per-device loss vector
    ```
    """

    def gather_map(outputs):
        out = outputs[0]
        if isinstance(out, torch.Tensor):
            return _gather_tensors(outputs, dim)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in outputs):
                raise ValueError("All dicts must have the same number of keys")
            return type(out)((k, gather_map([d[k] for d in outputs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outputs, strict=True)))
        return type(out)(map(gather_map, zip(*outputs, strict=True)))

    return gather_map(outputs)


def _rows(chunk_args: Sequence[Any], chunk_kwargs: dict[str, Any], dim: int) -> int | None:
    for value in (*chunk_args, *chunk_kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > dim:
            return value.size(dim)
    return None


class SimulatedDataParallel(nn.DataParallel):
    """
    `nn.DataParallel` over virtual devices, on the device the module is on (CPU included). See the module docstring
    for what it reproduces and its limits.

    After each forward, `last_chunk_sizes` holds the rows each replica got (from its first tensor argument with a
    batch dimension; `None` for a replica without one).

    Args:
        module (`nn.Module`):
            The model.
        device_ids (`list[int]`, *optional*):
            Virtual device ids (only their number matters; `[0, 0]` is two devices). Defaults to
            `range(n_devices)`.
        output_device (`int`, *optional*):
            Accepted for compatibility, unused: everything stays where it is.
        dim (`int`, *optional*, defaults to 0):
            Batch dimension.
        n_devices (`int`, *optional*):
            Number of virtual devices when `device_ids` is not given; defaults to the one of the enclosing
            `simulate_data_parallel`.

    ```python
    from hf_parallel.testing import SimulatedDataParallel

    dp = SimulatedDataParallel(model, n_devices=4)
    logits = dp(input_ids=ids).logits  # 5 rows run as chunks [2, 2, 1] on 3 replicas, as on 4 GPUs
    ```
    """

    # The balanced class the Trainer uses while this class stands in for torch.nn.DataParallel.
    hf_parallel_balanced_class: type[nn.Module]

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int] | None = None,
        output_device: int | None = None,
        dim: int = 0,
        *,
        n_devices: int | None = None,
    ):
        # Skip nn.DataParallel.__init__: it looks for real accelerators and, on a CPU-only machine, makes a wrapper
        # that never splits anything.
        nn.Module.__init__(self)
        if device_ids is None:
            n_devices = n_devices if n_devices is not None else _active_devices
            if n_devices is None:
                raise ValueError(
                    "SimulatedDataParallel needs a number of virtual devices: pass device_ids or n_devices, or build "
                    "it inside `with simulate_data_parallel(n_devices):`."
                )
            device_ids = range(n_devices)
        device_ids = [int(d) for d in device_ids]
        if not device_ids:
            raise ValueError("SimulatedDataParallel needs at least one virtual device, got device_ids=[].")
        self.module = module
        self.dim = dim
        self.device_ids = device_ids
        self.output_device = device_ids[0] if output_device is None else output_device
        first = next(_params_and_buffers(module), None)
        self.src_device_obj = first.device if first is not None else torch.device("cpu")
        self.last_chunk_sizes: list[int | None] = []

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # nn.DataParallel.forward, step for step, without the device check.
        inputs, module_kwargs = self.scatter(inputs, kwargs, self.device_ids)
        if not inputs and not module_kwargs:
            inputs = ((),)
            module_kwargs = ({},)
        self.last_chunk_sizes = [_rows(a, k, self.dim) for a, k in zip(inputs, module_kwargs, strict=False)]
        if len(self.device_ids) == 1:
            return self.module(*inputs[0], **module_kwargs[0])
        replicas = self.replicate(self.module, self.device_ids[: len(inputs)])
        outputs = self.parallel_apply(replicas, inputs, module_kwargs)
        return self.gather(outputs, self.output_device)

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[int]) -> Any:
        return simulated_scatter_kwargs(inputs, kwargs, len(device_ids), self.dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[int]) -> list[nn.Module]:
        # One module run on every chunk: the chunks' gradients add up in its parameters, as DataParallel's
        # Broadcast backward adds up the replicas' gradients.
        return [module for _ in device_ids]

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any, *_: Any) -> list[Any]:
        if len(replicas) != len(inputs):
            raise AssertionError(
                f"The number of modules {len(replicas)} is not equal to the number of inputs {len(inputs)}"
            )
        if kwargs is None:
            kwargs = ({},) * len(replicas)
        elif len(replicas) != len(kwargs):
            raise AssertionError(
                f"The number of modules {len(replicas)} is not equal to the number of kwargs_tup {len(kwargs)}"
            )
        outputs = []
        for module, chunk, chunk_kwargs in zip(replicas, inputs, kwargs, strict=True):
            if not isinstance(chunk, (list, tuple)):
                chunk = (chunk,)
            outputs.append(module(*chunk, **chunk_kwargs))
        return outputs

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        return simulated_gather(outputs, self.dim)


def _params_and_buffers(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


class SimulatedBalancedDataParallel(BalancedDataParallel, SimulatedDataParallel):
    """
    `BalancedDataParallel` over virtual devices: its own chunk sizes, validation and device skipping, with only the
    device transfer replaced (tensors are split in place, 0-dim tensors shared). Same arguments as
    `BalancedDataParallel`, plus `n_devices` as in `SimulatedDataParallel`.

    ```python
    from hf_parallel.testing import SimulatedBalancedDataParallel

    dp = SimulatedBalancedDataParallel(model, gpu0_bsz=1, n_devices=3)
    dp(input_ids=ids)  # 6 rows -> chunks [1, 3, 2]
    dp.last_chunk_sizes  # [1, 3, 2]
    ```
    """

    def _check_module_device(self) -> None:
        # Nothing is placed on devices in the simulation (a documented limit).
        return None

    def _scatter_chunks(self, inputs, kwargs, device_ids, chunk_sizes):
        chunk_sizes = list(chunk_sizes)

        def split(tensor):
            return tensor.split(chunk_sizes, self.dim)

        def copy(tensor):
            return [tensor for _ in device_ids]

        scattered = _scatter_inputs(inputs, kwargs, len(device_ids), split, copy)
        self.last_chunk_sizes = [_rows(a, k, self.dim) for a, k in zip(*scattered, strict=True)]
        return scattered

    def parallel_apply(self, replicas, inputs, kwargs, device_ids=None):
        return SimulatedDataParallel.parallel_apply(self, replicas, inputs, kwargs)


SimulatedDataParallel.hf_parallel_balanced_class = SimulatedBalancedDataParallel


@contextlib.contextmanager
def simulate_data_parallel(n_devices: int) -> Iterator[type[SimulatedDataParallel]]:
    """
    Within the block, `torch.nn.DataParallel` is `SimulatedDataParallel` over `n_devices` virtual devices, and
    `hf_parallel.Trainer` wraps with `SimulatedBalancedDataParallel` when `gpu0_bsz`/`gpu0_weight` is set. Both the
    stock `transformers.Trainer` (which calls `nn.DataParallel(model)` when `args.n_gpu > 1`) and `hf_parallel.Trainer`
    then run their DataParallel path on CPU. Give the Trainer arguments from `simulated_training_args(n_devices, ...)`
    so that `args.n_gpu == n_devices`.

    Only code that looks `torch.nn.DataParallel` (or `torch.nn.parallel.DataParallel`) up at call time sees the
    simulation: transformers and accelerate do. A real `BalancedDataParallel` built directly inside the block is not
    simulated; build `SimulatedBalancedDataParallel` instead.

    Args:
        n_devices (`int`):
            Virtual devices (>= 1).

    ```python
    from transformers import Trainer
    from hf_parallel.testing import simulate_data_parallel, simulated_training_args

    args = simulated_training_args(2, output_dir="out", per_device_train_batch_size=4)
    with simulate_data_parallel(2):
        Trainer(model=model, args=args, train_dataset=ds).train()  # batches of 8 rows on 2 virtual GPUs
    ```
    """
    global _active_devices
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices must be a whole number >= 1, got {n_devices!r}.")
    saved = (_active_devices, torch.nn.DataParallel, torch.nn.parallel.DataParallel)
    _active_devices = n_devices
    torch.nn.DataParallel = SimulatedDataParallel
    torch.nn.parallel.DataParallel = SimulatedDataParallel
    try:
        yield SimulatedDataParallel
    finally:
        _active_devices, torch.nn.DataParallel, torch.nn.parallel.DataParallel = saved


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
    import transformers
    from hf_parallel.testing import simulated_training_args

    args = simulated_training_args(3, transformers.TrainingArguments, output_dir="out", per_device_train_batch_size=2)
    args.n_gpu, args.train_batch_size  # (3, 6)
    ```
    """
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices must be a whole number >= 1, got {n_devices!r}.")
    if args_class is None:
        from .training_args import TrainingArguments as args_class
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


# ---- Real DDP ranks on CPU ----------------------------------------------------------------------------------------


def _rank_entry(rank: int, function: Callable, args: tuple, world_size: int, store_path: str) -> None:
    os.environ.update(
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        ACCELERATE_USE_CPU="yes",
        ACCELERATE_MIXED_PRECISION="no",
        GLOO_SOCKET_IFNAME="lo",
    )
    # On a timeout the parent sends SIGUSR1 first: every rank then prints where it is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    function(*args)
    _part_together(store, world_size)
    # Leave without the interpreter's teardown: every DDP object is released above, so nothing of gloo is left for
    # it but the destructors of module globals, which can abort at exit ("terminate called without an active
    # exception"). An exception above still goes through torch's own handler, which reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _part_together(store: dist.Store, world_size: int) -> None:
    """
    Release this rank's distributed objects, then wait until every rank has released its own, before any leaves.

    A rank whose function returned may still hold a trainer and its DDP wrapper in reference cycles; freed later,
    while another rank has already exited, their destructors have been seen to hang (the stuck rank showed no
    Python frame below `function(*args)`). So collect them now, while every peer is alive, and meet at the store
    (not at a gloo collective: the function may have destroyed the process group already).
    """
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()
    store.add("hf_parallel/released", 1)
    while int(store.add("hf_parallel/released", 0)) < world_size:
        time.sleep(0.05)


def spawn_cpu_ranks(function: Callable, args: tuple = (), num_processes: int = 2, timeout: float = 300.0) -> None:
    """
    Run `function(*args)` in `num_processes` fresh CPU processes that form one gloo process group, as a DDP launch
    would; `TrainingArguments(use_cpu=True)` or `PartialState()` inside then see a distributed run.

    Like `accelerate.debug_launcher`, but spawned, not forked: a fork of a process whose OpenMP thread pool has run
    (any earlier torch op, e.g. a previous test) can deadlock in the child, which then waits forever on a futex. The
    function must be importable (defined at module level); a rank that raises makes this raise, with its traceback.
    When it returns, each rank frees what it left behind (a trainer and its DDP wrapper in reference cycles),
    destroys the process group if the function did not, and waits until every rank has done so before any exits,
    so that no rank tears down gloo objects while a peer has already gone.

    Args:
        function (`Callable`): the body of each rank.
        args (`tuple`, *optional*): passed to `function`.
        num_processes (`int`, *optional*, defaults to 2): the world size.
        timeout (`float`, *optional*, defaults to 300): seconds before the ranks print their stacks, are killed and
            `TimeoutError` is raised, so that a rank stuck in a collective fails the caller instead of blocking it.

    ```python
    from hf_parallel.testing import spawn_cpu_ranks

    spawn_cpu_ranks(train_and_check, args=("out",), num_processes=2)
    ```
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a whole number >= 1, got {num_processes!r}.")
    with tempfile.TemporaryDirectory() as tmp:
        context = torch.multiprocessing.start_processes(
            _rank_entry,
            args=(function, args, num_processes, os.path.join(tmp, "store")),
            nprocs=num_processes,
            start_method="spawn",
            join=False,
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):  # raises, with the traceback, as soon as a rank fails
            if time.monotonic() > deadline:
                alive = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
                for rank in alive:
                    os.kill(context.processes[rank].pid, signal.SIGUSR1)  # each prints its stacks to stderr
                time.sleep(2)
                for process in context.processes:
                    process.kill()
                raise TimeoutError(
                    f"spawn_cpu_ranks: ranks {alive} of {num_processes} still running after {timeout:g} s "
                    f"({getattr(function, '__qualname__', function)}); they were killed."
                )
