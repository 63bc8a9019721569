"""
DeepSpeed ZeRO checkpoints resumed on another number of data-parallel ranks.

DeepSpeed's loader refuses a ZeRO checkpoint written by another data-parallel world size ("Automatic adjustment of
ZeRO's optimizer state partitioning with a new world size is not currently supported"). Its universal checkpoint
converts Adam's two moments only (SGD's `momentum_buffer` fails its converter with a KeyError), and in 0.19.8 a
ZeRO-3 run resumed from it drifts from the uninterrupted run from its second step, even on the same world size.

Here every rank's partition of the fp32 master weights, and of each optimizer state the optimizer keeps (whatever its
keys), is read once and merged into whole tensors with the merge `zero_to_fp32` uses for the weights (DeepSpeed's own
layout of ZeRO 1/2 groups and ZeRO-3 sub-groups), and written into the new engine's partitions with
`deepspeed.utils.safe_set_full_fp32_param` / `safe_set_full_optimizer_state`: weights, optimizer state, the
optimizer's step count, buffers and frozen parameters, the engine's counters and its own scheduler, if any.
The Trainer's scheduler, data position and RNG are loaded by the Trainer as on the same world size.
"""

from __future__ import annotations

import glob
import os

import torch
from torch import nn

__all__ = ["deepspeed_checkpoint_folder", "load_on_any_world_size"]


def deepspeed_checkpoint_folder(checkpoint: str) -> str | None:
    """The folder of DeepSpeed's engine state in a Trainer checkpoint (`<checkpoint>/<tag of latest>`), or None."""
    latest = os.path.join(checkpoint, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as file:
        folder = os.path.join(checkpoint, file.read().strip())
    return folder if os.path.isdir(folder) else None


def _group_states(optimizer: dict) -> list[dict]:
    """The inner optimizer's state of each flat group (ZeRO 1/2) or sub-group (ZeRO-3), in group order."""
    inner = optimizer.get("base_optimizer_state") or optimizer.get("optimizer_state_dict")
    state = inner["state"]
    if isinstance(state, dict):
        return [state[key] for key in sorted(state)]
    return list(state)


def _whole(flats: list[list[torch.Tensor]], optimizers: list[dict], model_states: list) -> dict[str, torch.Tensor]:
    """
    Whole tensors by parameter name from every rank's flat partitions (`flats[rank][group]`): the fp32 masters' or one
    optimizer state's, with `zero_to_fp32`'s own merge of the stage's layout (buffers, frozen and tied parameters
    come along from the model-state files).
    """
    from deepspeed.utils import zero_to_fp32

    world_size, first = len(flats), optimizers[0]
    if int(first["zero_stage"]) <= 2:
        paddings = first.get(zero_to_fp32.PARAM_ALIGNMENT_PADDINGS)
        merged = zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
            world_size, flats, model_states, False, paddings
        )
    else:
        merged = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world_size, flats, model_states, False)
    return zero_to_fp32.to_torch_tensor(merged)


def _whole_states(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], object]:
    """The checkpoint's fp32 weights (buffers and frozen parameters included), each optimizer state by key, and the
    optimizer's step count, every one whole; every rank's files read once."""
    from deepspeed.utils import zero_to_fp32

    # Every rank's ZeRO optimizer file (in rank order) and the model-state files' description of the parameters.
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(folder))
    files = zero_to_fp32.get_optim_files(folder)
    optimizers = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    stage3 = int(optimizers[0]["zero_stage"]) > 2
    masters = zero_to_fp32.FP32_FLAT_GROUPS if stage3 else zero_to_fp32.SINGLE_PARTITION_OF_FP32_GROUPS
    weights = _whole([optimizer[masters] for optimizer in optimizers], optimizers, model_states)
    groups = [_group_states(optimizer) for optimizer in optimizers]
    keys = [k for k, v in groups[0][0].items() if torch.is_tensor(v) and v.dim() == 1]
    states = {key: _whole([[g[key] for g in rank] for rank in groups], optimizers, model_states) for key in keys}
    return weights, states, groups[0][0].get("step")


