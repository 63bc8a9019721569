"""
The epoch-remainder runs shared by tests/test_exact_loss.py and tests/exact/test_reach.py: one epoch, sequentially
sampled, so that one device sees the same rows, then the leftover rows, as the DDP ranks together do.
"""

from __future__ import annotations

from tests.helpers.harness import RunResult, Topology, run_case

# Sequential sampling, so that one device sees rows 0-7, then the leftover rows, as the ranks together do.
EPOCH = {"max_steps": -1, "num_train_epochs": 1, "train_sampling_strategy": "sequential", "evaluate_first": False}
# Iterable training sets have no length: the run needs max_steps, and rank 0 dispatches the batches. (Without GA:
# for an iterable set, stock carries a step that the epoch's end cuts short into the next epoch.)
ITERABLE = {"max_steps": 2, "iterable": True}


def epoch_topology(per_device: int, accumulation: int) -> Topology:
    return Topology(f"DDP 2 x {per_device} x GA {accumulation}", per_device, accumulation, processes=2)


def update_error(result: dict, reference: dict, initial: dict) -> float:
    """Largest parameter difference from the reference, relative to the largest change the reference made."""
    update = max((reference[n] - initial[n]).abs().max().item() for n in initial)
    return max((result[n] - reference[n]).abs().max().item() for n in initial) / update


def one_device_epoch(case: str, rows: int, **overrides) -> RunResult:
    """One process, 8 rows a step, over the same rows as the ranks: the reference of an epoch remainder."""
    return run_case(case, Topology("one device x 8", per_device=8), train_rows=rows, **{**EPOCH, **overrides})
