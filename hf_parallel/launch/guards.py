"""Launch guards: catch the mis-launches that make multi-GPU training silently wrong, before training starts.

Three traps, each measured on transformers 5.24 / accelerate 1.15 / torch 2.13:

1. A launcher (`torchrun`, `accelerate launch`, `mpirun`) started N processes but the Trainer did not join them into
   one DDP group. On a machine without GPUs and without `use_cpu`, accelerate sees no device backend, so each
   process trains its own unsynchronised copy of the model, all save to the same folder, and the launch exits 0.
2. `CUDA_VISIBLE_DEVICES` changed after CUDA was initialised (e.g. set in the script after `init_process_group`).
   CUDA reads it once, at initialisation, so the change has no effect: the process runs on other GPUs than the
   script says.
3. `nn.DataParallel` over several GPUs (one process, no launcher). It works, but DDP is faster and scales; a
   one-line hint says how to launch it.

And one downgrade, measured on transformers 5.24 / accelerate 1.16: `fsdp` or a DeepSpeed config asked for, but
accelerate runs DDP or a single process instead (`use_cpu`, or no GPU): every rank then holds the whole model and
the optimizer state, and nothing says so. `check_sharding` warns.
"""

from __future__ import annotations

import os

import torch
from transformers.training_args import ParallelMode
from transformers.utils import logging

# launcher_world_size and WORLD_SIZE_VARIABLES are re-exported: code that imported them from here keeps working.
from .environment import WORLD_SIZE_VARIABLES, launcher_world_size, world_size_variable

__all__ = [
    "WORLD_SIZE_VARIABLES",
    "batch_statistics_split",
    "check_data_parallel",
    "check_launch",
    "check_pipeline",
    "check_rank_has_a_gpu",
    "check_sharding",
    "check_visible_devices",
    "check_world_size",
    "launcher_world_size",
]

logger = logging.get_logger(__name__)

# CUDA_VISIBLE_DEVICES as this process had it when CUDA initialised. Until that is recorded, the value when
# hf_parallel was imported stands in: the best record there is when CUDA was initialised before that import, or
# with a torch that drops the private helper below.
_visible_devices_at_cuda_init: str | None = os.environ.get("CUDA_VISIBLE_DEVICES")


def _record_visible_devices_at_cuda_init() -> None:
    # Runs inside torch.cuda._lazy_init, right after the driver read CUDA_VISIBLE_DEVICES: it must never raise.
    global _visible_devices_at_cuda_init
    _visible_devices_at_cuda_init = os.environ.get("CUDA_VISIBLE_DEVICES")


if hasattr(torch.cuda, "_lazy_call"):
    # torch runs the queued calls of `_lazy_call` once, when CUDA initialises (in `torch.cuda._lazy_init`), which
    # records the value the driver actually used; at once when CUDA is initialised already, which records the value
    # at import.
    torch.cuda._lazy_call(_record_visible_devices_at_cuda_init)


def check_world_size(args) -> None:
    """
    Raise when a launcher started several processes but the Trainer would train in this one alone.

    Without this check, each process trains its own unsynchronised copy of the model and the launch exits 0: on a
    machine without GPUs, `torchrun --nproc_per_node 2` or a multi-GPU accelerate config gives each process a
    process group that accelerate then ignores (`DistributedType.NO`), because no device backend was found.

    Args:
        args (`transformers.TrainingArguments`):
            The Trainer's arguments; reading `args.world_size` sets up the devices and the process group.

    Raises:
        `RuntimeError`: `WORLD_SIZE` (or an MPI equivalent) is above 1 and differs from `args.world_size`.

    ```python
    from hf_parallel import TrainingArguments
    from hf_parallel.launch.guards import check_world_size

    check_world_size(TrainingArguments(output_dir="out"))  # silent in a single process
    ```
    """
    launched = launcher_world_size()
    if launched <= 1 or args.world_size == launched:
        return
    if args.parallel_mode == ParallelMode.SAGEMAKER_MODEL_PARALLEL:
        # There world_size is the data-parallel size (smp.dp_size()), smaller than the processes by design.
        return
    variable = world_size_variable()
    fix = (
        "This machine has no GPU, so the processes must be told to use the CPU: pass `--use_cpu` to the script "
        "(`TrainingArguments(use_cpu=True)`), or launch with ACCELERATE_USE_CPU=1 set, e.g. "
        "`accelerate launch --config_file hf_parallel/configs/cpu_ddp.yaml train.py --use_cpu` "
        "(`hf-parallel config` writes a config for this machine and prints the command)."
        # No accelerator that accelerate would form a process group over, and the CPU was not asked for.
        if not (torch.cuda.is_available() or torch.accelerator.is_available() or args.use_cpu)
        else "Launch with `accelerate launch` (or `torchrun`) so that every process joins one process group, and "
        "check that `hf-parallel env` run under the same launcher reports DDP."
    )
    raise RuntimeError(
        f"A launcher started {launched} processes ({variable}={launched}), but this one would train alone "
        f"(world_size={args.world_size}, parallel_mode={args.parallel_mode.value}): each process would train its "
        f"own unsynchronised copy of the model and overwrite the others' checkpoints. {fix}"
    )


