"""The fields hf_parallel adds to `transformers.TrainingArguments` (and to its subclasses): `HfParallelArguments`,
mixed into `TrainingArguments` and `Seq2SeqTrainingArguments`; `with_hf_parallel_fields` for any other arguments
class (TRL's configs, a user's own)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import transformers

from .data_parallel.chunking import check_split_options
from .launch.guards import check_rank_has_a_gpu


@dataclass
class HfParallelArguments:
    """
    The settings of hf_parallel, as a dataclass mixin: put it before a `transformers.TrainingArguments` subclass in
    the bases (as `TrainingArguments` and `Seq2SeqTrainingArguments` do).

    Args:
        exact_loss (`bool`, *optional*, defaults to `True`):
            Make the back-propagated loss, the logged `loss` and `eval_loss` exact: equal to what one device
            computes on the whole optimizer step (all micro-batches of all devices), under DataParallel, DDP and
            gradient accumulation. `False` gives the stock behaviour of `transformers.Trainer`.
        gpu0_bsz (`int`, *optional*):
            Under `nn.DataParallel` (several GPUs, no launcher), the number of rows of each batch that GPU 0
            gets; the rest is spread evenly over the other GPUs. GPU 0 never gets more than its even share.
        gpu0_weight (`float`, *optional*):
            Like `gpu0_bsz`, but relative: GPU 0 gets `gpu0_weight` times the share of each other GPU
            (0.5 = half a share, 1 = an even split). Set at most one of `gpu0_bsz` and `gpu0_weight`.
        contrastive_negatives (`str`, *optional*, defaults to `"step"`):
            The rows a contrastive loss (CLIP, SigLIP, ... with `return_loss=True`) scores each row against under
            gradient accumulation: `"step"`, every row of the optimizer step, as one device would (a cached
            two-pass: one more forward without gradient per micro-batch); `"micro_batch"`, the rows of each
            micro-batch over every device, as stock (warned). Without accumulation both are the whole batch.
        router_balance (`str`, *optional*, defaults to `"step"`):
            The load-balancing loss of a mixture-of-experts model (`output_router_logits=True`) under gradient
            accumulation: `"step"`, that of one forward over the whole optimizer step (exact; the expert fractions
            of every micro-batch, from one more forward without gradient per micro-batch); `"micro_batch"`, each
            micro-batch's own, averaged over the step (warned). Without accumulation both are the whole batch.
    """

    #: The transformers class this one extends; an object of exactly that class is upgraded by `from_stock`.
    stock_class: ClassVar[type] = transformers.TrainingArguments

    # Parameters that control the loss
    exact_loss: bool = field(
        default=True,
        metadata={
            "help": "Make the logged loss, eval_loss and the applied gradient exact: equal to one device computing "
            "the whole optimizer step, under DataParallel, DDP and gradient accumulation. False gives the stock "
            "transformers behaviour."
        },
    )

    # Parameters that control the DataParallel split (ignored under DDP and on one device)
    gpu0_bsz: int | None = field(
        default=None,
        metadata={
            "help": "Under DataParallel (several GPUs, no launcher): rows of each batch given to GPU 0, which also "
            "gathers outputs and computes the loss. The rest is spread evenly over the other GPUs. "
            "GPU 0 never gets more than its even share."
        },
    )
    gpu0_weight: float | None = field(
        default=None,
        metadata={
            "help": "Under DataParallel: GPU 0's share relative to each other GPU's, in [0, 1] (0.5 = half a share). "
            "Set at most one of gpu0_bsz and gpu0_weight."
        },
    )

    contrastive_negatives: str = field(
        default="step",
        metadata={
            "help": "Under gradient accumulation, the negatives of a contrastive loss (CLIP, SigLIP, ...): 'step' "
            "(every row of the optimizer step, exact; one more forward without gradient per micro-batch) or "
            "'micro_batch' (each micro-batch's rows, as stock)."
        },
    )

    router_balance: str = field(
        default="step",
        metadata={
            "help": "Under gradient accumulation, a MoE model's load-balancing loss: 'step' (over the whole optimizer "
            "step, exact; one more forward without gradient per micro-batch) or 'micro_batch' (each micro-batch's, "
            "averaged)."
        },
    )

    def __post_init__(self):
        # Before transformers sets up the devices, which fails with "invalid device ordinal" on a rank without a GPU.
        check_rank_has_a_gpu(self)
        super().__post_init__()
        validate_hf_parallel_fields(self)

    @classmethod
    def from_stock(cls, args: transformers.TrainingArguments) -> HfParallelArguments:
        """
        Upgrade a stock arguments object (of `stock_class`) to this class, every hf_parallel field at its default.

        The stock object's state is copied as it is (not re-parsed), so whatever its `__post_init__` derived stays.
        """
        if not isinstance(args, transformers.TrainingArguments):
            raise TypeError(f"args must be a TrainingArguments, got {type(args).__name__}.")
        upgraded = cls.__new__(cls)
        upgraded.__dict__.update(args.__dict__)
        for f in fields(cls):
            upgraded.__dict__.setdefault(f.name, f.default)
        validate_hf_parallel_fields(upgraded)
        return upgraded


@dataclass
class TrainingArguments(HfParallelArguments, transformers.TrainingArguments):
    """
    `transformers.TrainingArguments` plus the settings of hf_parallel (see `HfParallelArguments`). Every stock field
    keeps its meaning.

    ```python
    from hf_parallel import TrainingArguments

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=16, gpu0_bsz=8)
    ```
    """


@dataclass
class Seq2SeqTrainingArguments(HfParallelArguments, transformers.Seq2SeqTrainingArguments):
    """
    `transformers.Seq2SeqTrainingArguments` (`predict_with_generate`, `generation_*`) plus the settings of
    hf_parallel (see `HfParallelArguments`).

    ```python
    from hf_parallel import Seq2SeqTrainingArguments

    args = Seq2SeqTrainingArguments(output_dir="out", predict_with_generate=True)
    ```
    """

    stock_class: ClassVar[type] = transformers.Seq2SeqTrainingArguments


def with_hf_parallel_fields(args: Any, args_class: type[HfParallelArguments] | None, like: Any = None) -> Any:
    """
    The arguments a Trainer with hf_parallel runs with: ours as they are; an object of exactly
    `args_class.stock_class` upgraded to `args_class`; any other arguments class (a TRL config, a user's own
    subclass) kept as it is, with the hf_parallel settings it lacks set on it, from `like` (the arguments the user
    passed, when a Trainer rebuilt them) or at their defaults. Such a class is never converted: its own fields,
    `to_dict()` and whatever rebuilds it from `to_dict()` stay its own.
    """
    if args is None or isinstance(args, HfParallelArguments):
        return args
    if args_class is not None and type(args) is args_class.stock_class:
        return args_class.from_stock(args)
    if not isinstance(args, transformers.TrainingArguments):
        raise TypeError(f"args must be a TrainingArguments, got {type(args).__name__}.")
    for f in fields(HfParallelArguments):
        if not hasattr(args, f.name):
            setattr(args, f.name, getattr(like, f.name, f.default))
    validate_hf_parallel_fields(args)
    return args


def validate_hf_parallel_fields(args) -> None:
    """Refuse hf_parallel settings out of range on `args` (any arguments class that carries them), naming the value."""
    if not isinstance(args.exact_loss, bool):
        raise ValueError(f"exact_loss must be True or False, got {args.exact_loss!r}.")
    check_split_options(args.gpu0_bsz, args.gpu0_weight)
    for name in ("contrastive_negatives", "router_balance"):
        if getattr(args, name) not in ("step", "micro_batch"):
            raise ValueError(f"{name} must be 'step' or 'micro_batch', got {getattr(args, name)!r}.")
    if args.gpu0_bsz is not None and args.gpu0_bsz > args.per_device_train_batch_size:
        # Under DataParallel the per-step batch is per_device_train_batch_size x n_gpu; GPU 0's even share of it
        # is per_device_train_batch_size, and gpu0_bsz is meant to be at most that.
        raise ValueError(
            f"gpu0_bsz={args.gpu0_bsz} is above GPU 0's even share of the batch "
            f"(per_device_train_batch_size={args.per_device_train_batch_size}); GPU 0 would get more rows "
            "than the other GPUs. Lower gpu0_bsz or raise per_device_train_batch_size."
        )
