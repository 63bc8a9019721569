"""
`hf_parallel.testing.cpu_as_accelerator`: what it patches within its block and restores after, and where it refuses.
Its use, DeepSpeed through the Trainer on CPU ranks, is tests/engines/test_deepspeed.py.
"""

from __future__ import annotations

import os

import accelerate.state
import pytest
import torch
import transformers.training_args

from hf_parallel.testing import cpu_as_accelerator, spawn_cpu_ranks


def _inside_and_after() -> None:
    originals = (
        accelerate.state.get_torch_accelerator_backend,
        accelerate.state.get_distributed_backend,
        transformers.training_args.is_torch_bf16_gpu_available,
    )
    assert os.environ["ACCELERATE_USE_CPU"] == "yes"  # spawn_cpu_ranks sets it
    with cpu_as_accelerator():
        assert accelerate.state.get_torch_accelerator_backend() == ("cpu", torch.cpu)
        assert accelerate.state.get_distributed_backend("cpu") == "gloo"
        assert accelerate.state.get_distributed_backend("cuda") == "nccl"
        assert transformers.training_args.is_torch_bf16_gpu_available()
        assert "ACCELERATE_USE_CPU" not in os.environ
        state = accelerate.state.PartialState()
        assert (state.backend, state.distributed_type.value, state.device.type) == ("gloo", "MULTI_CPU", "cpu")
    assert os.environ["ACCELERATE_USE_CPU"] == "yes"
    after = (
        accelerate.state.get_torch_accelerator_backend,
        accelerate.state.get_distributed_backend,
        transformers.training_args.is_torch_bf16_gpu_available,
    )
    assert after == originals


_HAS_BACKEND_HOOK = hasattr(accelerate.state, "get_torch_accelerator_backend")


@pytest.mark.skipif(not _HAS_BACKEND_HOOK, reason="accelerate before 1.16 has no get_torch_accelerator_backend")
def test_patches_within_the_block_and_restores_after():
    spawn_cpu_ranks(_inside_and_after, num_processes=1, timeout=120)


def _refuses_on_old_accelerate() -> None:
    with pytest.raises(RuntimeError, match="needs accelerate 1.16 or later"), cpu_as_accelerator():
        pass


@pytest.mark.skipif(_HAS_BACKEND_HOOK, reason="accelerate 1.16 and later have the hook the switch patches")
def test_names_the_accelerate_it_needs():
    spawn_cpu_ranks(_refuses_on_old_accelerate, num_processes=1, timeout=120)


def test_refuses_once_accelerate_chose_a_backend():
    accelerate.state.PartialState(cpu=True)  # as any earlier test of this process may have
    with pytest.raises(RuntimeError, match="PartialState already exists"), cpu_as_accelerator():
        pass


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_refuses_on_a_machine_with_an_accelerator():
    with pytest.raises(RuntimeError, match="this machine has an accelerator"), cpu_as_accelerator():
        pass
