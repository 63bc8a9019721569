"""teardown: a distributed Trainer releases its DDP wrapper and the process group before interpreter exit."""

from __future__ import annotations

import atexit
import weakref

import pytest
import torch
import torch.distributed as dist

from hf_parallel import Trainer, release_distributed
from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.harness import training_args
from tests.helpers.tiny import classification_rows, tiny_bert_classifier


def _train_then_release(output_dir: str) -> None:
    args = training_args(output_dir, per_device_train_batch_size=2, max_steps=1)
    trainer = Trainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_rows(8))
    assert args.world_size == 2
    trainer.train()
    wrapper = weakref.ref(trainer.model_wrapped)
    assert isinstance(wrapper(), torch.nn.parallel.DistributedDataParallel)
    # What the exit hook runs: afterwards nothing of DDP or gloo is left for interpreter finalization to destroy.
    release_distributed()
    assert wrapper() is None, "the DDP wrapper is still referenced"
    assert not dist.is_initialized()
    assert trainer.model_wrapped is trainer.model


@pytest.mark.full  # two processes launched to their exit (~5 s): .ci/run runs it in its own step
def test_a_distributed_trainer_is_released_before_exit(tmp_path):
    spawn_cpu_ranks(_train_then_release, (str(tmp_path),), num_processes=2)


def test_the_exit_hook_is_registered_for_distributed_trainers_only(tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr("hf_parallel.launch.teardown._registered", False)
    args = training_args(tmp_path)
    Trainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_rows(4))
    assert registered == []  # one process: nothing to release