def check_rank_has_a_gpu(args) -> None:
    """
    Raise when this process's local rank has no GPU of its own: on a machine with GPUs, rank r computes on GPU r, and
    a launch of more processes per machine than it has GPUs fails inside torch with "CUDA error: invalid device
    ordinal" (accelerate's device set-up, or transformers' loading with a `DistributedConfig`, which binds rank r to
    GPU r before any Trainer exists: run the check before loading, `check_rank_has_a_gpu(args)`).

    Args:
        args (`transformers.TrainingArguments`):
            The Trainer's arguments (`use_cpu` is read, the devices are not set up).

    Raises:
        `RuntimeError`: `LOCAL_RANK` is not below the GPUs this process sees, and `use_cpu` is off.

    ```python
    from hf_parallel import TrainingArguments
    from hf_parallel.launch.guards import check_rank_has_a_gpu

    check_rank_has_a_gpu(TrainingArguments(output_dir="out"))  # silent outside a launch
    ```
    """
    local_rank = os.environ.get("LOCAL_RANK")
    if args.use_cpu or local_rank is None or not local_rank.isdigit() or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if int(local_rank) < gpus:
        return
    raise RuntimeError(
        f"This process is local rank {local_rank}, but it sees {gpus} GPU(s) (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}): each process of a launch computes on its own GPU, so "
        f"a machine runs at most {gpus} of them. Launch at most {gpus} processes per machine (`accelerate launch "
        f"--num_processes {gpus}`, or `torchrun --nproc_per_node {gpus}`), or train on the CPU with `--use_cpu` "
        "(TrainingArguments(use_cpu=True)) and the gloo backend."
    )


def check_visible_devices() -> None:
    """
    Warn when `CUDA_VISIBLE_DEVICES` changed after CUDA was initialised in this process.

    CUDA reads the variable once, when it initialises; a later change (e.g. setting it after `init_process_group`)
    has no effect, so the process runs on other GPUs than the script names. Set it before anything touches CUDA, or
    let the launcher set it (`gpu_ids` in an accelerate config).

    ```python
    from hf_parallel.launch.guards import check_visible_devices

    check_visible_devices()  # silent unless CUDA is initialised and the variable changed since
    ```
    """
    if not torch.cuda.is_initialized():
        # Not read yet: whatever it says now is what CUDA will use.
        return
    seen = _visible_devices_at_cuda_init
    now = os.environ.get("CUDA_VISIBLE_DEVICES")
    if now == seen:
        return
    logger.warning(
        f"CUDA_VISIBLE_DEVICES changed after CUDA was initialised in this process (CUDA read {seen!r}, it is now "
        f"{now!r}); the change has no effect, and this process uses the GPUs of {seen!r}. Set CUDA_VISIBLE_DEVICES "
        "before anything touches CUDA (first line of the script, or in the shell: `CUDA_VISIBLE_DEVICES=2,3 "
        "accelerate launch ...`), or use `gpu_ids` in the accelerate config."
    )


