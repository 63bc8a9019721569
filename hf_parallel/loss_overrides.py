"""
The Trainer's overrides of the exact loss (`ExactLossOverrides`, a base of `TrainerMixin`): each a call into the one
step of `hf_parallel.exact.step`. `get_batch_samples` counts a step (`count_step`) and hands stock the step's count as
`num_items_in_batch`; `training_step` and `compute_loss` compute each micro-batch's loss (`micro_batch_loss`);
`evaluation_loop` gives `eval_loss` over the whole set. docs/contributing.md traces it.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch
import transformers
from accelerate.utils import DistributedType
from torch import nn
from transformers.utils import logging

from .data_parallel.replicas import is_data_parallel, replica_autocast, stock_replica_precision
from .engines.deepspeed import deepspeed_version, sequence_shards
from .exact import (
    Engine,
    ExactLoss,
    LossHead,
    Route,
    RunContext,
    StepCounts,
    calibrate_head,
    count_samples,
    count_step,
    micro_batch_loss,
    pick_engine,
    pull_batches,
    ragged_gathers,
    real_batches,
    trainer_loss_head,
)
from .fallback import FALLBACK_NOTE, stock_compute_loss, stock_training_step
from .launch.guards import check_not_empty, evaluation_dataset_name
from .upstream import temporarily

__all__ = ["ExactLossOverrides"]

logger = logging.get_logger(__name__)

#: `ExactLossOverrides._own_loss` before it is looked for.
_UNKNOWN = object()


class ExactLossOverrides:
    """
    The Trainer's hooks of the exact loss (`hf_parallel.exact`), a base of `TrainerMixin`: `get_batch_samples` counts
    each step, `training_step` and `compute_loss` compute each micro-batch's share of it, `evaluation_loop` gives
    `eval_loss` over the whole set. `self.exact` (an `ExactLoss`) and the run's state are made once the Trainer is
    built (`_set_up_exact_loss`, called by `TrainerMixin.__init__`).
    """

    #: What every evaluation batch's loss of a Trainer subclass takes of the whole set (`TrainerLossHooks`: KTO's KL
    #: reference point, DPO's pairs and chosen tokens), while an evaluation runs.
    _evaluation_shared: torch.Tensor | None = None

    def _set_up_exact_loss(self) -> None:
        """The run's exact-loss state, once the Trainer is built (its accelerator, its arguments)."""
        distributed = self.accelerator.num_processes > 1 and self.accelerator.distributed_type != DistributedType.NO
        self.exact = ExactLoss(
            enabled=self.args.exact_loss,
            label_names=self.label_names,
            label_smoothing=self.args.label_smoothing_factor,
            num_processes=self.accelerator.num_processes if distributed else 1,
            reduce_sum=lambda counts: self.accelerator.reduce(counts, reduction="sum"),
            unwrap=self.accelerator.unwrap_model,
            contrastive_negatives=self.args.contrastive_negatives,
            router_balance=self.args.router_balance,
            fallback=FALLBACK_NOTE,
        )
        #: The run's engine (`hf_parallel.exact.engine`) and what its micro-batches share (`RunContext`), picked at the
        #: first step of `train()`; the step being trained (`hf_parallel.exact.step.count_step`), whose count stock
        #: code gets as `num_items_in_batch`.
        self._engine: Engine | None = None
        self._run_context: RunContext | None = None
        self._counted_step: StepCounts | None = None
        #: The run's head once no check can change it (then no step asks the head cache again).
        self._settled_head: LossHead | None = None
        #: The head of a Trainer subclass's own loss, why it has none, or None (`_trainer_loss_head`), once found.
        self._own_loss: LossHead | str | None = _UNKNOWN
        if self.args.exact_loss and not self.args.average_tokens_across_devices:
            logger.warning(
                "average_tokens_across_devices=False has no effect with exact_loss=True: the exact loss always "
                "divides by the item count of the whole step, over every device. Set exact_loss=False for the stock "
                "behaviour."
            )

    def _exact_head(self, batch: dict | None = None) -> LossHead | None:
        """The loss head to compute exactly, or None for the stock path (warned once, naming why)."""
        own = self._trainer_loss_head()
        if isinstance(own, LossHead):
            return own if self.exact.enabled else None
        return self.exact.head(
            self.model,
            batch,
            blocked=self._exact_loss_blocked,  # asked only when the model's head is not cached yet
            loss_func=self.compute_loss_func,
            loss_func_shifts=self._loss_shifts_labels,
        )

    def _loss_owner(self) -> type | None:
        """The class whose `compute_loss` computes this Trainer's loss, where it is not transformers' nor ours."""
        return next(
            (cls for cls in type(self).__mro__ if "compute_loss" in vars(cls) and cls not in _OUR_LOSS_CLASSES), None
        )

    def _trainer_loss_head(self) -> LossHead | str | None:
        """
        The head of a Trainer subclass's own loss (TRL's trainers:
        `hf_parallel.exact.heads.trainers`), why a known subclass's loss has none, or None; found once.
        """
        if self._own_loss is _UNKNOWN:
            owner = self._loss_owner()
            ranks = self.accelerator.num_processes // max(self.get_tp_size(), 1)
            own = trainer_loss_head(owner, self.args, ranks, self, self.exact.warn_once) if owner is not None else None
            shared = [name for name, size in self._batch_sharing_sizes().items() if size > 1]
            if isinstance(own, LossHead) and shared:
                # Ranks that share a batch: how the subclass's loss then divides is not the one step's to know.
                own = f"its loss under {shared} parallelism (ranks sharing batches) is not made exact."
            if getattr(own, "logged", None) is not None:
                self.log = self._log_step_metrics
            self._own_loss = own
        return self._own_loss

    def _exact_loss_blocked(self) -> str | None:
        """Why this Trainer cannot use the exact loss at all, or None."""
        owner = self._loss_owner()
        if owner is not None:
            reason = self._trainer_loss_head()
            why = f": {reason}" if isinstance(reason, str) else "."
            return f"{owner.__name__} overrides compute_loss, which then owns the normalisation{why}"
        sizes = self._batch_sharing_sizes()
        if sizes["sequence"] > 1 and getattr(self.accelerator.parallelism_config, "sp_backend", None) == "deepspeed":
            sizes.pop("sequence")  # DeepSpeed's Ulysses: each rank holds its own shifted labels (its engine's factor)
        if not self.is_deepspeed_enabled:
            sizes.pop("tensor")  # a tensor-parallel group's ranks hold one batch: counted once (its engine)
        if any(size > 1 for size in sizes.values()):
            return f"{[k for k, v in sizes.items() if v > 1]} parallelism shares batches across ranks."
        return None

    def _batch_sharing_sizes(self) -> dict[str, int]:
        """The ranks that share one batch, by kind of parallelism."""
        return {"tensor": self.get_tp_size(), "context": self.get_cp_size(), "sequence": self.get_sp_size()}

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        if not self.args.exact_loss:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        # Stock's loop without its count: the stock count costs a collective under DDP, and the exact one replaces it.
        engine = self._engine or self._pick_engine()
        reads_end = engine.pads_epoch_end or engine.shards_sequence
        batch_samples, end = pull_batches(epoch_iterator, num_batches, self.accelerator.gradient_state, reads_end)
        self._counted_step = None
        vars(self).pop("_prepare_inputs", None)  # what a step that stopped left (`_hand_out`)
        if not batch_samples:  # the epoch ended with the previous step: nothing to count (nor to reduce over ranks)
            return batch_samples, None
        self._counted_step = self._count_step(batch_samples, end, device)
        if self._counted_step is None:  # the stock loss, warned once naming why
            return batch_samples, self._get_num_items_in_batch(batch_samples, device)
        return batch_samples, self._counted_step.total

    def _count_step(self, batch_samples: list[dict], end, device: torch.device) -> StepCounts | None:
        """The counts of a step (`count_step`), or None where the stock loss trains it."""
        engine = self._engine
        if engine.shards_sequence:
            sequence_shards(batch_samples, end, self.exact.warn_once)
        head = self._settled_head or self._exact_head(batch_samples[0])
        if head is None or not all(head.has_labels(batch) for batch in batch_samples):
            self.exact.labels_present(head, batch_samples)  # warns where a batch lacks the head's labels
            return None
        prepared = head.before_count(self, batch_samples) if head.route is Route.TRAINER_LOSS else batch_samples
        real_rows: tuple[int | None, ...] = ()
        if prepared is not batch_samples:
            # Made by the subclass (GRPO's completions, the items), each handed to its micro-batch; from whole
            # generation batches, which TRL's sampler deals to every rank: an epoch ends without padding.
            batch_samples = prepared
            self._hand_out(prepared)
        elif end is not None and self.compute_loss_func is None and engine.pads_epoch_end:
            # A user loss sees whole batches, padding too.
            real_rows = self.exact.padded_rows(head, batch_samples, end, self._pads_epoch_end)
        model, context = self.model_wrapped, self._run_context
        if self._settled_head is None:  # the check of the head against the model's own loss, while it is open
            first_real = real_rows[0] if real_rows else None
            head = calibrate_head(self.exact, model, head, batch_samples[0], context, first_real)
            if head is None:  # the stock loss, warned once naming why
                return None
        step = count_step(self.exact, head, batch_samples, device, context.main_input_name, model, real_rows)
        if head.route is Route.TRAINER_LOSS:  # what its micro-batches take of the step (an epoch's repeats left out)
            real = real_batches(head, batch_samples, real_rows)
            shared = head.step_shared(self, step.counts, real, engine.add_counts)
            step = replace(step, shared=shared)
        if self._settled_head is None and self.exact.pending_check(head, self.model, False) is None:
            self._settled_head = head  # no check is open for it
        return step

    @property
    def _pads_epoch_end(self) -> bool:
        """Whether the dataloaders fill an epoch's last global batch with repeated rows (accelerate's `even_batches`,
        without `dataloader_drop_last`)."""
        return self.accelerator.even_batches and not self.args.dataloader_drop_last

    def _hand_out(self, prepared: list[dict]) -> None:
        """Until each is taken, `_prepare_inputs` gives the step's micro-batches its count prepared (GRPO's)."""
        queue = list(prepared)

        def next_prepared(inputs):
            if len(queue) == 1:
                vars(self).pop("_prepare_inputs", None)
            return queue.pop(0)

        self._prepare_inputs = next_prepared

    def _pick_engine(self) -> Engine:
        """The run's engine (`hf_parallel.exact.engine`) and what its micro-batches share, picked once per run."""
        accelerator, exact = self.accelerator, self.exact
        sequence = self.get_sp_size() if self.is_deepspeed_enabled else 1
        stage = accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None
        # The Trainer wraps the model in DataParallel itself when it sees several GPUs in one process (also for an
        # evaluation that runs before the model was wrapped for training).
        data_parallel = is_data_parallel(self.model_wrapped) or (
            self.args.n_gpu > 1 and not getattr(self.model, "is_loaded_in_8bit", False)
        )
        self._engine = exact.engine = pick_engine(
            exact.num_processes,
            reduce_sum=exact.reduce_sum,
            data_parallel=data_parallel,
            deepspeed_stage=stage,
            sequence_parallel=sequence,
            deepspeed_version=deepspeed_version() if sequence > 1 else None,
            tensor_parallel=1 if self.is_deepspeed_enabled else self.get_tp_size(),
            name=None if self.is_deepspeed_enabled else str(accelerator.distributed_type.value),
        )
        self._run_context = RunContext(
            owner=self.model,
            loss_func=self.compute_loss_func,
            autocast_dtype=replica_autocast(accelerator.mixed_precision),
            main_input_name=self._main_input_name(),
            trainer_loss=self._trainer_loss if isinstance(self._trainer_loss_head(), LossHead) else None,
        )
        return self._engine

    def _trainer_loss(
        self, model: nn.Module, inputs: dict, return_outputs=False, num_items_in_batch=None, items=None, padding=False
    ):
        """
        The subclass's own `compute_loss` on a micro-batch of `items` (per count of its head), within what its head
        adds (`TrainerLossHooks.loss_call`; its router term held back); on an epoch's last batch under DDP, where a
        batch may be cut to its real samples (or be all `padding`), its gathers (of its metrics) take each rank's real
        rows.
        """
        accelerator, own, step = self.accelerator, self._own_loss, self._counted_step
        training = step is not None and num_items_in_batch is step.total
        logged, mode = own.logged, "train" if self.model.training else "eval"
        before = logged.lengths(self._metrics[mode]) if logged is not None else None
        with contextlib.ExitStack() as within:
            if accelerator.num_processes > 1 and accelerator.gradient_state.end_of_dataloader:
                within.enter_context(ragged_gathers(accelerator, padding))
            if own.router:  # the step adds the whole step's router term (`micro_batch_loss`): TRL's held back
                within.enter_context(temporarily(self, "aux_loss_enabled", False))
            shared = step.shared if training else self._evaluation_shared
            inputs, attributes = own.loss_call(self, inputs, items, shared, training)
            for name, value in attributes.items():
                within.enter_context(temporarily(self, name, value))
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if logged is not None:  # TRL's metrics of this micro-batch, kept with its items
            logged.record(self._metrics[mode], before, float(items[0]), mode)
        return result

    def _log_step_metrics(self, logs: dict[str, float], *args, **kwargs) -> None:
        """`log` of a TRL trainer whose metrics are made the whole step's (set on the instance: see
        `_trainer_loss_head`): its per-micro-batch values weighted by their items, then TRL's own `log`."""
        if self.args.exact_loss:
            mode = "train" if self.model.training else "eval"
            self._own_loss.logged.combine(self._metrics[mode], mode, (self._engine or self._pick_engine()).add_counts)
        type(self).log(self, logs, *args, **kwargs)

    def _main_input_name(self) -> str:
        return getattr(self.model, "main_input_name", "input_ids")

    def training_step(
        self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], num_items_in_batch=None
    ) -> torch.Tensor:
        # The step whose count `num_items_in_batch` is (the tensor get_batch_samples handed out), or stock's.
        step = self._counted_step
        step = step if step is not None and num_items_in_batch is step.total else None
        if step is None or (step.head.batch_coupled and self._exact_head(inputs) is None):
            # Stock's, also for the rest of a step whose contrastive loss fell back in its first micro-batch (its own
            # check, `hf_parallel.exact.coupled`): that step was counted as exact.
            return stock_training_step(self, super().training_step, model, inputs, num_items_in_batch)
        # compute_loss already divided by the item count of the whole step: stock must not divide by the number of
        # accumulation steps again.
        with temporarily(self, "loss_is_scaled_for_ga", True):
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        step = self._counted_step
        step = step if step is not None and num_items_in_batch is step.total else None
        head = step.head if step is not None and not step.head.batch_coupled else self._exact_head(inputs)
        real = None
        if step is None and head is not None and head.has_labels(inputs):  # evaluation (or outside train())
            if self.exact.evaluation.running:
                gradient_state = self.accelerator.gradient_state
                real = self.exact.evaluation_padding(head, inputs, gradient_state, self._pads_epoch_end)
            if self._run_context is None:  # compute_loss called outside train() and evaluate()
                self._pick_engine()
            # The check of the head against the model's own loss, while it is open, on this batch first.
            head = calibrate_head(self.exact, model, head, inputs, self._run_context, real)
        if head is None or not head.has_labels(inputs):
            count = num_items_in_batch
            with stock_replica_precision(model, self.accelerator.mixed_precision):
                return stock_compute_loss(self, super().compute_loss, model, inputs, return_outputs, count)
        loss, outputs = micro_batch_loss(
            self.exact, model, head, inputs, step, self._run_context, return_outputs=return_outputs, real=real
        )
        if step is not None:
            loss = self.exact.engine.as_logged(loss)
        return _loss_and_outputs(loss, outputs, return_outputs)

    def evaluation_loop(
        self,
        dataloader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ):
        dataset_name = evaluation_dataset_name(description, metric_key_prefix)
        # getattr, as stock: a dataloader need not have a `.dataset` (transformers supports one without it).
        check_not_empty(getattr(dataloader, "dataset", None), dataset_name)
        self._check_engine()
        if self.args.exact_loss and self._engine is None:
            self._pick_engine()  # how the ranks' rows add up (picked again at the first training step)
        self._count_samples(dataloader, dataset_name)
        if prediction_loss_only is None:
            prediction_loss_only = self.args.prediction_loss_only
        self.exact.evaluation.start(self.args.exact_loss, keep_outputs=not prediction_loss_only)
        own = self._trainer_loss_head() if self.args.exact_loss else None
        try:
            if isinstance(own, LossHead):  # what every batch's loss takes of the whole set, made first
                self._evaluation_shared = own.evaluation_shared(self, dataloader, self.accelerator.gather_for_metrics)
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        finally:
            exact = self.exact.evaluation.finish(self.exact.engine)
            self._evaluation_shared = None
        if exact is not None:
            # Stock reports the mean of per-batch means; this is sum of losses / sum of items over the whole set.
            output.metrics[f"{metric_key_prefix}_loss"] = exact
        return output

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        # An epoch's last step then knows which samples of an iterable set each rank reads itself are real.
        self._count_samples(dataloader, "train_dataset")
        return dataloader

    def _count_samples(self, dataloader, dataset_name: str) -> None:
        """Count the samples of an iterable dataset each rank reads itself (`hf_parallel.exact.streams`), so that
        the samples accelerate repeats to fill its last batch are left out; warn once where they cannot be."""
        if not self.args.exact_loss:
            return
        cannot = count_samples(dataloader, dataset_name)
        if cannot is not None:
            self.exact.warn_once(cannot)

    def _finalize_training(self, trial, num_train_samples, start_time):
        if self.args.exact_loss and self.accelerator.num_processes > 1:
            # Stock adds this rank's not-yet-logged loss to `train_loss` as it is: each rank would then report its own
            # share. Logging averages over ranks first; do the same for the remainder.
            self._tr_loss.copy_(self.accelerator.reduce(self._tr_loss.detach().clone(), reduction="mean"))
        return super()._finalize_training(trial, num_train_samples, start_time)


def _loss_and_outputs(loss: torch.Tensor, outputs: Any, return_outputs: bool):
    """What `compute_loss` returns: the loss, or the loss and the outputs as stock gives them."""
    if not return_outputs:
        return loss
    if outputs is None:
        outputs = {}  # prediction_loss_only under DataParallel: no outputs were gathered
    elif not isinstance(outputs, dict):
        outputs = (loss, *outputs)  # prediction_step reads the logits from outputs[1:]
    return loss, outputs


# The classes whose compute_loss is the exact loss or the stock one it falls back to.
_OUR_LOSS_CLASSES = (ExactLossOverrides, transformers.Trainer)
