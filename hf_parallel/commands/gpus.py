"""
How many GPUs a launch on this machine would see, counted without importing torch when the driver can tell.

`hf-parallel config` plans one process per GPU, and must start in a fraction of a second, so it does not import torch
(a few seconds) to count them. The rule, in order:

1. `CUDA_VISIBLE_DEVICES`, read as CUDA reads it: a comma-separated list of indices or `GPU-`/`MIG-` UUID prefixes,
   cut at the first entry that is not one (`-1`, a word, an index the driver does not have); an empty list or a
   repeated entry hides every GPU. Unset, every GPU the driver has is visible.
2. The GPUs of the NVIDIA driver: the `GPU n: ... (UUID: GPU-...)` lines of `nvidia-smi -L`, or, without
   `nvidia-smi`, the entries of `/proc/driver/nvidia/gpus`.
3. torch's own count (`torch.cuda.device_count()`), only where the driver cannot answer: MIG instances, UUIDs without
   `nvidia-smi`, `nvidia-smi` failing, a ROCm machine (`/dev/kfd`) or a Jetson (`/etc/nv_tegra_release`), where torch's
   CUDA API drives other GPUs than `nvidia-smi` lists.
4. Otherwise there is no GPU driver here, so no GPU any torch build could use: 0, and the config is for CPU processes.

It counts what the driver exposes, whether or not the installed torch was built with CUDA: a CPU-only torch on a GPU
machine cannot use them, which `hf-parallel env` (torch's own view) shows.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

__all__ = ["count_gpus", "parse_visible_devices", "torch_gpu_count", "visible_gpu_count"]

# One directory per GPU the NVIDIA kernel driver manages (named by PCI address).
PROC_GPUS = Path("/proc/driver/nvidia/gpus")
# Signs of GPUs that torch's CUDA API drives but nvidia-smi does not list: ROCm's kernel driver, NVIDIA Jetson.
OTHER_GPU_DRIVERS = (Path("/dev/kfd"), Path("/etc/nv_tegra_release"))
# `nvidia-smi -L` prints one such line per GPU (MIG instances follow, indented, under their GPU).
_SMI_GPU_LINE = re.compile(r"^GPU \d+:.*?(?:\(UUID: (GPU-[0-9A-Za-z-]+)\))?\s*$")
_LEADING_INTEGER = re.compile(r"^[+-]?\d+")


def torch_gpu_count() -> int:
    """The GPUs torch can use in this process (imports torch: a few seconds)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_visible_devices(value: str | None) -> list[int] | list[str] | None:
    """
    The devices a `CUDA_VISIBLE_DEVICES` value selects, read as CUDA reads it.

    Args:
        value (`str`, *optional*):
            The variable's value; `None` when it is unset.

    Returns:
        `list[int] | list[str] | None`: `None` when unset (every GPU); the indices, or the `GPU-`/`MIG-` UUID prefixes,
        up to the first entry that is neither; `[]` when nothing is selected or an entry is repeated.

    ```python
    from hf_parallel.commands.gpus import parse_visible_devices

    parse_visible_devices("0,2,-1,3")  # [0, 2]
    ```
    """
    if value is None:
        return None
    entries = [entry.strip() for entry in value.split(",")]
    prefix = next((p for p in ("GPU-", "MIG-") if entries[0].startswith(p)), None)
    selected: list = []
    for entry in entries:
        if prefix is not None:
            device = entry if entry.startswith(prefix) else None
        else:
            # CUDA reads each entry with strtoul: "1gpu" is 1, a negative number or a word ends the list.
            match = _LEADING_INTEGER.match(entry)
            device = int(match.group()) if match and int(match.group()) >= 0 else None
        if device is None:
            break
        if device in selected:
            return []
        selected.append(device)
    return selected


def visible_gpu_count(visible: list[int] | list[str] | None, count: int, uuids: list[str] | None) -> int | None:
    """
    How many of the driver's GPUs a parsed `CUDA_VISIBLE_DEVICES` leaves visible; `None` when only torch can tell.

    Args:
        visible (`list[int] | list[str] | None`):
            What `parse_visible_devices` returned.
        count (`int`):
            The GPUs the driver has.
        uuids (`list[str]`, *optional*):
            Their UUIDs in index order, when known.
    """
    if visible is None:
        return count
    if not visible or isinstance(visible[0], int):
        # An index the driver does not have ends the list, as an invalid entry does.
        return next((i for i, index in enumerate(visible) if index >= count), len(visible))
    if visible[0].startswith("MIG-") or uuids is None:
        return None
    resolved: list[int] = []
    for prefix in visible:
        matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(prefix)]
        if len(matches) != 1:
            # No GPU, or several (an ambiguous prefix): CUDA stops there.
            break
        if matches[0] in resolved:
            return 0
        resolved.append(matches[0])
    return len(resolved)


def _driver_gpus() -> tuple[int, list[str] | None] | None:
    """
    The NVIDIA driver's GPUs and their UUIDs (when known): those `nvidia-smi -L` lists, else the entries of
    `PROC_GPUS`; None when there is no NVIDIA driver, `(-1, None)` when nvidia-smi fails.
    """
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return (sum(1 for _ in PROC_GPUS.iterdir()), None) if PROC_GPUS.is_dir() else None
    try:
        result = subprocess.run([executable, "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):  # not runnable, a timeout, or a non-zero exit status
        return -1, None
    matches = [m for m in map(_SMI_GPU_LINE.match, result.stdout.splitlines()) if m]
    uuids = [m.group(1) for m in matches]
    return len(matches), (uuids if all(uuids) else None)


def count_gpus(environ: Mapping[str, str] | None = None) -> int:
    """
    The GPUs a process launched here would see, by the rule of this module's docstring (torch only as a last resort).

    Args:
        environ (`Mapping[str, str]`, *optional*):
            The environment whose `CUDA_VISIBLE_DEVICES` applies; defaults to `os.environ`.

    ```python
    from hf_parallel.commands.gpus import count_gpus

    count_gpus({"CUDA_VISIBLE_DEVICES": ""})  # 0: the variable hides every GPU
    ```
    """
    environ = os.environ if environ is None else environ
    visible = parse_visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))
    if visible == []:
        return 0
    driver = _driver_gpus()
    if driver is None:
        return torch_gpu_count() if any(path.exists() for path in OTHER_GPU_DRIVERS) else 0
    count, uuids = driver
    seen = visible_gpu_count(visible, count, uuids) if count >= 0 else None
    return torch_gpu_count() if seen is None else seen
