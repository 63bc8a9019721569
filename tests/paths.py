"""Where the checkout is, and the environment a child process needs to import `tests` and `examples` from it."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def repo_env(**extra: str) -> dict[str, str]:
    """
    This process's environment with the checkout first on `PYTHONPATH`, and `extra` set.

    A script run by its path (by `python`, `torchrun` or `accelerate launch`) has its own folder, not the checkout, on
    `sys.path`: without this it cannot import `tests` or `examples`.
    """
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env
