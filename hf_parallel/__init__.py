"""hf_parallel: exact multi-GPU training for Hugging Face `transformers.Trainer`, with one import."""

from .callbacks import CleanCheckpointCallback, Gpu0BszAdvisorCallback, PeakMemoryCallback
from .data_parallel import BalancedDataParallel, balanced_chunk_sizes, suggest_gpu0_bsz
from .inference import POOLING_METHODS, SequenceEmbedder, embed_dataset, pool_hidden_states, shard_batches
from .trainer import Trainer
from .training_args import TrainingArguments
from .unwrap import load_state_dict, unwrap_model

__version__ = "0.1.0"

__all__ = [
    "POOLING_METHODS",
    "SequenceEmbedder",
    "embed_dataset",
    "pool_hidden_states",
    "shard_batches",
    "Trainer",
    "TrainingArguments",
    "CleanCheckpointCallback",
    "BalancedDataParallel",
    "balanced_chunk_sizes",
    "suggest_gpu0_bsz",
    "PeakMemoryCallback",
    "Gpu0BszAdvisorCallback",
    "load_state_dict",
    "unwrap_model",
    "__version__",
]
