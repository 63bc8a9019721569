"""What the resume tests share (tests/saving/test_crash_safe.py, test_sharded_resume.py,
tests/engines/test_deepspeed_resume.py, and benchmarks/resume.py): final parameters compared, a run's error kept as
its result, and one rank's results written for the test to read."""

from __future__ import annotations

import torch
import torch.distributed as dist


def largest_difference(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two sets of parameters by name (the same names)."""
    assert params.keys() == reference.keys(), sorted(set(params) ^ set(reference))
    return max((params[name] - reference[name]).abs().max().item() for name in reference)


def error_of(function, *args, **kwargs) -> str:
    """What `function(*args, **kwargs)` raised, as "Type: message" ("no error" where it returned)."""
    try:
        function(*args, **kwargs)
    except Exception as error:  # the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def save_on_main(results: dict, path: str) -> None:
    """`results` written to `path` by rank 0 (or the only process)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, path)
