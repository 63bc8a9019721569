"""
Unwrapping models and matching state-dict keys across wrappers.

`nn.DataParallel`, `DistributedDataParallel` and their subclasses keep the real model in `.module`; `torch.compile`
keeps it in `._orig_mod`. A state dict taken from the wrapper carries `module.` / `_orig_mod.` in every key, and
`from_pretrained` or a non-strict `load_state_dict` then silently leaves the model at its random initialisation.
This module removes the wrappers before saving and maps prefixed keys (wherever the prefixes sit) onto the model's
keys; reading and loading weight files is `hf_parallel.saving.checkpoints`.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.nn.parallel.data_parallel import DataParallel
from torch.nn.parallel.distributed import DistributedDataParallel
from transformers.utils import logging

logger = logging.get_logger(__name__)

# The attribute names under which wrappers keep the wrapped model; they are also the key components they add.
WRAPPER_KEY_COMPONENTS = ("module", "_orig_mod")

# Wrappers of optional libraries, matched by class name so that none of them has to be importable.
_MODULE_WRAPPER_NAMES = {"DeepSpeedEngine", "FullyShardedDataParallel", "PipelineEngine"}

# How many keys an error message lists before it says how many more there are.
MAX_KEYS_SHOWN = 10

# Bound at import from their defining modules: code may rebind torch.nn.DataParallel for a while (a stand-in
# that does its device work elsewhere), and a model wrapped before must still be recognised.
DATA_PARALLEL_CLASSES = (DataParallel, DistributedDataParallel)


def _is_compiled(module: nn.Module) -> bool:
    # Looked up in sys.modules: importing torch._dynamo costs seconds, and without it no module can be compiled.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def _inner(module: nn.Module) -> nn.Module | None:
    """The module one wrapper holds, or `None` when `module` is not a wrapper."""
    if _is_compiled(module):
        return module._orig_mod
    # Subclasses included: BalancedDataParallel is an nn.DataParallel.
    if isinstance(module, DATA_PARALLEL_CLASSES):
        return module.module
    if type(module).__name__ in _MODULE_WRAPPER_NAMES and isinstance(getattr(module, "module", None), nn.Module):
        return module.module
    return None


def _peel(model: nn.Module, inner=_inner) -> tuple[list[nn.Module], nn.Module]:
    """
    The one unwrapping walk: the wrappers around `model`, outermost first, and the module inside them, where
    `inner(module)` gives the module one wrapper holds (`None` when it is no wrapper). A wrapper that (indirectly)
    holds itself raises a `ValueError` instead of looping forever.
    """
    wrappers: list[nn.Module] = []
    seen = set()
    while (held := inner(model)) is not None:
        if id(model) in seen:
            raise ValueError(f"{type(model).__name__} wraps itself; cannot unwrap it.")
        seen.add(id(model))
        wrappers.append(model)
        model = held
    return wrappers, model


def unwrap_model(model: nn.Module) -> nn.Module:
    """
    Return the model inside any number of wrappers, nested in any order.

    Removes `nn.DataParallel` (and subclasses such as `BalancedDataParallel`), `DistributedDataParallel`,
    `torch.compile`'s `OptimizedModule` and the wrappers accelerate prepares (DeepSpeed's engine, FSDP). The returned
    module shares its parameters with `model`, so training through the wrapper and saving the result is safe.

    This is hf_parallel's one unwrapping walk (`unwrap_user_model` runs it for the data-parallel wrappers only). It is
    not accelerate's `extract_model_from_parallel` (what `Accelerator.unwrap_model` runs), which is not the same: it
    removes `torch.compile`'s wrapper only when it is the outermost (`nn.DataParallel(torch.compile(model))` comes
    back compiled, its keys still `_orig_mod.`-prefixed), and it reads `torch.nn.DataParallel` at each call, which
    may be rebound for a while (see `DATA_PARALLEL_CLASSES`).

    Args:
        model (`torch.nn.Module`):
            A model, wrapped or not.

    Returns:
        `torch.nn.Module`: the innermost model; `model` itself when it is not wrapped.

    ```python
    import torch
    from hf_parallel import unwrap_model

    wrapped = torch.nn.DataParallel(torch.compile(model))
    unwrap_model(wrapped).save_pretrained(output_dir)  # no `module.` or `_orig_mod.` in the saved keys
    ```
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unwrap_model expects a torch.nn.Module, got {type(model).__name__}.")
    return _peel(model)[1]


def _normalise(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in WRAPPER_KEY_COMPONENTS)


