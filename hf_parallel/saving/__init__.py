"""
Saving and loading: unwrapping a model from DataParallel, DDP, FSDP, `torch.compile` and PEFT wrappers (`unwrap`),
and the weight files of a checkpoint, loading them into any wrapper, checking a reload (`checkpoints`).
"""

from .checkpoints import check_reload, load_state_dict
from .unwrap import unwrap_model

__all__ = ["check_reload", "load_state_dict", "unwrap_model"]
