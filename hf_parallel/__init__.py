"""hf_parallel: exact multi-GPU training for Hugging Face `transformers.Trainer`, with one import."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names, each with the module that defines it: the one list `__all__` is made from. Loaded on first use
# (PEP 562), so that `hf-parallel --help` does not pay for importing torch and transformers.
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
    "unwrap_model": "saving",
    "load_state_dict": "saving",
    "check_reload": "saving",
    "CleanCheckpointCallback": "callbacks",
    "PeakMemoryCallback": "callbacks",
    "Gpu0BszAdvisorCallback": "callbacks",
    "SequenceEmbedder": "inference",
    "embed_dataset": "inference",
    "pool_hidden_states": "inference",
    "shard_batches": "inference",
    "POOLING_METHODS": "inference",
    "release_distributed": "launch.teardown",
    "ExactLoop": "loop",
    "LoopStep": "loop",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    # For type checkers and IDEs; the names are public through `__all__`, made from `_EXPORTS`.
    from .callbacks import CleanCheckpointCallback, Gpu0BszAdvisorCallback, PeakMemoryCallback  # noqa: F401
    from .data_parallel import BalancedDataParallel, ExactDataParallel, balanced_chunk_sizes, suggest_gpu0_bsz  # noqa: F401
    from .inference import POOLING_METHODS, SequenceEmbedder, embed_dataset, pool_hidden_states, shard_batches  # noqa: F401
    from .launch.teardown import release_distributed  # noqa: F401
    from .loop import ExactLoop, LoopStep  # noqa: F401
    from .saving.checkpoints import check_reload, load_state_dict  # noqa: F401
    from .saving.unwrap import unwrap_model  # noqa: F401
    from .trainer import Seq2SeqTrainer, Trainer, TrainerMixin  # noqa: F401
    from .training_args import Seq2SeqTrainingArguments, TrainingArguments  # noqa: F401


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
