"""
Checkpoint weights on disk: which weight files a checkpoint directory holds, the keys they store, reading them into a
state dict (pickles only with `weights_only=True`) and loading a state dict into a model whatever wrappers saved it.

Keys are matched across wrappers by `hf_parallel.saving.unwrap.match_keys`; shapes are left to the model's own
`load_state_dict`, which may adapt a buffer to the stored one (torch.ao's fake-quantize observers do).
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, logging

from ..engines.zero3 import gathered_parameters, is_partitioned, wait_for_every_rank
from .sharded import distribute_whole
from .unwrap import MAX_KEYS_SHOWN, match_keys, unwrap_model

logger = logging.get_logger(__name__)

# Weight files of a checkpoint directory, in the order `from_pretrained` prefers them.
CHECKPOINT_WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)


class LoadResult(NamedTuple):
    """What `load_state_dict` did not load: model keys absent from the source, and source keys the model lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _show(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:MAX_KEYS_SHOWN])
    return shown + (f", ... ({len(keys) - MAX_KEYS_SHOWN} more)" if len(keys) > MAX_KEYS_SHOWN else "")


# ---- Weight files and their keys ----


def _weight_map(index_path: str) -> dict[str, str]:
    """The `weight_map` (key -> shard file name) of a sharded-checkpoint index."""
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(
            f"{index_path} is not a sharded-checkpoint index (JSON with a 'weight_map' from key to shard file): {err}."
        ) from err
    return weight_map


def checkpoint_weight_files(folder: str | os.PathLike, shards: bool = False) -> list[str]:
    """
    The weight files of a checkpoint directory in the `save_pretrained` layout, in the order `from_pretrained`
    prefers them (so the first one is the one to read).

    Args:
        folder (`str` or `os.PathLike`):
            The checkpoint directory. A path that is not a directory holds no weight files.
        shards (`bool`, *optional*, defaults to `False`):
            Also list the shard files that the indexes among them name (those present), for instance to replace every
            weight file of the checkpoint.

    Returns:
        `list[str]`: the paths of the files present; empty when there is none.

    ```python
    from hf_parallel.saving.checkpoints import checkpoint_weight_files

    found = checkpoint_weight_files("out/checkpoint-500")  # e.g. ["out/checkpoint-500/model.safetensors"]
    ```
    """
    folder = os.fspath(folder)
    paths = [path for path in (os.path.join(folder, name) for name in CHECKPOINT_WEIGHT_FILES) if os.path.isfile(path)]
    for index in [path for path in paths if shards and path.endswith(".index.json")]:
        listed = (os.path.join(folder, name) for name in sorted(set(_weight_map(index).values())))
        paths += [path for path in listed if os.path.isfile(path)]
    return paths


def stored_keys(path: str | os.PathLike) -> list[str]:
    """
    The keys a weight file stores, as written (wrapper prefixes included); a safetensors file or an index is not
    loaded for this, only its header or its `weight_map` is read.

    Args:
        path (`str` or `os.PathLike`):
            A `.safetensors` file, a sharded index (`*.index.json`) or a `.bin`/`.pt` pickle.

    Returns:
        `list[str]`: the stored keys, in the file's order.
    """
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    if path.endswith(".index.json"):
        return list(_weight_map(path))
    return list(read_state_dict(path))


# ---- Reading state dicts from disk ----


def _read_index(path: str) -> dict[str, torch.Tensor]:
    folder = os.path.dirname(path)
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(set(_weight_map(path).values())):
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            raise FileNotFoundError(
                f"The index {path} lists the shard {shard}, which is not in {folder}. Copy the whole checkpoint "
                "directory, every shard included."
            )
        state_dict.update(_read_file(shard_path))
    return state_dict


