"""Checks of user-given option values, shared by every module, so that each bad value gets the same clear error."""

from __future__ import annotations

from typing import Any

__all__ = ["check_whole_number"]


def check_whole_number(name: str, value: Any, minimum: int = 0) -> int:
    """
    Return `value` if it is a whole number (an `int`, not a `bool`) of at least `minimum`; raise otherwise.

    Args:
        name (`str`):
            The option's name, as the user wrote it; the error names it.
        value (`Any`):
            The value to check.
        minimum (`int`, *optional*, defaults to 0):
            The smallest value allowed.

    Raises:
        `ValueError`: naming the option, the bound and the value, e.g.
        `num_processes must be a whole number >= 1, got 1.5.`

    ```python
    from hf_parallel.launch.validation import check_whole_number

    check_whole_number("batch_size", 8, minimum=1)  # 8
    ```
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}.")
    return value
