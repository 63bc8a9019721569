"""
The whole state of a model sharded at load time (`from_pretrained(..., distributed_config=DistributedConfig(...))`:
FSDP, HSDP, tensor and expert parallelism), whose parameters are DTensors.

Stock transformers refuses to checkpoint such a model's optimizer state (it asks for `save_only_model=True`), and
cannot resume even its weights (`aten.copy_.default got mixed torch.Tensor and DTensor`). hf_parallel writes the
optimizer state with `torch.distributed.checkpoint` (each rank its own shards, `OPTIMIZER_FOLDER` beside the weights;
the keys are the parameters' names and the shapes global, so any layout reads it back) and loads both back on any
layout: the same one, another `DistributedConfig`, or one plain process; and a plain run's `optimizer.pt` into a
sharded model. The weights stay in the checkpoint's `model.safetensors` (stock's gathered save), which
`hf_parallel.load_state_dict` distributes over a sharded model's placements (`distribute_whole`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import nn

__all__ = [
    "GROUPS_FILE",
    "OPTIMIZER_FOLDER",
    "GroupSources",
    "distribute_whole",
    "is_sharded_at_load",
    "load_optimizer_any_layout",
    "save_sharded_optimizer",
]

#: The folder of a checkpoint that holds a sharded model's optimizer state (torch.distributed.checkpoint's format).
OPTIMIZER_FOLDER = "optimizer_sharded"
#: In `OPTIMIZER_FOLDER`: the parameter groups' settings, each with the names of its parameters.
GROUPS_FILE = "param_groups.pt"


def is_sharded_at_load(model: nn.Module | None) -> bool:
    """Whether transformers sharded `model` when it loaded it (a `DistributedConfig`)."""
    return bool(getattr(model, "is_distributed_loading_by_transformers", False))


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def distribute_whole(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """
    `value`, a whole tensor every rank holds, laid out as `like` (a DTensor: its mesh and placements; each rank keeps
    its own part, nothing is sent); `value` itself where `like` is a plain tensor.
    """
    # Another shape is left as it is: the caller's shape check names it.
    if not _is_dtensor(like) or tuple(value.shape) != tuple(like.shape):
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def _inner(optimizer):
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def save_sharded_optimizer(model: nn.Module, optimizer, output_dir: str, main: bool) -> None:
    """
    Write the optimizer state of a sharded model into `output_dir/OPTIMIZER_FOLDER` (every rank must call it): its
    tensors by parameter name, each rank its shards; and, by the `main` process, the parameter groups' settings
    (`GROUPS_FILE`), which each layout groups its own way (transformers gives each device mesh its own group).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, _inner(optimizer))
    folder = os.path.join(output_dir, OPTIMIZER_FOLDER)
    dcp.save({"state": state["state"]}, checkpoint_id=folder)
    if main:
        torch.save(state["param_groups"], os.path.join(folder, GROUPS_FILE))


class GroupSources(NamedTuple):
    """Which of the checkpoint's `saved` parameter groups each of this optimizer's groups took its settings from
    (None: a group none of whose parameters the checkpoint names)."""

    sources: list[int | None]
    saved: int

    def scheduler_state(self, saved_state: dict, current_state: dict) -> dict:
        """A scheduler's saved state with its per-group lists (base learning rates, last learning rates, ...) laid
        out as this optimizer groups its parameters."""
        if self.sources == list(range(self.saved)):
            return saved_state
        remapped = dict(saved_state)
        for key, value in saved_state.items():
            if isinstance(value, list) and len(value) == self.saved:
                mine = current_state.get(key)
                remapped[key] = [value[j] if j is not None else mine[i] for i, j in enumerate(self.sources)]
        return remapped


def _load_sharded(model: nn.Module, optimizer, folder: str) -> GroupSources:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    inner = _inner(optimizer)
    # The optimizer's own state, laid out as this run holds it (made by a step with no gradient and no learning rate
    # where the optimizer has none yet), filled from the checkpoint's shards whatever layout wrote them.
    state = get_optimizer_state_dict(model, inner)
    dcp.load({"state": state["state"]}, checkpoint_id=folder)
    # Each group's settings (its learning rate where a schedule moved it) from the saved group of its parameters.
    saved = torch.load(os.path.join(folder, GROUPS_FILE), weights_only=True)
    group_of = {name: index for index, group in enumerate(saved) for name in group["params"]}
    sources = []
    for group in state["param_groups"]:
        sources.append(next((group_of[name] for name in group["params"] if name in group_of), None))
        if sources[-1] is not None:
            group.update({key: value for key, value in saved[sources[-1]].items() if key != "params"})
    set_optimizer_state_dict(model, inner, state)
    return GroupSources(sources, len(saved))


def _load_whole_into_sharded(optimizer, path: str) -> GroupSources:
    """A plain run's `optimizer.pt` (whole tensors, keyed by position) into an optimizer of DTensor parameters."""
    inner = _inner(optimizer)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if len(saved["param_groups"]) != len(inner.param_groups):
        raise ValueError(
            f"{path} holds {len(saved['param_groups'])} parameter groups and this optimizer has "
            f"{len(inner.param_groups)} (transformers gives each device mesh of a sharded model its own group): its "
            "state keyed by position cannot be matched to these parameters. Resume it on the layout that wrote it."
        )
    parameters = [p for group in inner.param_groups for p in group["params"]]
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    if len(ids) != len(parameters):
        raise ValueError(
            f"{path} holds the state of {len(ids)} parameters; this optimizer has {len(parameters)}: it was written "
            "for another model or other parameter groups."
        )
    by_id = dict(zip(ids, parameters, strict=True))
    for key, state in saved["state"].items():
        parameter = by_id[key]
        for name, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[name] = distribute_whole(value, parameter)
    inner.load_state_dict(saved)
    return GroupSources(list(range(len(saved["param_groups"]))), len(saved["param_groups"]))


def load_optimizer_any_layout(model: nn.Module, optimizer, checkpoint: str) -> GroupSources | None:
    """
    Load the optimizer state of `checkpoint` where stock cannot: a sharded model's (`OPTIMIZER_FOLDER`) into any
    layout, or a plain run's `optimizer.pt` into a sharded model. Returns where each parameter group's settings came
    from (the scheduler's state follows them); None where stock's own load applies.
    """
    folder = os.path.join(checkpoint, OPTIMIZER_FOLDER)
    if os.path.isdir(folder):
        return _load_sharded(model, optimizer, folder)
    whole = os.path.join(checkpoint, "optimizer.pt")
    if os.path.isfile(whole) and any(_is_dtensor(p) for p in model.parameters()):
        return _load_whole_into_sharded(optimizer, whole)
    return None
