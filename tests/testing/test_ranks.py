"""spawn_cpu_ranks: real gloo ranks in fresh processes; a failing rank raises, a stuck one times out."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from hf_parallel.testing import spawn_cpu_ranks


def _rank_one_fails():
    assert dist.get_world_size() == 2
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 broke on purpose")
    dist.barrier()


def _rank_zero_never_arrives():
    if dist.get_rank() == 0:
        time.sleep(120)
    dist.barrier()


def _sum_ranks(path):
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        torch.save(total, path)
    dist.barrier()
    dist.destroy_process_group()


def test_ranks_form_one_group(tmp_path):
    spawn_cpu_ranks(_sum_ranks, (str(tmp_path / "sum.pt"),), num_processes=3)
    assert torch.load(tmp_path / "sum.pt").item() == 1 + 2 + 3


def test_a_failing_rank_raises_with_its_error():
    with pytest.raises(ProcessRaisedException, match="rank 1 broke on purpose"):
        spawn_cpu_ranks(_rank_one_fails, num_processes=2)


def test_a_stuck_rank_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 still running after 3 s"):
        spawn_cpu_ranks(_rank_zero_never_arrives, num_processes=2, timeout=3)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_process_counts_are_refused(bad):
    with pytest.raises(ValueError, match="num_processes must be a whole number >= 1"):
        spawn_cpu_ranks(_sum_ranks, ("unused",), num_processes=bad)
