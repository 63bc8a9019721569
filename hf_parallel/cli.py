"""The `hf-parallel` command: write an accelerate config for this machine (`config`), report the set-up (`env`).

```bash
hf-parallel config -o ddp.yaml          # DDP over the GPUs found here (2 CPU processes on a machine without GPUs)
hf-parallel config --num-machines 2 --machine-rank 0 --main-process-ip 10.0.0.1 -o ddp.yaml
hf-parallel env --per-device-train-batch-size 16 --gradient-accumulation-steps 2
```
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

import yaml

from .guards import WORLD_SIZE_VARIABLES, launcher_world_size

# The accelerate configs shipped as package data (hf_parallel/configs/*.yaml).
SHIPPED_CONFIGS = ("cpu_ddp", "multi_gpu", "multi_node")
# Processes per machine when there is no GPU: 2 shows real DDP (and catches DDP bugs) without oversubscribing a
# small machine; raise it with --num-processes on a many-core CPU cluster.
CPU_PROCESSES_PER_MACHINE = 2
DEFAULT_PORT = 29500
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")


def shipped_config_text(name: str) -> str:
    """
    The text of an accelerate config shipped with hf_parallel, comments included.

    Args:
        name (`str`):
            One of `"cpu_ddp"` (2 CPU processes, gloo), `"multi_gpu"` (one machine, one process per GPU) and
            `"multi_node"` (a template for several machines).

    ```python
    from hf_parallel.cli import shipped_config_text

    print(shipped_config_text("multi_node"))
    ```
    """
    if name not in SHIPPED_CONFIGS:
        raise ValueError(f"No shipped accelerate config named {name!r}; the names are {', '.join(SHIPPED_CONFIGS)}.")
    return resources.files("hf_parallel").joinpath("configs", f"{name}.yaml").read_text(encoding="utf-8")


def shipped_config(name: str) -> dict:
    """The settings of a shipped accelerate config (see `shipped_config_text`) as a dict."""
    return yaml.safe_load(shipped_config_text(name))


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass
class LaunchPlan:
    """What `hf-parallel config` decided: the accelerate settings and the commands that launch them."""

    settings: dict
    base: str
    processes_per_machine: int
    uses_cpu: bool


def plan_config(
    num_processes: int | None = None,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
    cpu: bool = False,
    gpu_ids: str | None = None,
    mixed_precision: str = "no",
    num_gpus: int | None = None,
) -> LaunchPlan:
    """
    Build the accelerate settings fit for this machine: DDP over its GPUs, or over CPU processes when it has none.

    Args:
        num_processes (`int`, *optional*):
            Processes on each machine. Defaults to the GPUs visible here (the number of `gpu_ids` when given), or
            2 on a machine without GPUs. accelerate's `num_processes` counts all machines; it is written as
            `num_processes * num_machines`.
        num_machines (`int`, *optional*, defaults to 1):
            Machines taking part.
        machine_rank (`int`, *optional*, defaults to 0):
            This machine's index, `0 .. num_machines - 1`; machine 0 hosts the rendezvous.
        main_process_ip (`str`, *optional*):
            Machine 0's address, reachable from every machine. Required when `num_machines > 1`.
        main_process_port (`int`, *optional*):
            Machine 0's rendezvous port. Defaults to 29500 for several machines, and to 0 (a free port picked at
            launch) on one machine.
        cpu (`bool`, *optional*, defaults to `False`):
            Use CPU processes (gloo) even when GPUs are visible.
        gpu_ids (`str`, *optional*):
            Comma-separated GPU indices to use (sets `CUDA_VISIBLE_DEVICES` for every process), e.g. `"0,1"`.
        mixed_precision (`str`, *optional*, defaults to `"no"`):
            `"no"`, `"fp16"` or `"bf16"`.
        num_gpus (`int`, *optional*):
            The GPUs of this machine; detected when not given.

    ```python
    from hf_parallel.cli import plan_config

    plan = plan_config(num_processes=2, cpu=True)
    plan.settings["distributed_type"], plan.settings["num_processes"]  # ("MULTI_GPU", 2)
    ```
    """
    num_gpus = _visible_gpus() if num_gpus is None else num_gpus
    uses_cpu = cpu or num_gpus == 0
    if num_machines < 1:
        raise ValueError(f"--num-machines must be >= 1, got {num_machines}.")
    if not 0 <= machine_rank < num_machines:
        raise ValueError(
            f"--machine-rank must be in 0..{num_machines - 1} (one index per machine), got {machine_rank}."
        )
    if num_machines > 1 and not main_process_ip:
        raise ValueError(
            f"--main-process-ip is required with --num-machines {num_machines}: give machine 0's address, "
            "reachable from every machine (e.g. --main-process-ip 10.0.0.1; 127.0.0.1 only if all run on this host)."
        )
    if main_process_ip:
        try:
            ipaddress.ip_address(main_process_ip)
        except ValueError:
            if not main_process_ip.replace("-", "").replace(".", "").isalnum():
                raise ValueError(
                    f"--main-process-ip {main_process_ip!r} is neither an IP address nor a host name."
                ) from None
    if main_process_port is None:
        main_process_port = DEFAULT_PORT if num_machines > 1 else 0
    if not 0 <= main_process_port <= 65535:
        raise ValueError(f"--main-process-port must be a TCP port in 0..65535, got {main_process_port}.")
    if main_process_port == 0 and num_machines > 1:
        raise ValueError(
            "--main-process-port 0 (a port picked at launch) only works on one machine: the machines must agree on "
            f"machine 0's port in advance. Give a free port, e.g. --main-process-port {DEFAULT_PORT}."
        )
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ValueError(f"--mixed-precision must be no, fp16 or bf16, got {mixed_precision!r}.")
    if uses_cpu and mixed_precision == "fp16":
        raise ValueError("--mixed-precision fp16 needs GPUs; on CPU processes use no or bf16.")

    ids = None
    if gpu_ids is not None:
        if uses_cpu:
            raise ValueError(
                f"--gpu-ids {gpu_ids!r} was given but the config is for CPU processes "
                f"({'--cpu was given' if cpu else 'no GPU is visible here'}); drop --gpu-ids or --cpu."
            )
        try:
            ids = [int(part) for part in gpu_ids.split(",")]
        except ValueError:
            raise ValueError(f"--gpu-ids must be comma-separated GPU indices such as 0,1, got {gpu_ids!r}.") from None
        if len(set(ids)) != len(ids) or any(i < 0 or i >= num_gpus for i in ids):
            raise ValueError(
                f"--gpu-ids {gpu_ids!r} must name distinct GPUs among the {num_gpus} visible here (0..{num_gpus - 1})."
            )
    available = len(ids) if ids is not None else num_gpus
    if num_processes is None:
        num_processes = CPU_PROCESSES_PER_MACHINE if uses_cpu else available
    if num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1 (processes on each machine), got {num_processes}.")
    if not uses_cpu and num_processes > available:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"--gpu-ids {gpu_ids}" if ids is not None else f"CUDA_VISIBLE_DEVICES={visible}"
        raise ValueError(
            f"--num-processes {num_processes} is more than the {available} GPUs available here ({where}); DDP runs "
            f"one process per GPU. Use --num-processes {available} or fewer, or --cpu for CPU processes."
        )

    base = "cpu_ddp" if uses_cpu else ("multi_node" if num_machines > 1 else "multi_gpu")
    settings = shipped_config(base)
    total = num_processes * num_machines
    settings.update(
        # accelerate starts several processes only for the MULTI_GPU type; one process in all needs none.
        distributed_type="MULTI_GPU" if total > 1 else "NO",
        use_cpu=uses_cpu,
        num_machines=num_machines,
        machine_rank=machine_rank,
        num_processes=total,
        main_process_port=main_process_port,
        mixed_precision=mixed_precision,
    )
    if num_machines > 1:
        settings["main_process_ip"] = main_process_ip
    else:
        settings.pop("main_process_ip", None)
    if uses_cpu:
        settings.pop("gpu_ids", None)
    else:
        settings["gpu_ids"] = ",".join(map(str, ids)) if ids is not None else "all"
    return LaunchPlan(settings=settings, base=base, processes_per_machine=num_processes, uses_cpu=uses_cpu)


def render_config(plan: LaunchPlan) -> str:
    """The YAML text of a plan, with a header saying what it is and where it came from."""
    s = plan.settings
    what = "CPU processes (gloo)" if plan.uses_cpu else "GPUs, one process each (NCCL)"
    header = [
        "# Written by `hf-parallel config` (from hf_parallel/configs/" + plan.base + ".yaml).",
        f"# DDP over {plan.processes_per_machine} x {what} on each of {s['num_machines']} machine(s): "
        f"{s['num_processes']} processes in all (accelerate's num_processes counts every machine).",
    ]
    if plan.uses_cpu:
        header.append(
            "# accelerate does not pass use_cpu to the processes it starts: give the script --use_cpu "
            "(TrainingArguments(use_cpu=True)) or set ACCELERATE_USE_CPU=1 before `accelerate launch`."
        )
    if s["num_machines"] > 1:
        header.append(
            "# Copy this file to every machine; each overrides machine_rank on its command line (--machine_rank R)."
        )
    return "\n".join(header) + "\n" + yaml.safe_dump(s, sort_keys=False)


def launch_commands(plan: LaunchPlan, config_path: str, script: str) -> list[str]:
    """The `accelerate launch` command for each machine of the plan (one line per machine)."""
    script_args = " --use_cpu" if plan.uses_cpu else ""
    config = shlex.quote(config_path)
    n = plan.settings["num_machines"]
    if n == 1:
        return [f"accelerate launch --config_file {config} {script}{script_args}"]
    return [
        f"accelerate launch --config_file {config} --machine_rank {rank} {script}{script_args}" for rank in range(n)
    ]


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
    from hf_parallel.cli import trainer_mode

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

    lines = []
    for i in range(num_gpus):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"  cuda:{i}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    return lines


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


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

    ```python
    from hf_parallel.cli import env_report

    print(env_report(per_device_batch=16))
    ```
    """
    import torch
    import torch.distributed as dist
    from transformers.utils import strtobool

    if per_device_batch < 1:
        raise ValueError(f"--per-device-train-batch-size must be >= 1, got {per_device_batch}.")
    if grad_accum < 1:
        raise ValueError(f"--gradient-accumulation-steps must be >= 1, got {grad_accum}.")
    launched = launcher_world_size()
    world_size = launched if num_processes is None else num_processes
    if world_size < 1:
        raise ValueError(f"--num-processes must be >= 1, got {world_size}.")
    if use_cpu is None:
        use_cpu = bool(strtobool(os.environ.get("ACCELERATE_USE_CPU", "False")))

    lines = [
        f"hf_parallel: {_version('hf-parallel')}",
        f"Python: {platform.python_version()} ({platform.platform()})",
    ]
    for package in ("torch", "transformers", "accelerate", "datasets", "safetensors"):
        lines.append(f"{package}: {_version(package)}")
    lines.append(f"torch CUDA build: {torch.version.cuda or 'none (CPU build)'}")
    num_gpus = _visible_gpus()
    lines.append(f"GPUs visible: {num_gpus}")
    lines.extend(_gpu_lines(num_gpus))
    lines.append(f"CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', '(unset: all GPUs)')}")
    backends = {
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    found = ", ".join(f"{name}={'yes' if ok else 'no'}" for name, ok in backends.items())
    lines.append(f"torch.distributed backends: {found}")
    launch = {name: os.environ[name] for name in WORLD_SIZE_VARIABLES + LAUNCH_VARIABLES if name in os.environ}
    lines.append("Launcher variables: " + (", ".join(f"{k}={v}" for k, v in launch.items()) or "none (no launcher)"))
    from accelerate.commands.config import default_config_file

    lines.append(
        f"accelerate default config: {default_config_file if os.path.isfile(default_config_file) else 'none'}"
    )
    mode, batch, why = trainer_mode(num_gpus, world_size, use_cpu, per_device_batch, grad_accum)
    assumed = "" if num_processes is None else f" (as if launched with {num_processes} processes)"
    lines.append(f"hf_parallel.Trainer mode{assumed}: {mode}: {why}")
    if mode != "error":
        lines.append(f"Effective global batch (rows per optimizer step): {batch}")
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-parallel",
        description="Launch helpers for hf_parallel: write an accelerate config for this machine, report the set-up.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{config,env}")
    config = commands.add_parser(
        "config",
        help="write an accelerate config fit for this machine and print the `accelerate launch` command",
        description="Write an accelerate config for DDP over the GPUs of this machine (over CPU processes when it "
        "has none), for one or several machines, and print the `accelerate launch` command to use.",
    )
    config.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="processes on EACH machine (default: the GPUs visible here; 2 without GPUs). The file's num_processes "
        "is this times --num-machines, as accelerate counts all machines.",
    )
    config.add_argument("--num-machines", type=int, default=1, help="machines taking part (default: 1)")
    config.add_argument(
        "--machine-rank", type=int, default=0, help="this machine's index, 0 .. num-machines - 1 (default: 0)"
    )
    config.add_argument(
        "--main-process-ip", default=None, help="machine 0's address, reachable from every machine (several machines)"
    )
    config.add_argument(
        "--main-process-port",
        type=int,
        default=None,
        help=f"machine 0's rendezvous port (default: {DEFAULT_PORT} for several machines; 0 = a free port picked at "
        "launch, on one machine)",
    )
    config.add_argument("--cpu", action="store_true", help="use CPU processes (gloo) even when GPUs are visible")
    config.add_argument("--gpu-ids", default=None, help="comma-separated GPUs to use, e.g. 0,1 (default: all)")
    config.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"], help="(default: no)")
    config.add_argument(
        "-o",
        "--output",
        default="accelerate_config.yaml",
        help="file to write (default: accelerate_config.yaml); '-' prints the YAML on stdout",
    )
    config.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
    config.add_argument(
        "--script", default="train.py", help="the training script to show in the printed command (default: train.py)"
    )
    env = commands.add_parser(
        "env",
        help="print versions, GPUs, backends and the mode and global batch hf_parallel.Trainer would use",
        description="Print what a bug report about multi-GPU training needs: versions, GPUs and "
        "CUDA_VISIBLE_DEVICES, torch.distributed backends, launcher variables, the parallel mode "
        "hf_parallel.Trainer would pick and the effective global batch size. Run it under the same launcher as "
        "the training (e.g. `accelerate launch -m hf_parallel.cli env`) to see what each process sees.",
    )
    env.add_argument("--per-device-train-batch-size", type=int, default=8, help="(default: 8, as transformers)")
    env.add_argument("--gradient-accumulation-steps", type=int, default=1, help="(default: 1)")
    env.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="processes a launch would start (default: what the launcher variables say, 1 outside a launch)",
    )
    env.add_argument(
        "--use-cpu", action="store_true", default=None, help="the script gets use_cpu (default: ACCELERATE_USE_CPU)"
    )
    return parser


