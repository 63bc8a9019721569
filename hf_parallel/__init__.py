"""hf_parallel: exact multi-GPU training for Hugging Face `transformers.Trainer`, with one import."""

from .trainer import Trainer
from .training_args import TrainingArguments

__version__ = "0.1.0"

__all__ = ["Trainer", "TrainingArguments", "__version__"]
