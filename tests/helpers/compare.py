"""Comparing a run's logged losses with a reference run's, where a relative error means something."""

from __future__ import annotations

from collections.abc import Sequence


def assert_losses_close(ours: Sequence[float], reference: Sequence[float], what: str, rel: float = 1e-5) -> None:
    """
    Each step's loss of `ours` equals `reference`'s within `rel` of the run's loss scale: the larger of that step's
    reference loss and the first step's.

    A loss trained down towards zero is the difference of two much larger numbers (a cross-entropy of 0.0024 is
    a log-sum-exp of about 6 less the target's logit), so float rounding, which the thread count changes, leaves
    about 1e-7 in it: 5e-5 of the loss itself, yet 1e-7 of the run's first loss. A wrong normalisation is a factor
    on the step's loss (x2, x1/3, a mean of means) and stays far outside this bound unless the loss is below `rel`
    of the first step's.
    """
    assert len(ours) == len(reference), f"{what}: {len(ours)} logged losses, the reference has {len(reference)}"
    assert reference, f"{what}: no logged loss to compare"
    first = abs(reference[0])
    for step, (mine, expected) in enumerate(zip(ours, reference, strict=True)):
        bound = rel * max(abs(expected), first)
        assert abs(mine - expected) <= bound, (
            f"{what}: logged loss of step {step}: {mine!r} against {expected!r}, off by {abs(mine - expected):.3g} "
            f"(allowed {bound:.3g}: {rel:g} of the larger of this step's loss and the first step's, {first:.6g})"
        )
