"""
Resuming: which checkpoint a run resumes from, what it must find there, and the random state of a rank the checkpoint
has none for.

- `resume_from_checkpoint=True` takes the newest *complete* checkpoint (stock takes the highest number, complete or
  not, and fails on a torn one), warning once naming each torn checkpoint it passed over and any save a kill left in
  the staging folder (`hf_parallel.saving.staging`). A path given explicitly to a torn checkpoint fails before the
  first step, naming what it lacks and the newest complete one.
- Complete: `trainer_state.json` (stock writes it last) and the model's weights. Checkpoints hf_parallel writes are
  complete by construction; this also reads those of stock or older runs.
- A checkpoint written under another global batch (processes x rows per device x gradient accumulation) is warned: the
  run goes on, but not on the uninterrupted run's trajectory. Under the same global batch it does, on any topology,
  since the exact loss does not depend on how the batch is split.
- A rank without its own RNG file in the checkpoint (written by another number of processes, or with
  `save_only_model`) is seeded with `set_seed(seed + process_index + world_size * global_step)`: defined, and
  different on every rank and at every resumed step.
"""

from __future__ import annotations

import json
import os
import re

from transformers import set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..engines.reshard import deepspeed_checkpoint_folder
from .checkpoints import checkpoint_weight_files
from .staging import RUN_FILE, STAGING_DIR, TRAINER_STATE, run_record

__all__ = [
    "check_checkpoint_engine",
    "checkpoint_problems",
    "complete_checkpoints",
    "rank_seed",
    "resolve_resume",
    "seed_rank_without_state",
]

logger = logging.get_logger(__name__)

_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
# Model weights a checkpoint may hold besides the save_pretrained files: PEFT adapters, FSDP's state dicts, DeepSpeed's
# engine state (its `latest` tag file).
_OTHER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "pytorch_model_fsdp.bin", "latest")


def _has_weights(path: str) -> bool:
    if checkpoint_weight_files(path):
        return True
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name in _OTHER_WEIGHTS or (os.path.isdir(full) and name.startswith(("pytorch_model_fsdp", "global_step"))):
            return True
        if os.path.isdir(full) and any(os.path.isfile(os.path.join(full, a)) for a in _OTHER_WEIGHTS[:2]):
            return True  # PEFT's several adapters, one folder each
    return False


def checkpoint_problems(path: str) -> list[str]:
    """What the checkpoint at `path` lacks to be resumed from; empty for a complete checkpoint."""
    if not os.path.isdir(path):
        return ["the folder (it does not exist)"]
    problems = []
    if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
        problems.append(f"{TRAINER_STATE} (written last: the save was interrupted)")
    if not _has_weights(path):
        problems.append("the model's weights (model.safetensors, pytorch_model.bin, adapters or sharded state)")
    return problems


