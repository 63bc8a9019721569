"""`Trainer`: a drop-in `transformers.Trainer` for several GPUs. Glue only; the logic lives in the sibling modules."""

from __future__ import annotations

import transformers
from transformers.utils import logging

from .training_args import TrainingArguments

logger = logging.get_logger(__name__)


class Trainer(transformers.Trainer):
    """
    `transformers.Trainer` with exact losses under DataParallel, DDP and gradient accumulation, balanced
    DataParallel, and checkpoints that never carry wrapper prefixes. Takes the same arguments as the stock class.

    ```python
    from hf_parallel import Trainer, TrainingArguments

    trainer = Trainer(model=model, args=TrainingArguments(output_dir="out"), train_dataset=train_ds)
    trainer.train()
    ```
    """

    def __init__(self, model=None, args=None, *positional, **kwargs):
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        elif not isinstance(args, TrainingArguments):
            args = TrainingArguments.from_stock(args)
        super().__init__(model, args, *positional, **kwargs)
