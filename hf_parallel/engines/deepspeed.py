"""
DeepSpeed, as hf_parallel meets it: checks before its engine starts, so that a run fails with a message that names
the cause and the fix rather than deep inside `deepspeed.initialize`.

The exact loss itself needs nothing of DeepSpeed's: ZeRO 1, 2 and 3 average the gradient over the data-parallel ranks
as DDP does, so the loss each rank backpropagates is its token-loss sum over the step's count times the number of
ranks (`hf_parallel.exact`), and DeepSpeed's gradient accumulation adds the micro-batches' gradients as torch does
(the Trainer tells it the loss is already scaled for accumulation).

`ExactLoop(engine=...)` drives an engine of the user's own `deepspeed.initialize`: its data-parallel group counts the
step, `engine.backward` (or a plain `loss.backward()`, which DeepSpeed scales through hooks on the forward's outputs)
divides by the engine's gradient accumulation steps, which the loss given undoes, and the loop marks each step's last
micro-batch as the engine's accumulation boundary.
"""

from __future__ import annotations

import inspect

from torch import nn

from .zero3 import gather_on_save

__all__ = [
    "before_engine",
    "check_loop_engine",
    "deepspeed_version",
    "sequence_shards",
]


def before_engine(model: nn.Module, zero_stage: int | None) -> None:
    """
    What the Trainer does before DeepSpeed's engine starts on `model` (its unwrapped model): refuse, naming the cause
    and the fix, a model the engine would crash on; under ZeRO-3, make the model's `save_pretrained` write full
    weights from the partitions (`hf_parallel.engines.zero3`).

    The crash: DeepSpeed releases whose engine broadcasts each parameter as bytes (`p.data.view(torch.uint8)` in
    `DeepSpeedEngine._broadcast_model`, 0.19.8 among them) fail on a 0-dimensional parameter (CLIP's `logit_scale`,
    CLAP's) with "self.dim() cannot be 0 to view Float as Byte", on GPUs and CPUs alike and under every ZeRO stage.
    """
    scalars = [name for name, parameter in model.named_parameters() if parameter.dim() == 0]
    if scalars:
        try:
            import deepspeed
            from deepspeed.runtime.engine import DeepSpeedEngine

            as_bytes = "view(torch.uint8)" in inspect.getsource(DeepSpeedEngine._broadcast_model)
        except (ImportError, AttributeError, OSError, TypeError):
            as_bytes = False
        if as_bytes:
            raise ValueError(
                f"DeepSpeed {deepspeed.__version__} cannot start on {type(model).__name__}: its engine broadcasts "
                f"every parameter as bytes when it starts and fails on 0-dimensional parameters ({', '.join(scalars)})"
                " with 'self.dim() cannot be 0 to view Float as Byte'. Train this model with DDP or FSDP2, or give "
                "those parameters one dimension (shape [1]) before training."
            )
    if zero_stage == 3:
        gather_on_save(model)


def check_loop_engine(engine) -> None:
    """Refuse, naming the fix, an engine `ExactLoop` cannot drive: not an engine, or one with sequence parallelism."""
    # The engine `deepspeed.initialize` returns, told by its class's name, without importing deepspeed.
    if not any(cls.__name__ == "DeepSpeedEngine" for cls in type(engine).__mro__):
        raise TypeError(
            f"ExactLoop(engine=...) takes the engine deepspeed.initialize returns, not {type(engine).__name__}; "
            "with an accelerate-prepared model pass the Accelerator instead (ExactLoop(accelerator))."
        )
    sequence = getattr(engine, "sequence_parallel_size", 1)
    if sequence > 1:
        raise ValueError(
            f"ExactLoop(engine=...): the engine runs sequence parallelism (sequence_parallel_size={sequence}), whose "
            "ranks share rows; ExactLoop counts rows per data-parallel rank. Train sequence parallelism through "
            "hf_parallel.Trainer."
        )
    if not engine.managed_gradient_accumulation():
        raise ValueError(
            "ExactLoop(engine=...) needs DeepSpeed's managed gradient accumulation (the default): with "
            "managed_gradient_accumulation=false the caller owns the boundary; set it back to true."
        )


def deepspeed_version() -> tuple[int, ...]:
    """The installed DeepSpeed's release, `(major, minor, patch)`."""
    import deepspeed

    # The digits of each part, the local version after `+` left out; a part without any digit counts as 0.
    parts = deepspeed.__version__.split("+")[0].split(".")[:3]
    return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in parts)


def sequence_shards(batches: list[dict], end, warn_once) -> None:
    """
    Under Ulysses (called only where the run's engine shards the sequence) each rank's micro-batch holds its shard of
    the sequence with `shift_labels` (already shifted over the whole row) and no `labels`: give it `labels` (the
    shard's targets), as transformers' own sequence-parallel loss does, so that the causal LM head counts and scores
    `shift_labels` as they are. Each micro-batch is a shard of another rank's rows, so the rows accelerate repeats to
    fill an epoch's last global batch (`end.remainder` real ones) are not told apart there: warned, trained as stock
    trains them.
    """
    for batch in batches:
        if "labels" not in batch and "shift_labels" in batch:
            batch["labels"] = batch["shift_labels"]
    if end is not None and end.remainder > 0:
        warn_once(
            "exact_loss: under sequence parallelism the rows accelerate repeats to fill the last global batch of an "
            f"epoch (only {end.remainder} of its rows are real) are trained, as stock trains them: each rank's "
            "micro-batch is a shard of another rank's rows, which hf_parallel does not tell apart. Use a training "
            "set whose size divides by per_device_train_batch_size x the number of processes, or "
            "dataloader_drop_last=True."
        )
