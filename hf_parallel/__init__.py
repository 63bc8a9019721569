"""hf_parallel: exact multi-GPU training for Hugging Face `transformers.Trainer`, with one import."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it. Loaded on first use (PEP 562), so that `hf-parallel --help` and
# `import hf_parallel.cli` do not pay for importing torch and transformers.
_EXPORTS = {
    "Trainer": "trainer",
    "TrainingArguments": "training_args",
    "TrainerMixin": "trainer",
    "Seq2SeqTrainer": "trainer",
    "Seq2SeqTrainingArguments": "training_args",
    "BalancedDataParallel": "data_parallel",
    "ExactDataParallel": "data_parallel",
    "balanced_chunk_sizes": "data_parallel",
    "suggest_gpu0_bsz": "data_parallel",
    "unwrap_model": "unwrap",
    "load_state_dict": "checkpoints",
    "check_reload": "checkpoints",
    "CleanCheckpointCallback": "callbacks",
    "PeakMemoryCallback": "callbacks",
    "Gpu0BszAdvisorCallback": "callbacks",
    "SequenceEmbedder": "inference",
    "embed_dataset": "inference",
    "pool_hidden_states": "inference",
    "shard_batches": "inference",
    "POOLING_METHODS": "inference",
    "release_distributed": "teardown",
    "ExactLoop": "loop",
    "LoopStep": "loop",
}

__all__ = [
    "Trainer",
    "TrainingArguments",
    "TrainerMixin",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "BalancedDataParallel",
    "ExactDataParallel",
    "balanced_chunk_sizes",
    "suggest_gpu0_bsz",
    "unwrap_model",
    "load_state_dict",
    "check_reload",
    "CleanCheckpointCallback",
    "PeakMemoryCallback",
    "Gpu0BszAdvisorCallback",
    "SequenceEmbedder",
    "embed_dataset",
    "pool_hidden_states",
    "shard_batches",
    "POOLING_METHODS",
    "release_distributed",
    "ExactLoop",
    "LoopStep",
    "__version__",
]

if TYPE_CHECKING:
    from .callbacks import CleanCheckpointCallback, Gpu0BszAdvisorCallback, PeakMemoryCallback
    from .checkpoints import check_reload, load_state_dict
    from .data_parallel import BalancedDataParallel, ExactDataParallel, balanced_chunk_sizes, suggest_gpu0_bsz
    from .inference import POOLING_METHODS, SequenceEmbedder, embed_dataset, pool_hidden_states, shard_batches
    from .loop import ExactLoop, LoopStep
    from .teardown import release_distributed
    from .trainer import Seq2SeqTrainer, Trainer, TrainerMixin
    from .training_args import Seq2SeqTrainingArguments, TrainingArguments
    from .unwrap import unwrap_model


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