def check_data_parallel(args) -> None:
    """
    Log a one-line hint when the Trainer is about to use `nn.DataParallel` over several GPUs.

    Args:
        args (`transformers.TrainingArguments`):
            The Trainer's arguments; DataParallel is chosen when one process sees several GPUs (`args.n_gpu > 1`).

    ```python
    from hf_parallel import TrainingArguments
    from hf_parallel.launch.guards import check_data_parallel

    check_data_parallel(TrainingArguments(output_dir="out"))  # silent on one device
    ```
    """
    if args.parallel_mode != ParallelMode.NOT_DISTRIBUTED:
        return
    logger.warning(
        f"Training with nn.DataParallel over {args.n_gpu} GPUs in one process; DDP is faster: "
        f"`accelerate launch --num_processes {args.n_gpu} your_script.py` (`hf-parallel config` writes a config)."
    )


def check_launch(args) -> None:
    """
    Run every launch guard of this module on the Trainer's arguments: raise on a launch that would train
    unsynchronised copies, warn on a `CUDA_VISIBLE_DEVICES` change that has no effect, hint at DDP under DataParallel.

    Args:
        args (`transformers.TrainingArguments`):
            The Trainer's arguments.

    ```python
    from hf_parallel import TrainingArguments
    from hf_parallel.launch.guards import check_launch

    check_launch(TrainingArguments(output_dir="out"))
    ```
    """
    check_rank_has_a_gpu(args)  # before the device set-up that `world_size` starts, which would fail without a word
    check_world_size(args)
    check_visible_devices()
    check_data_parallel(args)


def sharding_downgrade(args, distributed_type: str, num_processes: int) -> str | None:
    """
    Why the sharding `args` ask for (`fsdp`, `deepspeed`) is not what accelerate runs (`distributed_type`, the value
    of its `DistributedType`), or None when it is, or none was asked for.
    """
    fsdp_config = args.fsdp_config or {}
    if args.fsdp and not fsdp_config.get("xla", False):
        asked, runs_as = f"fsdp (FSDP version {fsdp_config.get('version', 1)})", "FSDP"
    elif args.deepspeed:
        asked, runs_as = "deepspeed (a ZeRO config)", "DEEPSPEED"
    else:
        return None
    if distributed_type == runs_as:
        return None
    runs = {"MULTI_CPU": f"DDP over {num_processes} CPU processes (gloo)", "NO": "a single process"}.get(
        distributed_type, f"{distributed_type} with {num_processes} processes"
    )
    if args.use_cpu or distributed_type in ("MULTI_CPU", "NO"):
        why = (
            f"accelerate enables {runs_as} only on GPUs and other accelerators (in AcceleratorState), not on the CPU "
            f"(use_cpu={args.use_cpu})"
        )
    else:
        why = "accelerate did not select it (check the launch: `hf-parallel env` under the same launcher)"
    return (
        f"{asked} was asked for, but accelerate runs {runs}: {why}. Every process holds the whole model, its "
        "gradients and optimizer state. The loss is still exact; drop the option to silence this warning, or launch "
        "on GPUs to shard."
    )


def check_sharding(args, accelerator) -> None:
    """
    Warn when `fsdp` or a DeepSpeed config was asked for but accelerate runs DDP or a single process instead:
    with `use_cpu` (or without GPUs) accelerate silently drops the FSDP plugin (the run is MULTI_CPU, which has no
    FSDP branch) and DeepSpeed (`ACCELERATE_USE_DEEPSPEED` is read only without `cpu`).

    Args:
        args (`transformers.TrainingArguments`):
            The Trainer's arguments.
        accelerator (`accelerate.Accelerator`):
            The Trainer's accelerator: its `distributed_type` is what runs.

    ```python
    from hf_parallel.launch.guards import check_sharding

    check_sharding(trainer.args, trainer.accelerator)  # hf_parallel.Trainer does this once it is built
    ```
    """
    reason = sharding_downgrade(args, accelerator.distributed_type.value, accelerator.num_processes)
    if reason is not None:
        logger.warning(reason)


