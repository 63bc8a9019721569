"""hf_parallel: exact multi-GPU training for Hugging Face `transformers.Trainer`, with one import."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
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
    from .data_parallel import BalancedDataParallel, ExactDataParallel, balanced_chunk_sizes, suggest_gpu0_bsz
    from .inference import POOLING_METHODS, SequenceEmbedder, embed_dataset, pool_hidden_states, shard_batches
    from .launch.teardown import release_distributed
    from .loop import ExactLoop, LoopStep
    from .saving.checkpoints import check_reload, load_state_dict
    from .saving.unwrap import unwrap_model
    from .trainer import Seq2SeqTrainer, Trainer, TrainerMixin
    from .training_args import Seq2SeqTrainingArguments, TrainingArguments


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


# Modules that moved when the package was laid out by purpose, by old path: `import hf_parallel.unwrap` and
# `from hf_parallel.chunking import ...` keep giving the same module object, with a DeprecationWarning naming its home.
_MOVED = {
    "chunking": "data_parallel.chunking",
    "scatter": "data_parallel.scatter",
    "replication": "data_parallel.replication",
    "guards": "launch.guards",
    "launch_env": "launch.environment",
    "teardown": "launch.teardown",
    "validation": "launch.validation",
    "unwrap": "saving.unwrap",
    "checkpoints": "saving.checkpoints",
    "exact.ctc": "exact.heads.ctc",
    "exact.decoder": "exact.heads.decoder",
    "exact.frames": "exact.heads.frames",
    "exact.router": "exact.heads.router",
    "exact.segmentation": "exact.heads.segmentation",
    "exact.contrastive": "exact.heads.contrastive",
    "exact.counts": "exact.terms",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module's old path (after every other finder) and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None):
        prefix = f"{__name__}."
        if not fullname.startswith(prefix) or fullname[len(prefix) :] not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = f"{__name__}.{_MOVED[spec.name[len(__name__) + 1 :]]}"
        warnings.warn(f"{spec.name} moved to {new}; import it from there.", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """The module at the new path is already executed."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
