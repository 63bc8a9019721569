"""
What a launcher tells a process through its environment, read in one place. Imports neither torch nor transformers,
so that the `hf-parallel` command can use it without paying for them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "LAUNCH_VARIABLES",
    "WORLD_SIZE_VARIABLES",
    "cpu_requested",
    "launcher_variables",
    "launcher_world_size",
    "world_size_variable",
]

# The variables launchers set to the number of processes: torchrun / accelerate (WORLD_SIZE), Intel MPI and MPICH
# (PMI_SIZE), Open MPI (OMPI_COMM_WORLD_SIZE), MVAPICH (MV2_COMM_WORLD_SIZE). accelerate reads the same list.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
# The other variables a launcher sets for each process (reported by `hf-parallel env`).
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")
# The spellings accelerate's parse_flag_from_env (through str_to_bool) accepts for true and false.
_TRUE = frozenset({"y", "yes", "t", "true", "on", "1"})
_FALSE = frozenset({"n", "no", "f", "false", "off", "0", ""})


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def world_size_variable(environ: Mapping[str, str] | None = None) -> str | None:
    """The first of `WORLD_SIZE_VARIABLES` that is set (not empty) in `environ`, or None when no launcher set one."""
    environ = _environ(environ)
    return next((name for name in WORLD_SIZE_VARIABLES if environ.get(name, "").strip()), None)


def launcher_world_size(environ: Mapping[str, str] | None = None) -> int:
    """
    The number of processes a launcher says it started, from the environment; 1 when no launcher set one.

    Args:
        environ (`Mapping[str, str]`, *optional*):
            The environment to read; defaults to `os.environ`.

    Returns:
        `int`: the first of `WORLD_SIZE`, `PMI_SIZE`, `OMPI_COMM_WORLD_SIZE`, `MV2_COMM_WORLD_SIZE` that is set.

    Raises:
        `ValueError`: the variable is not a whole number >= 1.

    ```python
    from hf_parallel.launch.environment import launcher_world_size

    launcher_world_size({"WORLD_SIZE": "4"})  # 4
    ```
    """
    environ = _environ(environ)
    name = world_size_variable(environ)
    if name is None:
        return 1
    value = environ[name].strip()
    try:
        size = int(value)
    except ValueError:
        raise ValueError(
            f"The environment variable {name}={value!r} is not a whole number; a launcher sets it to the number "
            f"of processes. Unset it or set it to that number."
        ) from None
    if size < 1:
        raise ValueError(f"The environment variable {name}={size} must be >= 1 (the number of processes).")
    return size


def launcher_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher variables (`WORLD_SIZE_VARIABLES` and `LAUNCH_VARIABLES`) that are set, in that order."""
    environ = _environ(environ)
    return {name: environ[name] for name in WORLD_SIZE_VARIABLES + LAUNCH_VARIABLES if name in environ}


def cpu_requested(environ: Mapping[str, str] | None = None) -> bool:
    """
    Whether `ACCELERATE_USE_CPU` asks for a CPU run, read as accelerate reads it (`1`, `true`, `yes`, `on`, ...).

    Raises:
        `ValueError`: the variable holds something that is neither true nor false, naming the value.
    """
    value = _environ(environ).get("ACCELERATE_USE_CPU", "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"The environment variable ACCELERATE_USE_CPU={value!r} is neither true nor false; set it to 1 or 0."
    )
