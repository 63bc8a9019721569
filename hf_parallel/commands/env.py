"""
`hf-parallel env`: what a bug report about multi-GPU training needs, and the parallel mode and global batch
`hf_parallel.Trainer` would pick. This subcommand imports torch (it reports torch's own view of the GPUs).

```bash
hf-parallel env --per-device-train-batch-size 16 --gradient-accumulation-steps 2
accelerate launch -m hf_parallel.commands.main env   # what each launched process sees
```
"""

from __future__ import annotations

import argparse
import os
import platform
from importlib import metadata

from ..launch.environment import cpu_requested, launcher_variables, launcher_world_size
from ..launch.validation import check_whole_number
from .gpus import torch_gpu_count

__all__ = ["add_parser", "env_report", "trainer_mode"]

REPORTED_PACKAGES = ("torch", "transformers", "accelerate", "datasets", "safetensors")
# The torch.distributed backends reported, each with its `torch.distributed.is_<name>_available()`.
BACKENDS = ("nccl", "gloo", "mpi")


def trainer_mode(
    num_gpus: int, world_size: int, use_cpu: bool, per_device_batch: int, grad_accum: int
) -> tuple[str, int, str]:
    """
    The parallel mode `hf_parallel.Trainer` would pick, and the effective global batch (rows per optimizer step).

    Args:
        num_gpus (`int`): GPUs visible to one process.
        world_size (`int`): processes started by a launcher (1 without one).
        use_cpu (`bool`): whether the processes are told to use the CPU.
        per_device_batch (`int`): `per_device_train_batch_size`.
        grad_accum (`int`): `gradient_accumulation_steps`.

    Returns:
        `tuple[str, int, str]`: the mode (`"DDP"`, `"DataParallel"`, `"single"` or `"error"`), the global batch
        (0 for `"error"`) and a sentence explaining it.

    ```python
    from hf_parallel.commands.env import trainer_mode

    trainer_mode(num_gpus=4, world_size=1, use_cpu=False, per_device_batch=8, grad_accum=1)
    # ("DataParallel", 32, "...")
    ```
    """
    if world_size > 1:
        if num_gpus == 0 and not use_cpu:
            return (
                "error",
                0,
                f"{world_size} processes were launched on a machine without GPUs and without use_cpu: "
                "hf_parallel.Trainer stops with an error (stock transformers would train unsynchronised copies). "
                "Pass --use_cpu to the script or set ACCELERATE_USE_CPU=1.",
            )
        device = "CPU processes (gloo)" if use_cpu or num_gpus == 0 else "processes, one GPU each"
        batch = per_device_batch * grad_accum * world_size
        return "DDP", batch, f"DDP over {world_size} {device}: {per_device_batch} x {grad_accum} x {world_size}"
    if num_gpus > 1 and not use_cpu:
        batch = per_device_batch * grad_accum * num_gpus
        return (
            "DataParallel",
            batch,
            f"nn.DataParallel over {num_gpus} GPUs in one process: {per_device_batch} x {grad_accum} x {num_gpus} "
            f"(DDP is faster: accelerate launch --num_processes {num_gpus} ...)",
        )
    device = "cuda:0" if num_gpus and not use_cpu else "cpu"
    return "single", per_device_batch * grad_accum, f"one process on {device}: {per_device_batch} x {grad_accum}"


def _gpu_lines(num_gpus: int) -> list[str]:
    import torch

    gpus = map(torch.cuda.get_device_properties, range(num_gpus))
    return [f"  cuda:{i}: {props.name}, {props.total_memory / 2**30:.1f} GiB" for i, props in enumerate(gpus)]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _versions() -> list[str]:
    import torch

    return [
        f"hf_parallel: {_version('hf-parallel')}",
        f"Python: {platform.python_version()} ({platform.platform()})",
        # torch as it reports itself: a CUDA build's distribution may be `2.11.0` where torch says `2.11.0+cu130`.
        *(f"{name}: {torch.__version__ if name == 'torch' else _version(name)}" for name in REPORTED_PACKAGES),
        f"torch CUDA build: {torch.version.cuda or 'none (CPU build)'}",
    ]