def _read_file(path: str) -> Mapping:
    if path.endswith(".index.json"):
        return _read_index(path)
    if path.endswith(".safetensors"):
        try:
            return safetensors.torch.load_file(path, device="cpu")
        except (SafetensorError, OSError) as err:
            raise ValueError(
                f"Could not read the safetensors file {path}: {err}. The file is corrupted or truncated (an "
                "interrupted save or download, or a file that is not safetensors at all); save or download it again."
            ) from err
    try:
        # weights_only: a pickle can run arbitrary code when it is loaded; tensors and plain containers cannot.
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        if isinstance(err, pickle.UnpicklingError) and "weights only" in str(err).lower():
            raise ValueError(
                f"Refusing to load {path}: it holds objects other than tensors (for instance a whole pickled model "
                "or optimizer), and loading those can run arbitrary code, so only weights_only=True loads are made. "
                "If you trust the file, load it yourself with torch.load(path, weights_only=False), take the model's "
                "state dict from it, and pass that dict to load_state_dict."
            ) from err
        raise ValueError(
            f"Could not read {path} as a PyTorch pickle: {err}. The file is corrupted or truncated."
        ) from err


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
        # The weight file to read: `source` itself, or the preferred weight file of a checkpoint directory.
        where = os.fspath(source)
        if os.path.isdir(where):
            found = checkpoint_weight_files(where)
            if not found:
                raise FileNotFoundError(
                    f"No weights in the directory {where}: expected one of {', '.join(CHECKPOINT_WEIGHT_FILES)} "
                    f"(the save_pretrained layout); it holds {sorted(os.listdir(where))[:20]}. Pass the path of the "
                    "weights file itself, or the checkpoint directory that save_pretrained / Trainer wrote."
                )
            where = found[0]
        elif not os.path.exists(where):
            raise FileNotFoundError(
                f"No checkpoint at {where}: the file or directory does not exist. Check the path (a checkpoint "
                "directory such as out/checkpoint-500, or a .safetensors / .bin / .pt file)."
            )
        state_dict = _read_file(where)
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
    groups: dict[tuple, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: its own shard's storage
        if local.device.type != "meta" and local.numel() > 0:
            groups.setdefault((local.device, local.untyped_storage().data_ptr()), []).append(key)
    tolerated = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    for keys in groups.values():
        # save_pretrained writes one of a group of tied weights (e.g. lm_head.weight = embeddings); loading that one
        # fills the others too.
        if len(keys) > 1 and any(k in loaded for k in keys):
            tolerated.update(keys)
    return tolerated


def load_state_dict(
    model: nn.Module, source: str | os.PathLike | Mapping[str, torch.Tensor], strict: bool = True
) -> LoadResult:
    """
    Load weights into `model`, whatever wrapped the model that saved them and whatever wraps `model` now.

    The keys are matched after removing `module.` and `_orig_mod.` wherever they occur (nested wrappers give
    `module._orig_mod.x`). Pickles are only read with `weights_only=True`. Tied weights that `save_pretrained` writes
    once are not reported missing. Shapes are checked by the model's own `load_state_dict`, so a model that adapts a
    buffer to the stored shape (a torch.ao quantization-aware-training model) loads as it does with torch.

    Args:
        model (`torch.nn.Module`):
            The model to fill, wrapped or not; loading is done in place into `unwrap_model(model)`.
        source (`str`, `os.PathLike` or `Mapping[str, torch.Tensor]`):
            A state dict, a `.safetensors` file, a `.bin`/`.pt` file, a sharded index (`*.index.json`) or a
            checkpoint directory (`model.safetensors`, `pytorch_model.bin` or their sharded index inside).
        strict (`bool`, *optional*, defaults to `True`):
            Raise, before any weight is copied, when a model key is missing from the source or the source has keys
            the model lacks. With `False` they are returned (and logged) instead. A shape the model refuses always
            raises.

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
    # A model sharded at load time holds DTensors: each takes its own part of the whole tensor read from disk.
    renamed = {k: distribute_whole(v, model_state[k]) for k, v in renamed.items()}
    try:
        # Keys were checked above, with tied weights tolerated; torch's strict check would not tolerate them.
        target.load_state_dict(renamed, strict=False)
    except RuntimeError as err:
        # Shapes are the model's call: a module may resize a buffer to the stored one in its `_load_from_state_dict`
        # (torch.ao's per-channel fake-quantize observers start with a placeholder shape), so only a shape the model
        # refuses is an error.
        refused = [k for k in renamed if f"size mismatch for {k}:" in str(err)]
        if not refused:
            raise RuntimeError(f"Cannot load {where} into {type(target).__name__}: {err}") from err
        shapes = [
            f"{k}: {tuple(renamed[k].shape)} in the checkpoint, {tuple(model_state[k].shape)} in the model"
            for k in refused
        ]
        raise ValueError(
            f"Cannot load {where} into {type(target).__name__}: shapes differ for {len(refused)} weights "
            f"({'; '.join(shapes[:MAX_KEYS_SHOWN])}). The checkpoint was saved from a model with another "
            "configuration; build the model from the checkpoint's config (from_pretrained) instead. The weights "
            "whose shapes fit were copied before the model refused these, so rebuild it before loading again."
        ) from err
    if missing or unexpected:
        logger.warning(
            f"Loaded {where} non-strictly: missing keys {_show(missing) or 'none'}; "
            f"unexpected keys {_show(unexpected) or 'none'}."
        )
    return LoadResult(missing, unexpected)


def check_reload(trainer, output_dir: str, model_class: type | None = None, tolerance: float = 1e-5) -> float:
    """
    Reload the model `trainer` saved in `output_dir` with `from_pretrained` and compare its logits on the first
    evaluation batch with the trained model's; return the largest absolute difference. Under DeepSpeed ZeRO-3 every
    process must call it (the trained model's forward gathers each layer from every process; a process that calls it
    alone is told so after `hf_parallel.engines.zero3.RANKS_DEADLINE_S` seconds); elsewhere any process may.

    Args:
        trainer (`transformers.Trainer`): the trainer that saved the model (it has an evaluation dataset).
        output_dir (`str`): where `trainer.save_model` wrote it.
        model_class (`type`, *optional*): what loads it (an `AutoModelFor...` class); the trained model's class when
            `None`.
        tolerance (`float`, *optional*, defaults to 1e-5): the absolute and relative tolerance of the logits.

    Raises:
        `RuntimeError`: the checkpoint has missing, unexpected or mismatched keys.
        `AssertionError`: the reloaded logits differ beyond `tolerance`.

    ```python
    trainer.save_model(args.output_dir)
    max_diff = check_reload(trainer, args.output_dir)  # on every process: under ZeRO-3 each holds a slice
    if trainer.is_world_process_zero():
        print(f"max |diff| = {max_diff:.2e}")
    ```
    """
    from accelerate.utils import send_to_device

    trained = unwrap_model(trainer.model)
    if is_partitioned(trained):
        wait_for_every_rank("check_reload", "every rank must call check_reload (each runs the trained model).")
    loader = model_class if model_class is not None else type(trained)
    # Under ZeRO-3 every rank loads it, partitioned as the trained model is (transformers' zero.Init).
    reloaded, info = loader.from_pretrained(output_dir, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"The saved checkpoint in {output_dir} does not load cleanly: {bad}")
    device = next(trained.parameters()).device
    if not is_partitioned(reloaded):
        reloaded.to(device)
    reloaded.eval()
    trained.eval()
    batch = next(iter(trainer.get_eval_dataloader()))
    labels = getattr(trainer, "label_names", ["labels"])
    inputs = send_to_device({k: v for k, v in batch.items() if k not in labels}, device)
    with torch.no_grad():
        expected = trained(**inputs).logits  # under ZeRO-3 the engine gathers each layer as it runs
        with gathered_parameters(reloaded):
            actual = reloaded(**inputs).logits
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
    return (actual - expected).abs().max().item()