def match_keys(source_keys: Iterable[str], model_keys: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """
    Map the keys of a state dict onto a model's keys, ignoring wrapper components (`module.`, `_orig_mod.`).

    A key that is already a model key maps to itself, so a model with a real submodule named `module` keeps working;
    otherwise a key maps to the model key that is equal to it once wrapper components are removed from both.
    Not torch's `consume_prefix_in_state_dict_if_present` nor accelerate's key cleaning: they remove one leading
    prefix, and a compiled or wrapped submodule puts `_orig_mod.` / `module.` in the middle of a key.

    Args:
        source_keys (`Iterable[str]`): the keys of the state dict.
        model_keys (`Iterable[str]`): the keys of the (unwrapped) model's state dict.

    Returns:
        `tuple[dict[str, str], list[str]]`: the mapping source key -> model key, and the source keys that match none.

    Raises:
        `ValueError`: when two source keys map to the same model key (e.g. both `x` and `module.x` are present).
    """
    model_keys = list(model_keys)
    exact = set(model_keys)
    by_norm: dict[str, str | None] = {}
    for key in model_keys:
        norm = _normalise(key)
        # Two model keys equal after normalising: only exact matches are unambiguous for them.
        by_norm[norm] = None if norm in by_norm else key
    mapping: dict[str, str] = {}
    unexpected: list[str] = []
    by_target: dict[str, list[str]] = {}
    for key in source_keys:
        target = key if key in exact else by_norm.get(_normalise(key))
        if target is None:
            unexpected.append(key)
        else:
            mapping[key] = target
            by_target.setdefault(target, []).append(key)
    clashes = {t: ks for t, ks in by_target.items() if len(ks) > 1}
    if clashes:
        raise ValueError(
            "The state dict holds the same weight more than once under different wrapper prefixes: "
            + "; ".join(f"{t} <- {ks}" for t, ks in list(clashes.items())[:MAX_KEYS_SHOWN])
            + ". It mixes a wrapped and an unwrapped model's weights; keep one copy of each key."
        )
    return mapping, unexpected


def clean_state_dict(state_dict: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """
    Rename the keys of `state_dict` to those of `unwrap_model(model)`, removing `module.` and `_orig_mod.` wherever
    they were added by a wrapper. Keys the model does not have are kept as they are.

    Args:
        state_dict (`Mapping[str, torch.Tensor]`): a state dict, possibly taken from a wrapped model.
        model (`torch.nn.Module`): the model the state dict belongs to, wrapped or not.

    ```python
    from hf_parallel.saving.unwrap import clean_state_dict

    clean = clean_state_dict(torch.nn.DataParallel(model).state_dict(), model)  # keys as in model.state_dict()
    ```
    """
    mapping, _ = match_keys(state_dict.keys(), unwrap_model(model).state_dict().keys())
    return {mapping.get(key, key): value for key, value in state_dict.items()}


def has_wrapper_prefixes(keys: Iterable[str], model: nn.Module) -> bool:
    """Whether some of `keys` carry a wrapper component (`module.`, `_orig_mod.`) that `unwrap_model(model)` lacks."""
    model_keys = set(unwrap_model(model).state_dict().keys())
    return any(key not in model_keys and _normalise(key) != key for key in keys)


# ---- A model handed to the Trainer already wrapped ----


def _split_settings_from(wrapper: nn.Module, args):
    """
    `args` with the `gpu0_bsz` / `gpu0_weight` of a `BalancedDataParallel` the model came in: a copy when it takes one
    over, `args` itself when it sets the same values or the wrapper has none; a clear error when the two disagree.
    """
    for name in ("gpu0_bsz", "gpu0_weight"):
        wanted = getattr(wrapper, name, None)
        if wanted is None or not hasattr(args, name):
            continue
        current = getattr(args, name)
        if current is None:
            other = "gpu0_weight" if name == "gpu0_bsz" else "gpu0_bsz"
            if getattr(args, other, None) is not None:
                raise ValueError(
                    f"The model was passed wrapped in {type(wrapper).__name__}({name}={wanted}) but the "
                    f"TrainingArguments set {other}={getattr(args, other)}. Pass the bare model and set one of "
                    "them in TrainingArguments."
                )
            args = copy.copy(args)  # the caller's object may serve another Trainer with a bare model
            setattr(args, name, wanted)
            from ..training_args import validate_hf_parallel_fields  # here: the arguments' module imports this package

            validate_hf_parallel_fields(args)
            logger.info(f"Using {name}={wanted} from the {type(wrapper).__name__} the model was passed in.")
        elif current != wanted:
            raise ValueError(
                f"The model was passed wrapped in {type(wrapper).__name__}({name}={wanted}) but the "
                f"TrainingArguments set {name}={current}. Pass the bare model and set {name} in "
                "TrainingArguments only."
            )
    return args


def unwrap_user_model(model: nn.Module | None, args) -> tuple[nn.Module | None, object]:
    """
    Take the model out of the `nn.DataParallel` / `DistributedDataParallel` the user wrapped it in before creating
    the Trainer, which wraps the model itself (DataParallel on several GPUs, DDP under a launcher).

    Stock `transformers.Trainer` fails on such a model twice: its column filter reads the wrapper's
    `forward(*inputs, **kwargs)` and drops every column ("The batch received was empty"), and with that filter off
    it saves `module.`-prefixed weights that `from_pretrained` ignores, leaving random weights. The inner model
    shares its parameters with the wrapper, so the user's reference keeps seeing the trained weights.
    A `BalancedDataParallel`'s `gpu0_bsz` / `gpu0_weight` move to a copy of `args` when `args` does not set them.

    Args:
        model (`torch.nn.Module`, *optional*):
            The model handed to the Trainer, wrapped or not (`None` with `model_init`).
        args (`TrainingArguments`):
            The Trainer's arguments; never modified.

    Returns:
        `tuple`: the model to train and the arguments to train it with.
    """
    if not isinstance(model, DATA_PARALLEL_CLASSES):
        return model, args
    # Only the data-parallel wrappers the Trainer makes itself: a torch.compile'd model inside stays compiled.
    wrappers, model = _peel(model, lambda module: module.module if isinstance(module, DATA_PARALLEL_CLASSES) else None)
    names = " in ".join(type(w).__name__ for w in wrappers)
    for wrapper in wrappers:
        args = _split_settings_from(wrapper, args)
    device_ids = getattr(wrappers[0], "device_ids", None)
    if isinstance(wrappers[0], DataParallel) and device_ids and len(device_ids) != torch.cuda.device_count():
        logger.warning(
            f"The model was passed wrapped in {names} over devices {device_ids}; the Trainer uses every visible GPU "
            f"({torch.cuda.device_count()}). To use fewer, set CUDA_VISIBLE_DEVICES."
        )
    logger.info(
        f"The model was passed wrapped in {names}: the Trainer uses the inner {type(model).__name__} and wraps it "
        "itself, so checkpoints carry no `module.` prefix."
    )
    return model, args