def _with_state_keys(engine, keys: list[str], step, stage3: bool) -> None:
    """
    Give the engine's optimizer every state key the checkpoint has, zero, and the checkpoint's step count, before the
    partitions are written: torch makes them at a parameter's first step (SGD's `momentum_buffer`, Adam's moments and
    step are still missing after ZeRO's first, gradient-less one), and ZeRO 1/2 link each parameter's view of them
    once they exist.
    """
    optimizer = engine.optimizer
    flats = optimizer.fp32_partitioned_groups_flat if stage3 else optimizer.single_partition_of_fp32_groups
    for flat in flats:
        state = optimizer.optimizer.state[flat]
        state.update({key: torch.zeros_like(flat) for key in keys if key not in state})
        if step is not None:
            state["step"] = step.clone() if torch.is_tensor(step) else step
    if not stage3:
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def _set_whole(engine, parameter: nn.Parameter, value: torch.Tensor, key: str | None, stage3: bool) -> None:
    """This rank's partition of the fp32 master (`key` None) or of an optimizer state, from its whole value."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if not stage3:
        if key is None:
            safe_set_full_fp32_param(parameter, value)
        else:
            safe_set_full_optimizer_state(parameter, value, key)
        return
    # ZeRO-3's own set_full_hp_param reads past the end of a parameter whose size the ranks do not divide (0.19.8:
    # "start (2) + length (2) exceeds dimension size (3)"): its last partition is padded, so pad the value alike.
    optimizer = engine.optimizer
    view, _ = optimizer._get_fp32_opt_state_partition(parameter, release_swap_buffers=False, optim_state_key=key)
    rank = optimizer._get_param_partition_rank(parameter)
    flat = value.detach().flatten().to(view.dtype)
    flat = torch.nn.functional.pad(flat, (0, max(0, view.numel() * (rank + 1) - flat.numel())))
    view.data.copy_(flat.narrow(0, view.numel() * rank, view.numel()))


def _write(engine, weights: dict, states: dict, step) -> None:
    """Write whole weights and optimizer states into this engine's partitions."""
    import deepspeed

    module: nn.Module = engine.module
    stage3 = engine.zero_optimization_partition_weights()
    _with_state_keys(engine, list(states), step, stage3)
    missing = [name for name, p in module.named_parameters() if p.requires_grad and name not in weights]
    if missing:
        raise ValueError(
            f"The DeepSpeed checkpoint has no weights for {', '.join(missing[:5])}: it was written by another model."
        )
    for name, parameter in module.named_parameters():
        if parameter.requires_grad:
            _set_whole(engine, parameter, weights[name].float(), None, stage3)
            for key, values in states.items():
                _set_whole(engine, parameter, values[name], key, stage3)
        elif name in weights:  # frozen: not in the optimizer; under ZeRO-3 partitioned all the same
            with deepspeed.zero.GatheredParameters([parameter], modifier_rank=0, enabled=stage3):
                parameter.data.copy_(weights[name].view_as(parameter))
    for name, buffer in module.named_buffers():
        if name in weights:
            buffer.data.copy_(weights[name])
    # The compute copies from the fp32 masters, as after an optimizer step.
    optimizer = engine.optimizer
    if stage3:
        for low, master in zip(
            optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat, strict=True
        ):
            low.data.copy_(master.data)
    else:
        optimizer.update_lp_params()


def _restore_engine_counters(engine, folder: str) -> None:
    """The engine's step counters, and its own scheduler's state (a `scheduler` of the DeepSpeed config)."""
    from deepspeed.utils import zero_to_fp32

    first = torch.load(zero_to_fp32.get_model_state_files(folder)[0], map_location="cpu", weights_only=False)
    for name in ("global_steps", "global_samples", "skipped_steps"):
        if name in first:
            setattr(engine, name, first[name])
    if engine.lr_scheduler is not None and first.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(first["lr_scheduler"])


def load_on_any_world_size(engine, checkpoint: str, load_module_strict: bool, load) -> None:
    """
    What `transformers.integrations.deepspeed.deepspeed_load_checkpoint` does (`load`), on any data-parallel world
    size: the same world size as the checkpoint's is DeepSpeed's own load; another merges and re-partitions.
    """
    folder = deepspeed_checkpoint_folder(checkpoint)
    # The data-parallel world size that wrote the engine state: one optimizer file per rank.
    saved = len(glob.glob(os.path.join(folder, "*_optim_states.pt"))) if folder is not None else 0
    if saved in (0, engine.dp_world_size):
        return load(engine, checkpoint, load_module_strict=load_module_strict)
    from transformers.utils import logging

    logging.get_logger(__name__).warning(
        f"{checkpoint} was written by DeepSpeed on {saved} data-parallel ranks and is resumed on "
        f"{engine.dp_world_size}: its weights and optimizer state are merged from their partitions and partitioned "
        "again (DeepSpeed's own loader refuses another world size)."
    )
    weights, states, step = _whole_states(folder)
    _write(engine, weights, states, step)
    _restore_engine_counters(engine, folder)
