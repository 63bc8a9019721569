"""
Unwrapping and prefix-tolerant, safe state-dict loading.

`nn.DataParallel`, `DistributedDataParallel` and their subclasses keep the real model in `.module`; `torch.compile`
keeps it in `._orig_mod`. A state dict taken from the wrapper carries `module.` / `_orig_mod.` in every key, and
`from_pretrained` or a non-strict `load_state_dict` then silently leaves the model at its random initialisation.
This module removes the wrappers before saving and removes the prefixes (wherever they sit in a key) when loading.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import sys
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn
from torch.nn.parallel.data_parallel import DataParallel
from torch.nn.parallel.distributed import DistributedDataParallel
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, logging

logger = logging.get_logger(__name__)

# The attribute names under which wrappers keep the wrapped model; they are also the key components they add.
WRAPPER_KEY_COMPONENTS = ("module", "_orig_mod")

# Weight files of a checkpoint directory, in the order `from_pretrained` prefers them.
CHECKPOINT_WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)

# Wrappers of optional libraries, matched by class name so that none of them has to be importable.
_MODULE_WRAPPER_NAMES = {"DeepSpeedEngine", "FullyShardedDataParallel", "PipelineEngine"}

_MAX_KEYS_SHOWN = 10

# Bound at import from their defining modules: hf_parallel.testing.simulate_data_parallel rebinds `nn.DataParallel`
# for the duration of a block, and a model wrapped before that block must still be recognised inside it.
DATA_PARALLEL_CLASSES = (DataParallel, DistributedDataParallel)


class LoadResult(NamedTuple):
    """What `load_state_dict` did not load: model keys absent from the source, and source keys the model lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


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