def _devices(num_gpus: int) -> list[str]:
    import torch.distributed as dist

    lines = [f"GPUs visible: {num_gpus}", *_gpu_lines(num_gpus)]
    lines.append(f"CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', '(unset: all GPUs)')}")
    available = {name: dist.is_available() and getattr(dist, f"is_{name}_available")() for name in BACKENDS}
    found = ", ".join(f"{name}={'yes' if ok else 'no'}" for name, ok in available.items())
    lines.append(f"torch.distributed backends: {found}")
    return lines


def _accelerate_default_config() -> str:
    """Where `accelerate config` saved its default config, `none`, or why it is unknown (pinned in
    `hf_parallel.upstream.IMPORTED_NAMES`: a newer accelerate that moves the name must not break the report)."""
    try:
        from accelerate.commands.config import default_config_file
    except ImportError:
        return "unknown (this accelerate has no accelerate.commands.config.default_config_file)"
    return default_config_file if os.path.isfile(default_config_file) else "none"


def _launch() -> list[str]:
    launch = launcher_variables()
    return [
        "Launcher variables: " + (", ".join(f"{k}={v}" for k, v in launch.items()) or "none (no launcher)"),
        f"accelerate default config: {_accelerate_default_config()}",
    ]


def env_report(
    per_device_batch: int = 8, grad_accum: int = 1, num_processes: int | None = None, use_cpu: bool | None = None
) -> str:
    """
    The text `hf-parallel env` prints: what a bug report about multi-GPU training needs.

    Args:
        per_device_batch (`int`, *optional*, defaults to 8): `per_device_train_batch_size`.
        grad_accum (`int`, *optional*, defaults to 1): `gradient_accumulation_steps`.
        num_processes (`int`, *optional*): the processes a launch would start; defaults to what the launcher
            variables say (1 outside a launch).
        use_cpu (`bool`, *optional*): whether the script gets `use_cpu`; defaults to `ACCELERATE_USE_CPU`.

    Raises:
        `ValueError`: a count below 1, or a launcher variable that is not a number or a flag, naming it.

    ```python
    from hf_parallel.commands.env import env_report

    print(env_report(per_device_batch=16))
    ```
    """
    check_whole_number("--per-device-train-batch-size", per_device_batch, 1)
    check_whole_number("--gradient-accumulation-steps", grad_accum, 1)
    launched = launcher_world_size()
    world_size = launched if num_processes is None else check_whole_number("--num-processes", num_processes, 1)
    use_cpu = cpu_requested() if use_cpu is None else use_cpu

    num_gpus = torch_gpu_count()
    lines = [*_versions(), *_devices(num_gpus), *_launch()]
    mode, batch, why = trainer_mode(num_gpus, world_size, use_cpu, per_device_batch, grad_accum)
    assumed = "" if num_processes is None else f" (as if launched with {num_processes} processes)"
    lines.append(f"hf_parallel.Trainer mode{assumed}: {mode}: {why}")
    if mode != "error":
        lines.append(f"Effective global batch (rows per optimizer step): {batch}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    print(
        env_report(
            per_device_batch=args.per_device_train_batch_size,
            grad_accum=args.gradient_accumulation_steps,
            num_processes=args.num_processes,
            use_cpu=args.use_cpu,
        )
    )


def add_parser(subcommands, integer) -> argparse.ArgumentParser:
    """Add `env` to the parser's `subcommands` (`add_subparsers()`); `integer`: the type of whole-number options."""
    env = subcommands.add_parser(
        "env",
        help="print versions, GPUs, backends and the mode and global batch hf_parallel.Trainer would use",
        description="Print what a bug report about multi-GPU training needs: versions, GPUs and "
        "CUDA_VISIBLE_DEVICES, torch.distributed backends, launcher variables, the parallel mode "
        "hf_parallel.Trainer would pick and the effective global batch size. Run it under the same launcher as "
        "the training (e.g. `accelerate launch -m hf_parallel.commands.main env`) to see what each process sees.",
    )
    env.add_argument("--per-device-train-batch-size", type=integer, default=8, help="(default: 8, as transformers)")
    env.add_argument("--gradient-accumulation-steps", type=integer, default=1, help="(default: 1)")
    env.add_argument(
        "--num-processes",
        type=integer,
        default=None,
        help="processes a launch would start (default: what the launcher variables say, 1 outside a launch)",
    )
    env.add_argument(
        "--use-cpu", action="store_true", default=None, help="the script gets use_cpu (default: ACCELERATE_USE_CPU)"
    )
    env.set_defaults(run=_run)
    return env
