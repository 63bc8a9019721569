"""
Real DDP ranks on CPU for tests: `spawn_cpu_ranks` runs a function in fresh processes that form one gloo process
group, as a launcher would, and fails the caller (never blocks it) when a rank raises or hangs.
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
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist

from ..launch.validation import check_whole_number
from .accelerator import cpu_as_accelerator as _cpu_as_accelerator

__all__ = ["spawn_cpu_ranks"]


def _rank_entry(
    rank: int, function: Callable, args: tuple, world_size: int, store_path: str, cpu_as_accelerator: bool
) -> None:
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
    with _cpu_as_accelerator() if cpu_as_accelerator else contextlib.nullcontext():
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


def spawn_cpu_ranks(
    function: Callable,
    args: tuple = (),
    num_processes: int = 2,
    timeout: float = 300.0,
    cpu_as_accelerator: bool = False,
) -> None:
    """
    Run `function(*args)` in `num_processes` fresh CPU processes that form one gloo process group, as a DDP launch
    would; `TrainingArguments(use_cpu=True)` or `PartialState()` inside then see a distributed run.

    The ranks see no GPU (`CUDA_VISIBLE_DEVICES` is empty in their environment), so that they run on the CPU on any
    machine: on one with fewer GPUs than ranks, code that binds rank r to GPU r (transformers' loading with a
    `DistributedConfig`) would fail with "invalid device ordinal". Each rank computes on one thread unless
    `OMP_NUM_THREADS` says otherwise, as under `torchrun`, so that the ranks do not contend for the cores.

    Like `accelerate.debug_launcher`, but spawned, not forked: a fork of a process whose OpenMP thread pool has run
    (any earlier torch op, e.g. a previous test) can deadlock in the child, which then waits forever on a futex. The
    function must be importable (defined at module level); a rank that raises makes this raise, with its traceback.
    When it returns, each rank frees what it left behind (a trainer and its DDP wrapper in reference cycles),
    destroys the process group if the function did not, and waits until every rank has done so before any exits,
    so that no rank tears down gloo objects while a peer has already gone.

    Args:
        function (`Callable`):
            The body of each rank.
        args (`tuple`, *optional*, defaults to `()`):
            Passed to `function`.
        num_processes (`int`, *optional*, defaults to `2`):
            The world size.
        timeout (`float`, *optional*, defaults to `300.0`):
            Seconds before the ranks print their stacks, are killed and `TimeoutError` is raised, so that a rank
            stuck in a collective fails the caller instead of blocking it.
        cpu_as_accelerator (`bool`, *optional*, defaults to `False`):
            Run `function` inside `hf_parallel.testing.cpu_as_accelerator()`: accelerate takes the CPU for an
            accelerator with gloo, so that the Trainer's DeepSpeed path runs on these ranks. `TrainingArguments` inside
            must then keep `use_cpu=False`.

    ```python
    import tempfile

    from hf_parallel.testing import spawn_cpu_ranks

    with tempfile.TemporaryDirectory() as output_dir:
        spawn_cpu_ranks(train_and_check, args=(output_dir,), num_processes=2)
    ```
    """
    check_whole_number("num_processes", num_processes, 1)
    # The environment the ranks inherit, restored after: no GPU visible, one OpenMP thread unless set.
    environment = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, environment):
        context = torch.multiprocessing.start_processes(
            _rank_entry,
            args=(function, args, num_processes, os.path.join(tmp, "store"), cpu_as_accelerator),
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
