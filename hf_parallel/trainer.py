"""`Trainer`, `Seq2SeqTrainer` and `TrainerMixin` (hf_parallel for any Trainer subclass): their overrides only, each
"not ours: super()" or a call into the subpackage it serves (`hf_parallel.exact`, `data_parallel`, `saving`,
`launch`, ...). The overrides of the exact loss are a base of their own (`hf_parallel.loss_overrides`), as those of
checkpoints are (`hf_parallel.saving.overrides`)."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import transformers
from torch import nn
from transformers.training_args import ParallelMode
from transformers.utils import logging

from .callbacks import Gpu0BszAdvisorCallback
from .data_parallel import balanced_wrapper, with_exact_replicas
from .engines.deepspeed import before_engine
from .engines.reshard import load_on_any_world_size
from .launch.guards import (
    batch_statistics_split,
    check_launch,
    check_not_empty,
    check_pipeline,
    check_sharding,
)
from .launch.prepared import unmark_evaluation_prepare
from .launch.teardown import track_trainer
from .loss_overrides import ExactLossOverrides
from .saving.overrides import CheckpointOverrides
from .saving.resume import check_checkpoint_engine, resolve_resume
from .saving.sharded import is_sharded_at_load
from .saving.staging import data_parallel_processes
from .saving.unwrap import unwrap_model, unwrap_user_model
from .training_args import Seq2SeqTrainingArguments, TrainingArguments, with_hf_parallel_fields
from .upstream import temporarily

logger = logging.get_logger(__name__)


class TrainerMixin(ExactLossOverrides, CheckpointOverrides):
    """
    hf_parallel for any `transformers.Trainer` subclass: exact losses under DataParallel, DDP and gradient
    accumulation, balanced DataParallel, clean checkpoints, launch guards. Put it first in the bases:

    ```python
    from trl import SFTTrainer
    from hf_parallel import TrainerMixin

    class ParallelSFTTrainer(TrainerMixin, SFTTrainer):
        pass
    ```

    The subclass's arguments class is kept (a TRL config stays a TRL config, with hf_parallel's settings set on it
    at their defaults); a subclass that computes its own loss (any class in the MRO that overrides `compute_loss`)
    keeps it, with one warning that says so.
    """

    #: The arguments class this Trainer builds when given none, and upgrades an object of its stock base to; None
    #: for a subclass that builds its own arguments (then they are kept, with hf_parallel's settings added).
    args_class: type | None = None

    def __init__(self, *positional, **kwargs):
        # Bound to the subclass's own signature: TRL's DPOTrainer and KTOTrainer take `ref_model` second and
        # GRPOTrainer and RLOOTrainer `reward_funcs`, so `args` is not always the second parameter.
        call = _bind_trainer_init(type(self), positional, kwargs)
        model, args = call.arguments.get("model"), call.arguments.get("args")
        given = args
        if args is None and self.args_class is not None:
            args = self.args_class(output_dir="trainer_output")
        args = with_hf_parallel_fields(args, self.args_class)
        # A model the user already wrapped in DataParallel/DDP: stock then trains on empty batches and writes
        # `module.`-prefixed checkpoints. Take the model out (a BalancedDataParallel's split moves into the args).
        if args is not None:
            model, args = unwrap_user_model(model, args)
            check_pipeline(model)  # stock stops inside its first step's preparation
            # Launch guards, before super().__init__ moves the model, so that a mis-launch stops here. Reading
            # args.world_size sets up the devices and the process group, which is what the guards inspect.
            check_launch(args)
        # A model sharded at load time: stock refuses to checkpoint its optimizer state; hf_parallel writes it
        # (saving.sharded), so stock's check is told the run saves the model only while it is made.
        keeps_state = args is not None and is_sharded_at_load(model) and not args.save_only_model
        call.arguments.update(model=model, args=args)
        with temporarily(args, "save_only_model", True) if keeps_state else contextlib.nullcontext():
            super().__init__(*call.args[1:], **call.kwargs)  # args[0] is the placeholder bound to `self`
        if self.args is not args:  # the subclass built or rebuilt its own arguments (TRL rebuilds its config)
            self.args = args = with_hf_parallel_fields(self.args, None, like=given)
            check_launch(args)
        check_sharding(self.args, self.accelerator)  # fsdp / deepspeed asked for, DDP or one process running
        if args.world_size > 1:
            # Release the DDP wrapper before interpreter exit, where its destruction can abort the process.
            track_trainer(self)
        self._set_up_exact_loss()

    # ---- Balanced DataParallel (gpu0_bsz / gpu0_weight; the split lives in hf_parallel.data_parallel) ----
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        wrapped = balanced_wrapper(model, self.args, self.accelerator, training, self.model_accepts_loss_kwargs)
        if wrapped is not None:
            return wrapped
        wrapped = super()._wrap_model(model, training, dataloader)
        # Stock's nn.DataParallel gives a parameter no replica used a zero gradient, where one device gives None.
        return with_exact_replicas(wrapped) if self.args.exact_loss else wrapped

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval: list[str] | None = None,
    ):
        check_not_empty(self.train_dataset, "train_dataset")
        self._check_engine()
        # Picked again at the first step: the model may be another (model_init).
        self._engine = self._run_context = self._counted_step = self._settled_head = None
        # The newest complete checkpoint (torn ones passed over, warned), a torn one given by path refused, and another
        # global batch than the checkpoint's warned: before anything is loaded.
        resume_from_checkpoint = resolve_resume(self.args, resume_from_checkpoint, data_parallel_processes(self))
        check_checkpoint_engine(resume_from_checkpoint, self.is_deepspeed_enabled)
        if self.args.parallel_mode == ParallelMode.DISTRIBUTED and unmark_evaluation_prepare(
            self.model, self.model_wrapped, self.accelerator
        ):
            self.model_wrapped = self.model  # train() wraps it in DDP again
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, Gpu0BszAdvisorCallback) and callback.exact is None:
                callback.exact = self.exact  # it measures once the check of the loss head has settled
        if isinstance(self.model, nn.Module):
            split = batch_statistics_split(self.model, self.args)
            if split is not None:
                self.exact.warn_once(f"exact_loss: {split}")
        # A DeepSpeed checkpoint of another data-parallel world size: merged and partitioned again, where DeepSpeed's
        # own loader (which stock calls) refuses it.
        loader = functools.partial(load_on_any_world_size, load=transformers.trainer.deepspeed_load_checkpoint)
        try:
            with temporarily(transformers.trainer, "deepspeed_load_checkpoint", loader):
                return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        finally:
            self._counted_step = None  # its micro-batches are not kept past the run

    def _check_engine(self) -> None:
        """Before DeepSpeed's engine starts: refuse a model it would crash on; under ZeRO-3, saves that gather."""
        if self.is_deepspeed_enabled:
            before_engine(unwrap_model(self.model), self.accelerator.state.deepspeed_plugin.zero_stage)


