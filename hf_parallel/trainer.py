"""`Trainer`: a drop-in `transformers.Trainer` for several GPUs. Glue only; the logic lives in the sibling modules."""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from accelerate.utils import DistributedType
from torch import nn
from transformers.trainer import _is_peft_model
from transformers.training_args import ParallelMode
from transformers.utils import is_sagemaker_mp_enabled, logging

from .data_parallel import BalancedDataParallel
from .guards import check_launch
from .loss import EvalTotals, LossHead, StepCounts, UnsupportedHead, resolve_head
from .teardown import track_trainer
from .training_args import TrainingArguments
from .unwrap import (
    CHECKPOINT_WEIGHT_FILES,
    clean_state_dict,
    has_wrapper_prefixes,
    load_state_dict,
    unwrap_model,
    unwrap_user_model,
)

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
        # A model the user already wrapped in DataParallel/DDP: stock then trains on empty batches and writes
        # `module.`-prefixed checkpoints. Take the model out (a BalancedDataParallel's split moves into the args).
        model, args = unwrap_user_model(model, args)
        # Launch guards, before super().__init__ moves the model, so that a mis-launch stops here. Reading
        # args.world_size sets up the devices and the process group, which is what the guards inspect.
        check_launch(args)
        super().__init__(model, args, *positional, **kwargs)
        if args.world_size > 1:
            # Release the DDP wrapper before interpreter exit, where its destruction can abort the process.
            track_trainer(self)
        self._exact_heads: dict[tuple, tuple[nn.Module, LossHead | None]] = {}
        self._exact_warned: set[str] = set()
        self._eval_totals: EvalTotals | None = None

    # ---- Exact loss (the per-head arithmetic lives in loss.py) ----
    def _exact_head(self, batch: dict | None = None) -> LossHead | None:
        """The loss head to compute exactly, or None for the stock path (warned once, naming why)."""
        if not self.args.exact_loss:
            return None
        # Called twice a micro-batch: keyed on what can change (the model, e.g. under model_init; a classifier's
        # problem_type, settled by the first labels), unwrapped only on a miss.
        config = getattr(self.model, "config", None)
        key = (id(self.model), getattr(config, "problem_type", None), self.compute_loss_func is not None)
        cached = self._exact_heads.get(key)
        if cached is not None and cached[0] is self.model:  # the model itself, not a later one reusing its id
            return cached[1]
        try:
            head = self._resolve_exact_head(self.accelerator.unwrap_model(self.model), batch)
        except UnsupportedHead as reason:
            if batch is None and "problem_type is unset" in str(reason):
                return None  # settled at the first batch, which carries the labels
            self._warn_fallback(str(reason))
            head = None
        self._exact_heads[(id(self.model), getattr(config, "problem_type", None), key[2])] = (self.model, head)
        return head

    def _resolve_exact_head(self, model: nn.Module, batch: dict | None) -> LossHead:
        if type(self).compute_loss is not Trainer.compute_loss:
            raise UnsupportedHead(f"{type(self).__name__} overrides compute_loss, which then owns the normalisation.")
        sizes = {"tensor": self.get_tp_size(), "context": self.get_cp_size(), "sequence": self.get_sp_size()}
        if any(size > 1 for size in sizes.values()):
            raise UnsupportedHead(f"{[k for k, v in sizes.items() if v > 1]} parallelism shares batches across ranks.")
        sample_labels = batch.get("labels") if batch is not None else None
        try:
            return resolve_head(model, self.label_names, self.args.label_smoothing_factor, sample_labels)
        except UnsupportedHead:
            if self.compute_loss_func is None or self.label_names != ["labels"]:
                raise
            # A user loss on a model we do not know: we only need its item count, which is the stock one.
            return LossHead("compute_loss_func", shift=self._loss_shifts_labels)

    def _warn_fallback(self, reason: str) -> None:
        if reason not in self._exact_warned:
            self._exact_warned.add(reason)
            logger.warning(f"exact_loss: {reason} This model trains with the stock transformers loss instead.")

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        if not self.args.exact_loss:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        head = self._exact_head(batch_samples[0] if batch_samples else None)
        if head is None or not all(key in batch for batch in batch_samples for key in head.label_keys):
            if head is not None:
                self._warn_fallback(f"a training batch lacks the label keys {list(head.label_keys)}.")
            return batch_samples, self._get_num_items_in_batch(batch_samples, device)
        counts = sum(head.count(batch, self._sequence_length(batch)).to(device) for batch in batch_samples)
        scale = 1
        if self.accelerator.num_processes > 1 and self.accelerator.distributed_type != DistributedType.NO:
            # C must be the count of the whole step on every rank; and DDP averages gradients over ranks, so each
            # rank scales its S / C by the world size (the sum over ranks of S_r / C is the exact loss).
            counts = self.accelerator.reduce(counts, reduction="sum")
            scale = self.accelerator.num_processes
        return batch_samples, StepCounts(counts, scale)

    def _sequence_length(self, batch: dict) -> int | None:
        main = batch.get(getattr(self.model, "main_input_name", "input_ids"), batch.get("attention_mask"))
        return main.shape[1] if torch.is_tensor(main) and main.dim() > 1 else None

    def training_step(
        self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], num_items_in_batch=None
    ) -> torch.Tensor:
        if not isinstance(num_items_in_batch, StepCounts):
            return super().training_step(model, inputs, num_items_in_batch)
        # compute_loss already divided by the item count of the whole step: stock must not divide by the number of
        # accumulation steps again.
        previous, self.loss_is_scaled_for_ga = self.loss_is_scaled_for_ga, True
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self.loss_is_scaled_for_ga = previous

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        head = self._exact_head(inputs)
        if head is None or not all(key in inputs for key in head.label_keys):
            if isinstance(num_items_in_batch, StepCounts):
                num_items_in_batch = num_items_in_batch.total()
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        step = num_items_in_batch if isinstance(num_items_in_batch, StepCounts) else None
        inputs = dict(inputs)  # the caller's dict keeps its labels
        labels = head.pop_labels(inputs)
        if head.name == "seq2seq_lm" and "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs:
            # The model builds decoder inputs from the labels it no longer receives.
            unwrapped = self.accelerator.unwrap_model(model)
            inputs["decoder_input_ids"] = unwrapped.prepare_decoder_input_ids_from_labels(labels=labels["labels"])
        outputs = model(**inputs)

        if self.compute_loss_func is not None:
            total = step.total() if step is not None else head.count(labels, self._sequence_length(inputs)).sum()
            loss = self.compute_loss_func(outputs, labels["labels"], num_items_in_batch=total)
        else:
            row_sums, row_counts = head.row_terms(outputs, labels)
            if step is not None:
                loss = head.combine(row_sums.sum(0), step.counts)
            else:
                loss = head.combine(row_sums.sum(0), row_counts.sum(0))
                if self._eval_totals is not None:
                    # Per-row terms, so that gather_for_metrics drops the rows a distributed sampler duplicated.
                    gathered = self.accelerator.gather_for_metrics((row_sums.detach(), row_counts))
                    self._eval_totals.add(head, *gathered)
        if step is not None:
            loss = loss * step.scale
        if not return_outputs:
            return loss
        if not isinstance(outputs, dict):
            outputs = (loss, *outputs)  # prediction_step reads the logits from outputs[1:]
        return loss, outputs

    def evaluation_loop(
        self,
        dataloader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ):
        self._eval_totals = EvalTotals() if self.args.exact_loss else None
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        finally:
            totals, self._eval_totals = self._eval_totals, None
        exact = totals.value() if totals is not None else None
        if exact is not None:
            # Stock reports the mean of per-batch means; this is sum of losses / sum of items over the whole set.
            output.metrics[f"{metric_key_prefix}_loss"] = exact
        return output

    # ---- Balanced DataParallel (gpu0_bsz / gpu0_weight; the split lives in data_parallel.py) ----
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        args = self.args
        if args.gpu0_bsz is None and args.gpu0_weight is None:
            return super()._wrap_model(model, training, dataloader)
        setting = f"gpu0_bsz={args.gpu0_bsz}" if args.gpu0_bsz is not None else f"gpu0_weight={args.gpu0_weight}"
        if args.parallel_mode != ParallelMode.NOT_DISTRIBUTED or args.n_gpu <= 1:
            reason = "under DDP each process has its own GPU and batch" if args.world_size > 1 else "one device"
            logger.warning_once(
                f"{setting} is ignored: it balances nn.DataParallel over several GPUs in one process, and this run "
                f"uses {reason} (n_gpu={args.n_gpu}, world_size={args.world_size})."
            )
            return super()._wrap_model(model, training, dataloader)
        if (
            self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model  # already wrapped
            or is_sagemaker_mp_enabled()
            or getattr(model, "is_loaded_in_8bit", False)
            or getattr(model, "is_loaded_in_4bit", False)
        ):
            return super()._wrap_model(model, training, dataloader)
        if training and not args.exact_loss and self.model_accepts_loss_kwargs:
            # Stock compute_loss passes num_items_in_batch to such models as an [n_gpu, 1] tensor, one row per GPU,
            # which a balanced split cannot scatter (BalancedDataParallel would raise at the first step).
            raise ValueError(
                f"{setting} with exact_loss=False: {type(model).__name__} accepts loss kwargs, so the stock loss "
                "passes it num_items_in_batch as an [n_gpu, 1] tensor, one row per GPU, which a balanced split cannot "
                "follow. Set exact_loss=True (the default) or unset gpu0_bsz/gpu0_weight."
            )
        if training and not args.exact_loss:
            logger.warning_once(
                f"{setting} with exact_loss=False: the stock loss averages the per-GPU mean losses, which is not the "
                "batch mean when the chunks differ in size, as they do here. Keep exact_loss=True (the default)."
            )
        # Looked up at call time, as the stock Trainer looks up nn.DataParallel, so that
        # hf_parallel.testing.simulate_data_parallel can substitute its CPU simulation.
        balanced_class = getattr(torch.nn.DataParallel, "hf_parallel_balanced_class", BalancedDataParallel)
        # Past the DataParallel wrap, stock only adds wrappers for XLA FSDP and SageMaker DP, neither of which runs
        # with n_gpu > 1 in one process, so the wrapped model is final for training and evaluation alike.
        return balanced_class(model, gpu0_bsz=args.gpu0_bsz, gpu0_weight=args.gpu0_weight)

    def _finalize_training(self, trial, num_train_samples, start_time):
        if self.args.exact_loss and self.accelerator.num_processes > 1:
            # Stock adds this rank's not-yet-logged loss to `train_loss` as it is: each rank would then report its own
            # share. Logging averages over ranks first; do the same for the remainder.
            self._tr_loss.copy_(self.accelerator.reduce(self._tr_loss.detach().clone(), reduction="mean"))
        return super()._finalize_training(trial, num_train_samples, start_time)

    # ---- DDP after evaluate() ----
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval: list[str] | None = None,
    ):
        self._undo_evaluation_only_prepare()
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def _undo_evaluation_only_prepare(self) -> None:
        """
        `evaluate()` before `train()` under DDP prepares the bare model in evaluation mode, which marks it as prepared;
        `train()` then asks accelerate to prepare it again, which returns it unwrapped: ranks train without DDP and
        drift apart silently. Unmark it so that training wraps it. Remove when transformers wraps it (see the test
        `test_evaluate_before_train_still_wraps_ddp`, which fails loudly once stock behaves).
        """
        model = self.model
        if (
            self.args.parallel_mode == ParallelMode.DISTRIBUTED
            and self.model_wrapped is model
            and getattr(model, "_is_accelerate_prepared", False)
        ):
            model._is_accelerate_prepared = False
            self.accelerator._models[:] = [m for m in self.accelerator._models if m is not model]

    # ---- Saving and loading: checkpoints never carry wrapper prefixes (the logic lives in unwrap.py) ----
    def _plain_weights_checkpoint(self, model: nn.Module | None, checkpoint: str | None) -> bool:
        """Whether loading `checkpoint` is a plain state-dict load, the case the stock code gets wrong on prefixes."""
        if checkpoint is None or self.is_deepspeed_enabled or self.is_fsdp_enabled or is_sagemaker_mp_enabled():
            return False
        if model is not None and _is_peft_model(unwrap_model(model)):
            return False
        return any(os.path.isfile(os.path.join(checkpoint, name)) for name in CHECKPOINT_WEIGHT_FILES)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        inner = unwrap_model(self.model) if isinstance(self.model, nn.Module) else self.model
        prefixed = state_dict is not None and has_wrapper_prefixes(state_dict.keys(), inner)
        if inner is self.model and not prefixed:
            return super()._save(output_dir, state_dict)
        # self.model is a wrapper (a user-compiled model, a model_init returning one): stock would write its
        # `_orig_mod.` / `module.` keys, which from_pretrained silently skips. Save the inner model instead.
        if state_dict is not None:
            state_dict = clean_state_dict(state_dict, inner)
        wrapped, self.model = self.model, inner
        try:
            super()._save(output_dir, state_dict)
        finally:
            self.model = wrapped

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if model is None:
            model = self.model
        if not self._plain_weights_checkpoint(model, resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # Stock loads with strict=False into the model as it is: a checkpoint with `module.` keys (an older run,
        # a user-wrapped model) then resumes from random weights with only a warning. Match keys across wrappers,
        # and fail loudly on anything else.
        logger.info(f"Loading model from {resume_from_checkpoint}.")
        load_state_dict(model, resume_from_checkpoint, strict=True)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not self._plain_weights_checkpoint(self.model, best):
            return super()._load_best_model()
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        load_state_dict(self.model, best, strict=True)
