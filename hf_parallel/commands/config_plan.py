"""
Plan the accelerate settings of a DDP launch: the configs shipped as package data, a check of every option (naming
the value and the fix), and the settings fit for this machine's GPUs (or CPU processes when it has none). No I/O
beyond reading the shipped configs, and neither torch nor transformers: the GPUs are counted as
`hf_parallel.commands.gpus` explains.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from importlib import resources

import yaml

from ..launch.validation import check_whole_number
from .gpus import count_gpus

__all__ = [
    "CPU_PROCESSES_PER_MACHINE",
    "DEEPSPEED_CONFIGS",
    "DEFAULT_PORT",
    "SHIPPED_CONFIGS",
    "ZERO_STAGES",
    "LaunchPlan",
    "plan_config",
    "shipped_config",
    "shipped_config_text",
]

SHIPPED_CONFIGS = ("cpu_ddp", "multi_gpu", "multi_node")
# DeepSpeed ZeRO over the GPUs of one machine (several with --num-machines): `hf-parallel config --deepspeed 2|3`.
DEEPSPEED_CONFIGS = ("deepspeed_zero2", "deepspeed_zero3")
ZERO_STAGES = (2, 3)
# Processes per machine when there is no GPU: 2 shows real DDP (and catches DDP bugs) without oversubscribing a
# small machine; raise it with --num-processes on a many-core CPU cluster.
CPU_PROCESSES_PER_MACHINE = 2
DEFAULT_PORT = 29500
MIXED_PRECISIONS = ("no", "fp16", "bf16")
# One label of a host name: letters, digits and inner hyphens.
_HOST_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?$")


def shipped_config_text(name: str) -> str:
    """
    The text of an accelerate config shipped with hf_parallel, comments included.

    Args:
        name (`str`):
            One of `"cpu_ddp"` (2 CPU processes, gloo), `"multi_gpu"` (one machine, one process per GPU),
            `"multi_node"` (a template for several machines), `"deepspeed_zero2"` and `"deepspeed_zero3"` (DeepSpeed
            ZeRO-2 / ZeRO-3 over the GPUs of one machine).

    ```python
    from hf_parallel.commands.config_plan import shipped_config_text

    print(shipped_config_text("multi_node"))
    ```
    """
    if name not in SHIPPED_CONFIGS + DEEPSPEED_CONFIGS:
        names = ", ".join(SHIPPED_CONFIGS + DEEPSPEED_CONFIGS)
        raise ValueError(f"No shipped accelerate config named {name!r}; the names are {names}.")
    return resources.files("hf_parallel").joinpath("configs", f"{name}.yaml").read_text(encoding="utf-8")


def shipped_config(name: str) -> dict:
    """The settings of a shipped accelerate config (see `shipped_config_text`) as a dict."""
    return yaml.safe_load(shipped_config_text(name))


@dataclass
class LaunchPlan:
    """What `hf-parallel config` decided: the accelerate settings and the commands that launch them."""

    settings: dict
    base: str
    processes_per_machine: int
    uses_cpu: bool
    zero_stage: int | None = None


def _check_host(main_process_ip: str) -> None:
    """Raise unless `main_process_ip` is an IP address or a well-formed host name."""
    try:
        ipaddress.ip_address(main_process_ip)
        return
    except ValueError:
        pass
    labels = main_process_ip.split(".")
    if all(label.isdigit() for label in labels):
        raise ValueError(
            f"--main-process-ip {main_process_ip!r} is not a valid IP address; give machine 0's address, "
            "e.g. 10.0.0.1."
        )
    if len(main_process_ip) > 253 or not all(_HOST_LABEL.match(label) and len(label) <= 63 for label in labels):
        raise ValueError(
            f"--main-process-ip {main_process_ip!r} is neither an IP address nor a host name; give machine 0's "
            "address (e.g. 10.0.0.1) or its host name (letters, digits, '-' and '.')."
        )


def _check_machines(num_machines: int, machine_rank: int, main_process_ip: str | None) -> None:
    check_whole_number("--num-machines", num_machines, 1)
    check_whole_number("--machine-rank", machine_rank, 0)
    if machine_rank >= num_machines:
        raise ValueError(
            f"--machine-rank must be in 0..{num_machines - 1} (one index per machine), got {machine_rank}."
        )
    if num_machines > 1 and not main_process_ip:
        raise ValueError(
            f"--main-process-ip is required with --num-machines {num_machines}: give machine 0's address, "
            "reachable from every machine (e.g. --main-process-ip 10.0.0.1; 127.0.0.1 only if all run on this host)."
        )
    if main_process_ip:
        _check_host(main_process_ip)


def _check_port(main_process_port: int | None, num_machines: int) -> int:
    """The rendezvous port: the one given, else 29500 for several machines and 0 (picked at launch) for one."""
    if main_process_port is None:
        return DEFAULT_PORT if num_machines > 1 else 0
    check_whole_number("--main-process-port", main_process_port, 0)
    if main_process_port > 65535:
        raise ValueError(f"--main-process-port must be a TCP port in 0..65535, got {main_process_port}.")
    if main_process_port == 0 and num_machines > 1:
        raise ValueError(
            "--main-process-port 0 (a port picked at launch) only works on one machine: the machines must agree on "
            f"machine 0's port in advance. Give a free port, e.g. --main-process-port {DEFAULT_PORT}."
        )
    return main_process_port


def _check_precision(mixed_precision: str, uses_cpu: bool) -> None:
    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"--mixed-precision must be no, fp16 or bf16, got {mixed_precision!r}.")
    if uses_cpu and mixed_precision == "fp16":
        raise ValueError("--mixed-precision fp16 needs GPUs; on CPU processes use no or bf16.")


def _parse_gpu_ids(gpu_ids: str | None, cpu: bool, uses_cpu: bool, num_gpus: int) -> list[int] | None:
    """The GPU indices of `--gpu-ids`, checked against the GPUs here; None when not given."""
    if gpu_ids is None:
        return None
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
    return ids


def _processes_per_machine(num_processes: int | None, uses_cpu: bool, available: int, gpu_ids: str | None) -> int:
    """`--num-processes`, defaulting to one per available GPU (2 on CPU), and never more than the GPUs available."""
    if num_processes is None:
        num_processes = CPU_PROCESSES_PER_MACHINE if uses_cpu else available
    check_whole_number("--num-processes", num_processes, 1)
    if not uses_cpu and num_processes > available:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "CUDA_VISIBLE_DEVICES unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible}"
        if gpu_ids is not None:
            where = f"--gpu-ids {gpu_ids}"
        raise ValueError(
            f"--num-processes {num_processes} is more than the {available} GPUs available here ({where}); DDP runs "
            f"one process per GPU. Use --num-processes {available} or fewer, or --cpu for CPU processes."
        )
    return num_processes


def _check_deepspeed(deepspeed: int | None, uses_cpu: bool, cpu: bool) -> None:
    if deepspeed is None:
        return
    if deepspeed not in ZERO_STAGES:
        raise ValueError(f"--deepspeed takes the ZeRO stage, 2 or 3, got {deepspeed!r}.")
    if uses_cpu:
        raise ValueError(
            f"--deepspeed {deepspeed} needs GPUs ({'--cpu was given' if cpu else 'none is visible here'}): "
            "accelerate launches DeepSpeed with one process per GPU. Write the config on a GPU machine, or copy "
            f"hf_parallel/configs/deepspeed_zero{deepspeed}.yaml and set its num_processes."
        )


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
    deepspeed: int | None = None,
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
            The GPUs of this machine; counted by `hf_parallel.commands.gpus.count_gpus` when not given.
        deepspeed (`int`, *optional*):
            A ZeRO stage, 2 or 3: DeepSpeed over the GPUs (from the shipped `deepspeed_zero2` / `deepspeed_zero3`
            config) instead of DDP. Needs GPUs.

    Raises:
        `ValueError`: a value out of range or settings that contradict each other, naming the option and the fix.

    ```python
    from hf_parallel.commands.config_plan import plan_config

    plan = plan_config(num_processes=2, cpu=True)
    plan.settings["distributed_type"], plan.settings["num_processes"]  # ("MULTI_GPU", 2)
    ```
    """
    if num_gpus is None:
        # CPU processes need no GPU count (it may have to ask the driver, or torch).
        num_gpus = 0 if cpu else count_gpus()
    check_whole_number("num_gpus", num_gpus, 0)
    uses_cpu = cpu or num_gpus == 0
    _check_machines(num_machines, machine_rank, main_process_ip)
    port = _check_port(main_process_port, num_machines)
    _check_precision(mixed_precision, uses_cpu)
    _check_deepspeed(deepspeed, uses_cpu, cpu)
    ids = _parse_gpu_ids(gpu_ids, cpu, uses_cpu, num_gpus)
    available = len(ids) if ids is not None else num_gpus
    per_machine = _processes_per_machine(num_processes, uses_cpu, available, gpu_ids)

    base = "cpu_ddp" if uses_cpu else ("multi_node" if num_machines > 1 else "multi_gpu")
    base = f"deepspeed_zero{deepspeed}" if deepspeed is not None else base
    # The shipped config with the planned values written over it; the keys a base lacks come last.
    settings = shipped_config(base)
    total = per_machine * num_machines
    if deepspeed is None:
        # accelerate starts several processes only for the MULTI_GPU type; one process in all needs none.
        settings["distributed_type"] = "MULTI_GPU" if total > 1 else "NO"
    elif num_machines > 1:
        # DeepSpeed runs one process too; several machines start through torchrun, as DDP's do, not pdsh.
        settings["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    settings.update(use_cpu=uses_cpu, num_processes=total, num_machines=num_machines, machine_rank=machine_rank)
    settings.update(main_process_port=port, mixed_precision=mixed_precision)
    if num_machines > 1:
        settings["main_process_ip"] = main_process_ip
    if not uses_cpu:
        # The CPU base (the only one with uses_cpu: DeepSpeed refuses it) has no gpu_ids.
        settings["gpu_ids"] = ",".join(map(str, ids)) if ids is not None else "all"
    return LaunchPlan(
        settings=settings, base=base, processes_per_machine=per_machine, uses_cpu=uses_cpu, zero_stage=deepspeed
    )