def _run_config(args: argparse.Namespace) -> None:
    plan = plan_config(
        num_processes=args.num_processes,
        num_machines=args.num_machines,
        machine_rank=args.machine_rank,
        main_process_ip=args.main_process_ip,
        main_process_port=args.main_process_port,
        cpu=args.cpu,
        gpu_ids=args.gpu_ids,
        mixed_precision=args.mixed_precision,
    )
    text = render_config(plan)
    if args.output == "-":
        sys.stdout.write(text)
        path, report = "accelerate_config.yaml", sys.stderr
    else:
        target = Path(args.output)
        if target.exists() and not args.overwrite:
            raise ValueError(f"{target} already exists; pass --overwrite to replace it, or -o another file.")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        path, report = str(target), sys.stdout
        print(f"Wrote {target}", file=report)
    commands = launch_commands(plan, path, args.script)
    if len(commands) == 1:
        print(f"Launch with:\n  {commands[0]}", file=report)
    else:
        print("Launch on every machine (machine 0 first is not required; they wait for each other):", file=report)
        for rank, command in enumerate(commands):
            print(f"  machine {rank}: {command}", file=report)
    if plan.uses_cpu:
        print(
            "  (--use_cpu is a TrainingArguments flag; a script without it needs ACCELERATE_USE_CPU=1 set instead)",
            file=report,
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hf-parallel` console script; returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "config":
            _run_config(args)
        else:
            print(
                env_report(
                    per_device_batch=args.per_device_train_batch_size,
                    grad_accum=args.gradient_accumulation_steps,
                    num_processes=args.num_processes,
                    use_cpu=args.use_cpu,
                )
            )
    except ValueError as error:
        parser.exit(2, f"hf-parallel {args.command}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
