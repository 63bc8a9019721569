"""
The exact-loss core: per-head loss sums and item counts (`heads`), the head of a model (`resolve`), and `ExactLoss`,
which turns them into the exact loss of an optimizer step and of an evaluation set (`core`). Nothing here needs a
Trainer; `hf_parallel.Trainer` calls it from its hooks.
"""

from .core import EvalTotals, ExactLoss, StepCounts, sequence_length
from .heads import (
    IGNORE_INDEX,
    CrossEntropyHead,
    LossHead,
    MultiLabelHead,
    QuestionAnsweringHead,
    RegressionHead,
    token_losses,
)
from .remainder import REAL_ROWS_KEY, EpochEnd, pull_batches, real_rows
from .resolve import ProblemTypeUnsettled, UnsupportedHead, resolve_head

__all__ = [
    "IGNORE_INDEX",
    "REAL_ROWS_KEY",
    "EpochEnd",
    "CrossEntropyHead",
    "EvalTotals",
    "ExactLoss",
    "LossHead",
    "MultiLabelHead",
    "ProblemTypeUnsettled",
    "QuestionAnsweringHead",
    "RegressionHead",
    "StepCounts",
    "UnsupportedHead",
    "pull_batches",
    "real_rows",
    "resolve_head",
    "sequence_length",
    "token_losses",
]
