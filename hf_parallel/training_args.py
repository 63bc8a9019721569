"""`TrainingArguments` with the fields hf_parallel adds to `transformers.TrainingArguments`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import transformers

from .chunking import check_split_options


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """
    `transformers.TrainingArguments` plus the settings of hf_parallel. Every stock field keeps its meaning.

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

    ```python
    from hf_parallel import TrainingArguments

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=16, gpu0_bsz=8)
    ```
    """

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

    def __post_init__(self):
        super().__post_init__()
        self._validate_hf_parallel_fields()

    @classmethod
    def from_stock(cls, args: transformers.TrainingArguments) -> TrainingArguments:
        """
        Upgrade a stock `transformers.TrainingArguments` to this class, every hf_parallel field at its default.

        The stock object's state is copied as it is (not re-parsed), so whatever its `__post_init__` derived stays.
        """
        if not isinstance(args, transformers.TrainingArguments):
            raise TypeError(f"args must be a TrainingArguments, got {type(args).__name__}.")
        upgraded = cls.__new__(cls)
        upgraded.__dict__.update(args.__dict__)
        for f in fields(cls):
            if f.name not in upgraded.__dict__:
                setattr(upgraded, f.name, f.default)
        upgraded._validate_hf_parallel_fields()
        return upgraded

    def _validate_hf_parallel_fields(self) -> None:
        if not isinstance(self.exact_loss, bool):
            raise ValueError(f"exact_loss must be True or False, got {self.exact_loss!r}.")
        check_split_options(self.gpu0_bsz, self.gpu0_weight)
        if self.gpu0_bsz is not None and self.gpu0_bsz > self.per_device_train_batch_size:
            # Under DataParallel the per-step batch is per_device_train_batch_size x n_gpu; GPU 0's even share of it
            # is per_device_train_batch_size, and gpu0_bsz is meant to be at most that.
            raise ValueError(
                f"gpu0_bsz={self.gpu0_bsz} is above GPU 0's even share of the batch "
                f"(per_device_train_batch_size={self.per_device_train_batch_size}); GPU 0 would get more rows "
                "than the other GPUs. Lower gpu0_bsz or raise per_device_train_batch_size."
            )
