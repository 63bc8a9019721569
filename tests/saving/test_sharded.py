"""
The parts of resuming sharded runs that need no ranks (the runs themselves: tests/saving/test_sharded_resume.py and
tests/engines/test_deepspeed_resume.py, `full`): a checkpoint of the other engine refused by name, a scheduler's
per-group values following the parameter groups of another layout, and a plain optimizer state that cannot be matched
to a sharded model's groups refused.
"""

from __future__ import annotations

import pytest
import torch

from hf_parallel.saving.resume import check_checkpoint_engine
from hf_parallel.saving.sharded import GroupSources, _load_whole_into_sharded


def _deepspeed_checkpoint(folder):
    (folder / "global_step2").mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _plain_checkpoint(folder):
    folder.mkdir(parents=True)
    (folder / "optimizer.pt").write_bytes(b"")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_a_checkpoint_of_the_other_engine_is_refused_by_name(tmp_path):
    zero = _deepspeed_checkpoint(tmp_path / "zero")
    plain = _plain_checkpoint(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"written under DeepSpeed ZeRO: .*global_step2.*a run without DeepSpeed"):
        check_checkpoint_engine(str(zero), deepspeed=False)
    with pytest.raises(
        ValueError, match=r"^Can't find a valid checkpoint at .*plain: it was written without DeepSpeed"
    ):
        check_checkpoint_engine(str(plain), deepspeed=True)
    check_checkpoint_engine(str(zero), deepspeed=True)  # each engine its own: nothing to say
    check_checkpoint_engine(str(plain), deepspeed=False)
    check_checkpoint_engine(None, deepspeed=True)


def test_a_schedulers_group_values_follow_the_saved_group_of_each_parameter_group():
    # Saved: 2 groups (decay, no decay); now 3 (tensor parallelism split the first by device mesh).
    groups = GroupSources(sources=[0, 0, 1], saved=2)
    saved = {"base_lrs": [0.1, 0.2], "_last_lr": [0.05, 0.1], "last_epoch": 7}
    current = {"base_lrs": [1.0, 1.0, 1.0], "_last_lr": [1.0, 1.0, 1.0], "last_epoch": 0}
    remapped = groups.scheduler_state(saved, current)
    assert remapped == {"base_lrs": [0.1, 0.1, 0.2], "_last_lr": [0.05, 0.05, 0.1], "last_epoch": 7}
    # A group none of whose parameters the checkpoint names keeps its own values.
    mine = {"base_lrs": [9.0, 9.0], "_last_lr": [8.0, 8.0], "last_epoch": 0}
    assert GroupSources([None, 1], 2).scheduler_state(saved, mine)["_last_lr"] == [8.0, 0.1]
    assert GroupSources([0, 1], 2).scheduler_state(saved, current) is saved  # the same groups: as saved


def test_a_plain_optimizer_state_of_other_groups_is_refused(tmp_path):
    weights = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    saved = torch.optim.SGD([{"params": weights[:2]}, {"params": weights[2:]}], lr=0.1, momentum=0.9)
    for weight in weights:
        weight.grad = torch.ones(2)
    saved.step()
    torch.save(saved.state_dict(), tmp_path / "optimizer.pt")
    split = torch.optim.SGD([{"params": [w]} for w in weights], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="holds 2 parameter groups and this optimizer has 3"):
        _load_whole_into_sharded(split, str(tmp_path / "optimizer.pt"))
    same = torch.optim.SGD([{"params": weights[:2]}, {"params": weights[2:]}], lr=0.1, momentum=0.9)
    _load_whole_into_sharded(same, str(tmp_path / "optimizer.pt"))  # plain parameters: the tensors as they are
    assert torch.equal(same.state[weights[0]]["momentum_buffer"], torch.ones(2))
