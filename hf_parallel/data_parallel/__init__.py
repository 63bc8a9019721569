"""
DataParallel, done exactly: the wrappers (`wrappers`), the split arithmetic (`chunking`, no torch), walking and
splitting batch structures (`scatter`) and replicas whose gradients reach the parameters as one device's would
(`replication`). Everything here serves `nn.DataParallel`'s single-process, several-GPU mode only.
"""

from .chunking import balanced_chunk_sizes, check_split_options, suggest_gpu0_bsz, torch_chunk_sizes
from .wrappers import BalancedDataParallel, ExactDataParallel, balanced_wrapper, with_exact_replicas

__all__ = [
    "BalancedDataParallel",
    "ExactDataParallel",
    "balanced_chunk_sizes",
    "balanced_wrapper",
    "with_exact_replicas",
    "check_split_options",
    "suggest_gpu0_bsz",
    "torch_chunk_sizes",
]