class Trainer(TrainerMixin, transformers.Trainer):
    """
    `transformers.Trainer` with exact losses under DataParallel, DDP and gradient accumulation, balanced
    DataParallel, and checkpoints that never carry wrapper prefixes. Takes the same arguments as the stock class;
    a stock `transformers.TrainingArguments` is upgraded to `hf_parallel.TrainingArguments`.

    ```python
    from hf_parallel import Trainer, TrainingArguments

    trainer = Trainer(model=model, args=TrainingArguments(output_dir="out"), train_dataset=train_ds)
    trainer.train()
    ```
    """

    args_class = TrainingArguments


class Seq2SeqTrainer(TrainerMixin, transformers.Seq2SeqTrainer):
    """
    `transformers.Seq2SeqTrainer` with hf_parallel: generation as stock, and `eval_loss` exact with
    `predict_with_generate=True` too (one teacher-forced forward per batch besides the generation). A stock
    `transformers.Seq2SeqTrainingArguments` is upgraded to `hf_parallel.Seq2SeqTrainingArguments`.

    ```python
    from hf_parallel import Seq2SeqTrainer, Seq2SeqTrainingArguments

    args = Seq2SeqTrainingArguments(output_dir="out", predict_with_generate=True)
    Seq2SeqTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds).evaluate()
    ```
    """

    args_class = Seq2SeqTrainingArguments

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        output = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        if self.args.predict_with_generate and not prediction_loss_only:
            # Stock computed the loss itself next to the generation: add this batch's exact sums and counts to the
            # evaluation totals (what its returned loss would have given is replaced by them at the end).
            inputs = self._prepare_inputs(inputs)
            head = self._exact_head(inputs)
            if head is not None and head.has_labels(inputs):
                with torch.no_grad(), self.compute_loss_context_manager():
                    self.compute_loss(model, inputs)
        return output


def _bind_trainer_init(cls: type, positional: tuple, kwargs: dict) -> inspect.BoundArguments:
    """
    A Trainer call bound to the first `__init__` after `TrainerMixin` in `cls`'s MRO that names both `model` and
    `args` (a pass-through `__init__(*args, **kwargs)` between them is skipped), so that any subclass is built with
    its own parameter order. Arguments its signature does not take are left for that `__init__` to refuse.
    """
    mro = cls.__mro__
    for base in mro[mro.index(TrainerMixin) + 1 :]:
        init = vars(base).get("__init__")
        if init is None:
            continue
        signature = inspect.signature(init)
        if {"model", "args"} <= signature.parameters.keys():
            try:
                return signature.bind_partial(None, *positional, **kwargs)
            except TypeError as error:
                raise TypeError(f"{cls.__name__}(...): {error}") from None
    raise TypeError(f"{cls.__name__}: no base after TrainerMixin takes `model` and `args`; put a Trainer class there.")
