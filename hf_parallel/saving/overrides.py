"""
`CheckpointOverrides`: the Trainer's saving and loading hooks, for any `transformers.Trainer` subclass (a base of
`hf_parallel.TrainerMixin`): checkpoints staged and renamed whole (`staging`), no wrapper prefixes in the weights
(`unwrap`), weights loaded across wrappers (`checkpoints`), a model sharded at load time keeping its optimizer state
(`sharded`), a defined random state for a rank the checkpoint has none for (`resume`).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn
from transformers.trainer import SCHEDULER_NAME, _is_peft_model
from transformers.utils import is_sagemaker_mp_enabled, logging

from ..upstream import temporarily
from .checkpoints import checkpoint_weight_files, load_state_dict
from .resume import seed_rank_without_state
from .sharded import is_sharded_at_load, load_optimizer_any_layout, save_sharded_optimizer
from .staging import staged_checkpoint
from .unwrap import clean_state_dict, has_wrapper_prefixes, unwrap_model

__all__ = ["CheckpointOverrides"]

logger = logging.get_logger(__name__)


class CheckpointOverrides:
    """The Trainer's checkpoint hooks, each "not ours: super()" or a call into this package; first in the bases."""

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        # Stock's save, into a staging folder renamed to checkpoint-N once every process has written it: a kill
        # mid-save leaves the last complete checkpoint in place, and rotation runs only after the new one is complete.
        staged_checkpoint(self, model, trial, super()._save_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not is_sharded_at_load(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        # Sharded at load time: each rank writes its shards of the optimizer state (any layout reads them back).
        save_sharded_optimizer(self.model, self.optimizer, output_dir, self.args.should_save)
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's "please also save the optimizer state"
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # A sharded model's optimizer state into any layout, a plain run's into a sharded model; else stock's.
        skip = checkpoint is None or self.is_deepspeed_enabled
        groups = None if skip else load_optimizer_any_layout(self.model, self.optimizer, checkpoint)
        if groups is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            saved = torch.load(scheduler, weights_only=True)
            self.lr_scheduler.load_state_dict(groups.scheduler_state(saved, self.lr_scheduler.state_dict()))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # A rank the checkpoint has no random state for (another number of processes wrote it) gets a defined one.
        if not seed_rank_without_state(self.args, checkpoint, self.state.global_step):
            super()._load_rng_state(checkpoint)

    def _plain_weights_checkpoint(self, checkpoint: str | None, model: nn.Module | None) -> bool:
        """
        Whether loading `checkpoint` into `model` is a plain state-dict load, the case the stock Trainer gets wrong on
        wrapper prefixes: a checkpoint with weight files, not a sharded state (DeepSpeed, FSDP, SageMaker model
        parallelism) nor a PEFT model's adapters, which their own loaders read.
        """
        sharded = self.is_deepspeed_enabled or self.is_fsdp_enabled or is_sagemaker_mp_enabled()
        if checkpoint is None or sharded or (model is not None and _is_peft_model(unwrap_model(model))):
            return False
        return bool(checkpoint_weight_files(checkpoint))

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        inner = unwrap_model(self.model) if isinstance(self.model, nn.Module) else self.model
        prefixed = state_dict is not None and has_wrapper_prefixes(state_dict.keys(), inner)
        if inner is self.model and not prefixed:
            return super()._save(output_dir, state_dict)
        # self.model is a wrapper (a user-compiled model, a model_init returning one): stock would write its
        # `_orig_mod.` / `module.` keys, which from_pretrained silently skips. Save the inner model instead.
        if state_dict is not None:
            state_dict = clean_state_dict(state_dict, inner)
        with temporarily(self, "model", inner):
            super()._save(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if model is None:
            model = self.model
        if not self._plain_weights_checkpoint(resume_from_checkpoint, model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # Stock loads with strict=False into the model as it is: a checkpoint with `module.` keys (an older run,
        # a user-wrapped model) then resumes from random weights with only a warning. Match keys across wrappers,
        # and fail loudly on anything else.
        logger.info(f"Loading model from {resume_from_checkpoint}.")
        load_state_dict(model, resume_from_checkpoint, strict=True)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not self._plain_weights_checkpoint(best, self.model):
            return super()._load_best_model()
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        load_state_dict(self.model, best, strict=True)