def complete_checkpoints(output_dir: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """
    The checkpoints of `output_dir`, newest first: the complete ones, and the torn ones with what each lacks.
    """
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    found = [os.path.join(output_dir, name) for name in names if _CHECKPOINT.match(name)]
    complete, torn = [], []
    for path in sorted(filter(os.path.isdir, found), key=lambda path: (_step(path), path), reverse=True):
        problems = checkpoint_problems(path)
        if problems:
            torn.append((path, problems))
        else:
            complete.append(path)
    return complete, torn


def _describe(torn: list[tuple[str, list[str]]]) -> str:
    return "; ".join(f"{path} lacks {', '.join(problems)}" for path, problems in torn)


def _newest(output_dir: str, main: bool) -> str:
    complete, torn = complete_checkpoints(output_dir)
    if not complete:
        reason = f" Torn: {_describe(torn)}." if torn else ""
        # Stock's sentence first (code written against stock matches its text), then what hf_parallel knows.
        raise ValueError(
            f"No valid checkpoint found in output directory ({output_dir}): no complete checkpoint to resume from."
            f"{reason}"
        )
    newer = [(path, problems) for path, problems in torn if _step(path) > _step(complete[0])]
    staging = os.path.join(output_dir, STAGING_DIR)
    staged = sorted(os.path.join(staging, n) for n in os.listdir(staging)) if os.path.isdir(staging) else []
    if main and (newer or staged):
        skipped = [_describe(newer)] if newer else []
        skipped += [f"{path} (a save a kill interrupted)" for path in staged]
        logger.warning(
            f"resume_from_checkpoint=True: resuming from {complete[0]}, the newest complete checkpoint; passed over "
            f"what a crash left torn: {'; '.join(skipped)}."
        )
    return complete[0]


def _step(path: str) -> int:
    return int(_CHECKPOINT.match(os.path.basename(path)).group(1))


def resolve_resume(args, resume_from_checkpoint, num_processes: int):
    """
    The checkpoint a `train(resume_from_checkpoint=...)` call resumes from (a path, or None/False as given), after
    the checks above; raises `ValueError` for a torn checkpoint given by path.
    """
    if resume_from_checkpoint is True:
        resume_from_checkpoint = _newest(args.output_dir, args.process_index == 0)
    elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
        path = os.fspath(resume_from_checkpoint)
        problems = checkpoint_problems(path)
        if problems:
            complete, _ = complete_checkpoints(os.path.dirname(os.path.abspath(path)))
            hint = f" The newest complete checkpoint there is {complete[0]}." if complete else ""
            what = "it does not exist" if not os.path.isdir(path) else f"it lacks {', '.join(problems)}"
            # Stock's sentence first (code written against stock matches its text), then what hf_parallel knows.
            raise ValueError(
                f"Can't find a valid checkpoint at {path}: {what}.{hint} Pass a complete checkpoint, or "
                "resume_from_checkpoint=True for the newest complete one."
            )
    if isinstance(resume_from_checkpoint, (str, os.PathLike)) and args.process_index == 0:
        _warn_if_another_global_batch(os.fspath(resume_from_checkpoint), run_record(args, num_processes))
    return resume_from_checkpoint


def check_checkpoint_engine(checkpoint: str | None, deepspeed: bool) -> None:
    """
    Refuse, before anything is loaded, a checkpoint whose optimizer state the run's engine cannot read: DeepSpeed's
    partitions in a run without DeepSpeed (stock resumes the weights and silently starts the optimizer afresh), or a
    checkpoint without them under DeepSpeed (stock fails once the engine has started).
    """
    if checkpoint is None or not os.path.isdir(checkpoint):
        return
    folder = deepspeed_checkpoint_folder(checkpoint)
    plain_state = os.path.isfile(os.path.join(checkpoint, "optimizer.pt"))
    if folder is not None and not deepspeed and not plain_state:
        raise ValueError(
            f"{checkpoint} was written under DeepSpeed ZeRO: its optimizer state lies in DeepSpeed's partitions "
            f"({folder}), which a run without DeepSpeed cannot read, so it would resume without them. Resume it with "
            "a DeepSpeed config (on any number of processes), or start a new run from its weights."
        )
    if folder is None and deepspeed and (plain_state or checkpoint_weight_files(checkpoint)):
        # Stock's sentence first (code written against stock matches its text), then what hf_parallel knows.
        raise ValueError(
            f"Can't find a valid checkpoint at {checkpoint}: it was written without DeepSpeed (no global_step*/ "
            "folder named by a 'latest' file), and DeepSpeed resumes only its own partitioned state. Resume it "
            "without DeepSpeed, or start a new DeepSpeed run from its weights (from_pretrained)."
        )


def _warn_if_another_global_batch(checkpoint: str, now: dict) -> None:
    path = os.path.join(checkpoint, RUN_FILE)
    if not os.path.isfile(path):
        return  # written by stock or an older hf_parallel: its topology is not known
    with open(path) as file:
        then = json.load(file)
    if then.get("global_batch") == now["global_batch"]:
        return

    def topology(record: dict) -> str:
        return (
            f"{record['global_batch']} rows ({record['num_processes']} data-parallel process(es) x "
            f"{record['per_device_train_batch_size']} rows x {max(1, record.get('n_gpu', 1))} GPUs x gradient "
            f"accumulation {record['gradient_accumulation_steps']})"
        )

    logger.warning(
        f"Resuming {checkpoint}, written with a global batch of {topology(then)}, with a global batch of "
        f"{topology(now)}: every step from here averages over another number of rows and reads others, so the run "
        "no longer follows the uninterrupted one. To continue it exactly, keep processes x per_device_train_batch_size"
        f" x gradient_accumulation_steps at {then['global_batch']} (any split of it is exact)."
    )


def rank_seed(seed: int, process_index: int, world_size: int, global_step: int) -> int:
    """The seed of a rank that resumes without its own RNG state."""
    return seed + process_index + world_size * global_step


def seed_rank_without_state(args, checkpoint: str | None, global_step: int) -> bool:
    """
    Where the checkpoint holds no RNG file for this rank (`rng_state_<rank>.pth`, or `rng_state.pth` for one process),
    seed it with `rank_seed` and say so once: True. False where the file is there (stock loads it).
    """
    if checkpoint is None:
        return False
    own = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    if os.path.isfile(os.path.join(checkpoint, own)):
        return False
    seed = rank_seed(args.seed, args.process_index, args.world_size, global_step)
    set_seed(seed)
    logger.warning(
        f"{checkpoint} holds no random state for process {args.process_index} ({own}: it was written by another "
        f"number of processes, or without it), so this process is seeded with {seed} (seed + process index + world "
        "size x step): dropout and other random draws from here differ from the uninterrupted run's."
    )
    return True
