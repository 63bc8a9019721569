"""
Crash-safe checkpoints: a checkpoint appears under its name only when every process has written all of its files.

transformers writes `checkpoint-N` in place, file after file (weights, optimizer, scheduler, every rank's RNG state,
`trainer_state.json` last) and then deletes the checkpoints over `save_total_limit`. A run killed in between leaves a
`checkpoint-N` without its state, which `resume_from_checkpoint=True` picks (the highest number) and fails on; and
rotation may already have removed the one before. Here the stock save writes into `<output_dir>/.hf_parallel-staging/
checkpoint-N` instead; after every process has returned from it, the processes that save rename that folder to
`<output_dir>/checkpoint-N` (one `rename` on the same file system: the checkpoint is there whole or not at all), and
only then are older checkpoints rotated out. A kill at any moment leaves the last complete checkpoint in place, and
at most a staged folder that the next save of that step clears (`hf_parallel.saving.resume` names it when resuming).

With the checkpoint, `hf_parallel_run.json` records the topology that wrote it (processes, rows per device, gradient
accumulation, their product: the global batch), which a resume compares with its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging

from ..upstream import temporarily

__all__ = ["RUN_FILE", "STAGING_DIR", "TRAINER_STATE", "data_parallel_processes", "run_record", "staged_checkpoint"]

logger = logging.get_logger(__name__)

#: The folder (inside the run's output folder) where a checkpoint is written before it is complete.
STAGING_DIR = ".hf_parallel-staging"
#: What stock writes last into a checkpoint (transformers' `TRAINER_STATE_NAME`, named here without importing
#: `transformers.trainer`).
TRAINER_STATE = "trainer_state.json"
#: The topology that wrote a checkpoint, inside it.
RUN_FILE = "hf_parallel_run.json"


def data_parallel_processes(trainer) -> int:
    """The processes that read batches of their own: the ranks of a tensor-, context- or sequence-parallel group
    share one."""
    shared = 1
    for size in ("get_tp_size", "get_cp_size", "get_sp_size"):
        shared *= getattr(trainer, size, lambda: 1)() or 1
    return max(1, trainer.accelerator.num_processes // shared)


def run_record(args, num_processes: int) -> dict:
    """The topology of a run, as `RUN_FILE` stores it: its global batch is data-parallel processes x rows x
    accumulation."""
    rows = args.per_device_train_batch_size * max(1, args.n_gpu)  # nn.DataParallel splits one process's batch
    return {
        "num_processes": num_processes,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "n_gpu": args.n_gpu,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "global_batch": num_processes * rows * args.gradient_accumulation_steps,
    }


def _write_json(path: str, record: dict) -> None:
    """`record` at `path`, whole or not at all: written beside it, flushed to disk, renamed over it."""
    partial = f"{path}.partial"
    with open(partial, "w") as file:
        json.dump(record, file, indent=2, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _clear(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)


def _commit(staged: str, final: str) -> None:
    """Rename `staged` to `final`; a complete `final` of an earlier run (a resume from before it) is replaced."""
    aside = f"{staged}.replaced"
    if os.path.isdir(final):
        # Set aside first: a rename does not replace a folder that holds files.
        _clear(aside)
        os.rename(final, aside)
    try:
        os.rename(staged, final)
    except FileNotFoundError:
        # save_on_each_node on a shared folder: another node's saving process renamed it first.
        if not os.path.isdir(final):
            raise
    _clear(aside)


def staged_checkpoint(trainer, model, trial, save: Callable[[object, object], None]) -> None:
    """
    Run the stock checkpoint save `save(model, trial)` of `trainer` into the staging folder, then commit it and
    rotate. Every process calls it (each writes its own files: its RNG state, its shards).
    """
    args, accelerator = trainer.args, trainer.accelerator
    run_dir = trainer._get_output_dir(trial=trial)
    staging = os.path.join(run_dir, STAGING_DIR)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    staged, final = os.path.join(staging, name), os.path.join(run_dir, name)
    if args.should_save:
        # A save that a kill interrupted: its files must not mix with these.
        for leftover in os.listdir(staging) if os.path.isdir(staging) else ():
            _clear(os.path.join(staging, leftover))
    node_mark = _mark_node(run_dir, args)
    accelerator.wait_for_everyone()
    _warn_if_shared(run_dir, args, node_mark)
    # Stock writes into staging/checkpoint-N (its run folder, `_get_output_dir`, is the staging folder within); it
    # rotates nothing there (the folder holds this checkpoint only), and pushes to the Hub only once the checkpoint is
    # complete, below.
    with temporarily(trainer, "_get_output_dir", lambda trial=None: staging), temporarily(args, "push_to_hub", False):
        save(model, trial)
    accelerator.wait_for_everyone()  # every process's files are written
    if args.should_save:
        _point_best_checkpoint(trainer, run_dir, staged)
        _write_json(os.path.join(staged, RUN_FILE), run_record(args, data_parallel_processes(trainer)))
        _commit(staged, final)
        with contextlib.suppress(OSError):
            os.rmdir(staging)  # empty once committed (another node's saving process may be using it still)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,
        )
    accelerator.wait_for_everyone()  # the checkpoint is in place for every process
    if node_mark is not None:
        os.remove(node_mark)
    if args.push_to_hub:
        trainer._push_from_checkpoint(final)


_NODES_DIR = ".hf_parallel-nodes"
_warned_shared: set[str] = set()


def _mark_node(run_dir: str, args) -> str | None:
    """With `save_on_each_node`, each node's saving process leaves a mark in the run folder for the others to see."""
    if not (args.save_on_each_node and args.should_save and args.world_size > 1):
        return None
    os.makedirs(os.path.join(run_dir, _NODES_DIR), exist_ok=True)
    mark = os.path.join(run_dir, _NODES_DIR, f"process-{args.process_index}")
    open(mark, "w").close()
    return mark


def _warn_if_shared(run_dir: str, args, node_mark: str | None) -> None:
    """Where several nodes' marks are in one folder, that folder is shared: each node writes the same files."""
    if node_mark is None or run_dir in _warned_shared:
        return
    marks = os.listdir(os.path.dirname(node_mark))
    if len(marks) > 1 and args.process_index == 0:
        _warned_shared.add(run_dir)
        logger.warning(
            f"save_on_each_node=True, but {run_dir} is shared by {len(marks)} nodes: each node's main process writes "
            "every file of each checkpoint into the same folder. Set save_on_each_node=False on a shared file system "
            "(one process writes each file); keep it only for folders local to each node."
        )


def _point_best_checkpoint(trainer, run_dir: str, staged: str) -> None:
    """
    The best checkpoint as stock would have named it had it saved in place (it looked in the staging folder), also in
    the staged `trainer_state.json`, which stock wrote with that name.
    """
    state = trainer.state
    best = state.best_global_step
    if not best:
        return
    path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
    if state.best_model_checkpoint == path or not (best == state.global_step or os.path.isdir(path)):
        return  # what stock wrote is right already
    state.best_model_checkpoint = path
    state_file = os.path.join(staged, TRAINER_STATE)
    if os.path.isfile(state_file):
        state.save_to_json(state_file)
