"""
The upstream contract: every hook and attribute of `transformers.Trainer` and accelerate that hf_parallel relies on,
in one table, so that an upgrade that changes one fails a test (tests/test_upstream.py) instead of training wrongly.

Public hooks are overridden with their exact signatures; private ones (`_`-prefixed) only where no public hook
exists. Attributes are read or set around a call to the stock method (`temporarily`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["HOOKS", "INSTANCE_ATTRIBUTES", "SHARD_ATTRIBUTES", "TRAINING_ATTRIBUTES", "Hook", "temporarily"]


class Hook(NamedTuple):
    """A method of a transformers Trainer class (`owner`) that hf_parallel overrides or calls, with its parameters."""

    name: str
    parameters: tuple[str, ...]
    why: str
    owner: str = "Trainer"


HOOKS = (
    Hook("compute_loss", ("self", "model", "inputs", "return_outputs", "num_items_in_batch"), "the exact loss"),
    Hook("training_step", ("self", "model", "inputs", "num_items_in_batch"), "no second division by GA steps"),
    Hook("get_batch_samples", ("self", "epoch_iterator", "num_batches", "device"), "count the step before it runs"),
    Hook(
        "evaluation_loop",
        ("self", "dataloader", "description", "prediction_loss_only", "ignore_keys", "metric_key_prefix"),
        "exact eval_loss",
    ),
    Hook("get_train_dataloader", ("self",), "count the samples of an iterable set each rank reads itself"),
    Hook("train", ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"), "DDP after evaluate()"),
    Hook("_finalize_training", ("self", "trial", "num_train_samples", "start_time"), "exact train_loss under DDP"),
    Hook("_get_num_items_in_batch", ("self", "batch_samples", "device"), "the stock count, on fallback"),
    Hook("_wrap_model", ("self", "model", "training", "dataloader"), "BalancedDataParallel"),
    Hook("_save", ("self", "output_dir", "state_dict"), "no wrapper prefixes in checkpoints"),
    Hook("_load_from_checkpoint", ("self", "resume_from_checkpoint", "model"), "resume across wrappers"),
    Hook("_load_best_model", ("self",), "best model across wrappers"),
    Hook(
        "prediction_step",
        ("self", "model", "inputs", "prediction_loss_only", "ignore_keys", "gen_kwargs"),
        "exact eval_loss with predict_with_generate",
        owner="Seq2SeqTrainer",
    ),
)

# Attributes of a constructed Trainer (or of what it holds) that hf_parallel reads or sets: (owner, name, why).
INSTANCE_ATTRIBUTES = (
    ("trainer", "loss_is_scaled_for_ga", "set while the exact loss is already divided by the step's count"),
    ("trainer", "_loss_shifts_labels", "the count for a compute_loss_func is of shifted labels"),
    ("trainer", "compute_loss_func", "a user loss keeps its place, fed the exact count"),
    ("trainer", "model_wrapped", "DDP wrapper: released at exit, repaired after evaluate()"),
    ("trainer", "label_names", "the label keys of the exact loss"),
    ("trainer", "model_accepts_loss_kwargs", "stock passes num_items_in_batch to such models"),
    ("accelerator", "_models", "accelerate's prepared models: the DDP wrapper lives there too"),
    ("accelerator", "gradient_state", "the active dataloader: at its end, which samples of its last batch are real"),
    ("accelerator", "mixed_precision", "the autocast dtype inside DataParallel replicas (no prepare for DP)"),
)
# Attributes of accelerate's `IterableDatasetShard` (an iterable dataset each rank reads itself) that
# `hf_parallel.exact.streams` reads, or sets (`dataset`), to count its samples.
SHARD_ATTRIBUTES = ("dataset", "batch_size", "num_processes", "split_batches", "drop_last")
# Set only during training, read by `_finalize_training`.
TRAINING_ATTRIBUTES = (("trainer", "_tr_loss", "this rank's loss not logged yet"),)


@contextlib.contextmanager
def temporarily(obj: Any, name: str, value: Any) -> Iterator[None]:
    """
    Set `obj.name = value` for the block, then restore it, whatever happens: the way to call a stock method with
    one of its inputs changed when it offers no parameter for it.

    ```python
    from hf_parallel.upstream import temporarily

    with temporarily(trainer, "model", inner):
        transformers.Trainer._save(trainer, output_dir)  # saves the inner model
    ```
    """
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)