def check_pipeline(model) -> None:
    """
    Refuse a model split into pipeline stages at load time (`from_pretrained(..., distributed_config=
    DistributedConfig(pp_size=N))`): the Trainer has no pipeline schedule (accelerate does not support pipeline
    parallelism), and stock's Trainer stops inside its first step's preparation, on CPU ranks with gloo's "Connection
    reset by peer".

    Args:
        model (`nn.Module`): the model given to the Trainer.

    ```python
    from hf_parallel.launch.guards import check_pipeline

    check_pipeline(model)  # ValueError for a model loaded with DistributedConfig(pp_size=2)
    ```
    """
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    stages = getattr(config, "pp_size", None) or 1
    if stages > 1:
        raise ValueError(
            f"The model is split into {stages} pipeline stages at load time (DistributedConfig(pp_size={stages})), "
            "and the Trainer does not support pipeline parallelism. To train it on several GPUs, load it with "
            "DistributedConfig(tp_size=..., fsdp_size=...) instead (tensor parallelism, FSDP2), or without a "
            "distributed_config under accelerate launch (DDP)."
        )


def evaluation_dataset_name(description: str, metric_key_prefix: str) -> str:
    """How the user passed an evaluation loop's dataset: eval_dataset (a dict entry by its key) or test_dataset."""
    name = "eval_dataset" if description == "Evaluation" else "test_dataset"
    if metric_key_prefix not in ("eval", "test"):
        name += f"[{metric_key_prefix.removeprefix('eval_')!r}]"
    return name


def check_not_empty(dataset, name: str) -> None:
    """
    Raise when `dataset` has a length and it is 0: stock then trains 0 steps with a message about IterableDatasets,
    or evaluates into metrics without a loss, and neither says that the data is empty. Datasets without a length
    (iterable ones) cannot be checked before they run.

    Args:
        dataset (`Any`):
            The dataset, or None (nothing to check: the stock Trainer reports a missing dataset itself).
        name (`str`):
            How the user passed it (`"train_dataset"`, `"eval_dataset"`, ...), for the message.

    ```python
    from hf_parallel.launch.guards import check_not_empty

    check_not_empty([], "train_dataset")  # ValueError: train_dataset is empty ...
    ```
    """
    try:
        length = len(dataset)
    except TypeError:  # None, a dataset without a length, or accelerate's IterableDatasetShard around one
        return
    if length == 0:
        # Training: stock's words first (its sampler's), as code written against stock matches them.
        stock = (
            "num_samples should be a positive integer value, but got num_samples=0: "
            if name == "train_dataset"
            else ""
        )
        raise ValueError(
            f"{stock}{name} is empty (a {type(dataset).__name__} of length 0): there is nothing to "
            f"{'train on' if name.startswith('train') else 'evaluate'}. Check the file, split or filter that built "
            "it (e.g. a `.filter(...)` or `max_*_samples` that removed every row)."
        )


def batch_statistics_split(model: torch.nn.Module, args) -> str | None:
    """
    Why `model`'s forward depends on how the step's rows are split, or None: batch normalisation layers (the Trainer
    puts them in training mode) compute their statistics over the rows of each forward, so gradient accumulation,
    DataParallel replicas and DDP ranks (without `SyncBatchNorm`) each normalise their own share; no split of the step
    then equals one forward on all its rows. That is the model, not the loss: it trains as stock does.
    """
    layers = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not layers:
        return None
    synced = all(isinstance(m, torch.nn.SyncBatchNorm) for m in layers)
    splits = []
    if args.gradient_accumulation_steps > 1:
        splits.append(f"each of the {args.gradient_accumulation_steps} accumulated micro-batches")
    if args.n_gpu > 1:
        splits.append(f"each of the {args.n_gpu} DataParallel replicas")
    if args.world_size > 1 and not synced:
        splits.append(f"each of the {args.world_size} ranks (convert them with nn.SyncBatchNorm under DDP)")
    if not splits:
        return None
    return (
        f"{type(model).__name__} has {len(layers)} batch normalisation layers: in training their statistics are "
        f"computed over {', and over '.join(splits)}, so the step is not one forward over all its rows, whatever the "
        "loss (the model trains as stock does)."
    )