def unwrap_model(model: nn.Module) -> nn.Module:
    """
    Return the model inside any number of wrappers, nested in any order.

    Removes `nn.DataParallel` (and subclasses such as `BalancedDataParallel`), `DistributedDataParallel`,
    `torch.compile`'s `OptimizedModule` and the wrappers accelerate prepares (DeepSpeed's engine, FSDP). The returned
    module shares its parameters with `model`, so training through the wrapper and saving the result is safe.

    Args:
        model (`torch.nn.Module`):
            A model, wrapped or not.

    Returns:
        `torch.nn.Module`: the innermost model; `model` itself when it is not wrapped.

    ```python
    import torch
    from hf_parallel import unwrap_model

    wrapped = torch.nn.DataParallel(torch.compile(model))
    unwrap_model(wrapped).save_pretrained("out")  # no `module.` or `_orig_mod.` in the saved keys
    ```
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unwrap_model expects a torch.nn.Module, got {type(model).__name__}.")
    seen = set()
    while (inner := _inner(model)) is not None:
        if id(model) in seen:  # a wrapper that (indirectly) holds itself would loop forever
            raise ValueError(f"{type(model).__name__} wraps itself; cannot unwrap it.")
        seen.add(id(model))
        model = inner
    return model


def _normalise(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in WRAPPER_KEY_COMPONENTS)


def _show(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_MAX_KEYS_SHOWN])
    return shown + (f", ... ({len(keys) - _MAX_KEYS_SHOWN} more)" if len(keys) > _MAX_KEYS_SHOWN else "")


def match_keys(source_keys: Iterable[str], model_keys: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """
    Map the keys of a state dict onto a model's keys, ignoring wrapper components (`module.`, `_orig_mod.`).

    A key that is already a model key maps to itself, so a model with a real submodule named `module` keeps working;
    otherwise a key maps to the model key that is equal to it once wrapper components are removed from both.

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
    for key in source_keys:
        target = key if key in exact else by_norm.get(_normalise(key))
        if target is None:
            unexpected.append(key)
        else:
            mapping[key] = target
    if len(set(mapping.values())) != len(mapping):
        by_target: dict[str, list[str]] = {}
        for key, target in mapping.items():
            by_target.setdefault(target, []).append(key)
        clashes = {t: ks for t, ks in by_target.items() if len(ks) > 1}
        raise ValueError(
            "The state dict holds the same weight more than once under different wrapper prefixes: "
            + "; ".join(f"{t} <- {ks}" for t, ks in list(clashes.items())[:_MAX_KEYS_SHOWN])
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
    from hf_parallel.unwrap import clean_state_dict

    clean = clean_state_dict(torch.nn.DataParallel(model).state_dict(), model)  # keys as in model.state_dict()
    ```
    """
    mapping, _ = match_keys(state_dict.keys(), unwrap_model(model).state_dict().keys())
    return {mapping.get(key, key): value for key, value in state_dict.items()}


def has_wrapper_prefixes(keys: Iterable[str], model: nn.Module) -> bool:
    """Whether some of `keys` carry a wrapper component (`module.`, `_orig_mod.`) that `unwrap_model(model)` lacks."""
    model_keys = set(unwrap_model(model).state_dict().keys())
    return any(
        key not in model_keys and any(part in WRAPPER_KEY_COMPONENTS for part in key.split(".")) for key in keys
    )


# ---- Reading state dicts from disk ----


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load_file(path, device="cpu")
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"Could not read the safetensors file {path}: {err}. The file is corrupted or truncated (an interrupted "
            "save or download, or a file that is not safetensors at all); save or download it again."
        ) from err


def _read_pickle(path: str) -> Mapping:
    try:
        # weights_only: a pickle can run arbitrary code when it is loaded; tensors and plain containers cannot.
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only" in str(err).lower():
            raise ValueError(
                f"Refusing to load {path}: it holds objects other than tensors (for instance a whole pickled model "
                "or optimizer), and loading those can run arbitrary code, so only weights_only=True loads are made. "
                "If you trust the file, load it yourself with torch.load(path, weights_only=False), take the model's "
                "state dict from it, and pass that dict to load_state_dict."
            ) from err
        raise ValueError(
            f"Could not read {path} as a PyTorch pickle: {err}. The file is corrupted or truncated."
        ) from err
    except (RuntimeError, EOFError, OSError) as err:
        raise ValueError(
            f"Could not read {path} as a PyTorch pickle: {err}. The file is corrupted or truncated."
        ) from err


def _read_index(path: str) -> dict[str, torch.Tensor]:
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(
            f"{path} is not a sharded-checkpoint index (JSON with a 'weight_map' from key to shard file): {err}."
        ) from err
    folder = os.path.dirname(path)
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            raise FileNotFoundError(
                f"The index {path} lists the shard {shard}, which is not in {folder}. Copy the whole checkpoint "
                "directory, every shard included."
            )
        state_dict.update(_read_file(shard_path))
    return state_dict


def _read_file(path: str) -> Mapping:
    if path.endswith(".safetensors"):
        return _read_safetensors(path)
    if path.endswith(".index.json"):
        return _read_index(path)
    return _read_pickle(path)


def read_state_dict(source: str | os.PathLike | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """
    Read a state dict from a mapping, a `.safetensors` file, a `.bin`/`.pt` pickle (loaded with `weights_only=True`),
    a sharded-checkpoint index (`*.index.json`) or a checkpoint directory in the `save_pretrained` layout.

    Args:
        source (`str`, `os.PathLike` or `Mapping[str, torch.Tensor]`): where the weights are.

    Returns:
        `dict[str, torch.Tensor]`: the keys as stored, wrapper prefixes included.
    """
    if isinstance(source, Mapping):
        state_dict, where = dict(source), "The state dict"
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            found = [name for name in CHECKPOINT_WEIGHT_FILES if os.path.isfile(os.path.join(path, name))]
            if not found:
                raise FileNotFoundError(
                    f"No weights in the directory {path}: expected one of {', '.join(CHECKPOINT_WEIGHT_FILES)} "
                    f"(the save_pretrained layout); it holds {sorted(os.listdir(path))[:20]}. Pass the path of the "
                    "weights file itself, or the checkpoint directory that save_pretrained / Trainer wrote."
                )
            path = os.path.join(path, found[0])
        elif not os.path.exists(path):
            raise FileNotFoundError(
                f"No checkpoint at {path}: the file or directory does not exist. Check the path (a checkpoint "
                "directory such as out/checkpoint-500, or a .safetensors / .bin / .pt file)."
            )
        state_dict, where = _read_file(path), path
    else:
        raise TypeError(
            "source must be a state dict, a path to a weights file or a checkpoint directory; "
            f"got {type(source).__name__}."
        )
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{where} holds a {type(state_dict).__name__}, not a state dict (a mapping name -> tensor).")
    not_tensors = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise ValueError(
            f"{where} is not a plain state dict: the entries {_show(map(str, not_tensors))} are not tensors. If it "
            "is a training checkpoint holding the state dict under one of these keys, pass that entry instead, e.g. "
            "load_state_dict(model, torch.load(path, weights_only=True)['model'])."
        )
    return state_dict


# ---- Loading ----


def _tolerated_missing(model: nn.Module, loaded: set[str]) -> set[str]:
    """Model keys that may be absent: tied copies of a loaded weight, and keys the model itself never saves."""
    tolerated: set[str] = set()
    groups: dict[tuple, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if tensor.device.type != "meta" and tensor.numel() > 0:
            groups.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(key)
    for keys in groups.values():
        # save_pretrained writes one of a group of tied weights (e.g. lm_head.weight = embeddings); loading that one
        # fills the others too.
        if len(keys) > 1 and any(k in loaded for k in keys):
            tolerated.update(keys)
    tolerated.update(getattr(model, "_keys_to_ignore_on_save", None) or ())
    return tolerated


def load_state_dict(
    model: nn.Module, source: str | os.PathLike | Mapping[str, torch.Tensor], strict: bool = True
) -> LoadResult:
    """
    Load weights into `model`, whatever wrapped the model that saved them and whatever wraps `model` now.

    The keys are matched after removing `module.` and `_orig_mod.` wherever they occur (nested wrappers give
    `module._orig_mod.x`). Pickles are only read with `weights_only=True`. Tied weights that `save_pretrained` writes
    once are not reported missing.

    Args:
        model (`torch.nn.Module`):
            The model to fill, wrapped or not; loading is done in place into `unwrap_model(model)`.
        source (`str`, `os.PathLike` or `Mapping[str, torch.Tensor]`):
            A state dict, a `.safetensors` file, a `.bin`/`.pt` file, a sharded index (`*.index.json`) or a
            checkpoint directory (`model.safetensors`, `pytorch_model.bin` or their sharded index inside).
        strict (`bool`, *optional*, defaults to `True`):
            Raise when a model key is missing from the source or the source has keys the model lacks. With `False`
            they are returned (and logged) instead. Shape mismatches always raise.

    Returns:
        [`LoadResult`]: the missing and unexpected keys (both empty after a strict load).

    Raises:
        `FileNotFoundError`: the path, or a shard its index names, does not exist.
        `ValueError`: a corrupted file, a pickle `weights_only` refuses, keys or shapes of another architecture.

    ```python
    from hf_parallel import load_state_dict

    load_state_dict(model, "out/checkpoint-500")  # also fine: a checkpoint written with `module.` keys
    ```
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_state_dict expects a torch.nn.Module as model, got {type(model).__name__}.")
    state_dict = read_state_dict(source)
    where = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the state dict"
    target = unwrap_model(model)
    model_state = target.state_dict()
    mapping, unexpected = match_keys(state_dict.keys(), model_state.keys())
    renamed = {mapping[k]: v for k, v in state_dict.items() if k in mapping}
    mismatched = [
        f"{k}: {tuple(v.shape)} in the checkpoint, {tuple(model_state[k].shape)} in the model"
        for k, v in renamed.items()
        if v.shape != model_state[k].shape
    ]
    if mismatched:
        raise ValueError(
            f"Cannot load {where} into {type(target).__name__}: shapes differ for {len(mismatched)} weights "
            f"({'; '.join(mismatched[:_MAX_KEYS_SHOWN])}). The checkpoint was saved from a model with another "
            "configuration; build the model from the checkpoint's config (from_pretrained) instead."
        )
    tolerated = _tolerated_missing(target, set(renamed))
    missing = sorted(k for k in model_state if k not in renamed and k not in tolerated)
    unexpected = sorted(unexpected)
    if strict and (missing or unexpected):
        raise ValueError(
            f"Cannot load {where} into {type(target).__name__} strictly: {len(missing)} model weights are missing "
            f"from it ({_show(missing) or 'none'}) and it has {len(unexpected)} weights the model lacks "
            f"({_show(unexpected) or 'none'}). It was most likely saved from another architecture or configuration. "
            "Load it into the model it was saved from, or pass strict=False to load the matching keys only."
        )
    target.load_state_dict(renamed, strict=False)
    if missing or unexpected:
        logger.warning(
            f"Loaded {where} non-strictly: missing keys {_show(missing) or 'none'}; "
            f"unexpected keys {_show(unexpected) or 'none'}."
        )
    return LoadResult(missing, unexpected)


# ---- A model handed to the Trainer already wrapped ----


def unwrap_user_model(model: nn.Module | None, args) -> tuple[nn.Module | None, object]:
    """
    Take the model out of the `nn.DataParallel` / `DistributedDataParallel` the user wrapped it in before creating
    the Trainer, which wraps the model itself (DataParallel on several GPUs, DDP under a launcher).

    Stock `transformers.Trainer` fails on such a model twice: its column filter reads the wrapper's
    `forward(*inputs, **kwargs)` and drops every column ("The batch received was empty"), and with that filter off
    it saves `module.`-prefixed weights that `from_pretrained` ignores, leaving random weights. The inner model
    shares its parameters with the wrapper, so the user's reference keeps seeing the trained weights.
    A `BalancedDataParallel`'s `gpu0_bsz` / `gpu0_weight` move to a copy of `args` when `args` does not set them.

    Returns:
        `tuple`: the model to train and the arguments to train it with.
    """
    if not isinstance(model, DATA_PARALLEL_CLASSES):
        return model, args
    wrappers = []
    while isinstance(model, DATA_PARALLEL_CLASSES):
        wrappers.append(model)
        model = model.module
    names = " in ".join(type(w).__name__ for w in wrappers)
    for wrapper in wrappers:
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
                args._validate_hf_parallel_fields()
                logger.info(f"Using {name}={wanted} from the {type(wrapper).__name__} the model was passed in.")
            elif current != wanted:
                raise ValueError(
                    f"The model was passed wrapped in {type(wrapper).__name__}({name}={wanted}) but the "
                    f"TrainingArguments set {name}={current}. Pass the bare model and set {name} in "
                    "TrainingArguments only."
                )
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
