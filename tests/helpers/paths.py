"""Where the checkout is, and the environment a child process needs to import `tests` and `examples` from it."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a child process's environment: it sees no GPU (CUDA reads the variable when it initialises), so a test of a CPU
# run (a launch with gloo, a CPU-only config) has the same outcome on a machine with GPUs. In-process: `no_gpus`.
NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


def repo_env(**extra: str) -> dict[str, str]:
    """
    This process's environment with the checkout first on `PYTHONPATH`, and `extra` set.

    A script run by its path (by `python`, `torchrun` or `accelerate launch`) has its own folder, not the checkout, on
    `sys.path`: without this it cannot import `tests` or `examples`.
    """
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env
