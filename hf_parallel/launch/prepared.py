"""
What accelerate remembers as prepared, across `evaluate()` and `train()` under DDP.

`evaluate()` before `train()` under DDP prepares the bare model in evaluation mode, which marks it as prepared;
`train()` then asks accelerate to prepare it again, which returns it unwrapped: ranks train without DDP and drift
apart silently. `unmark_evaluation_prepare` unmarks it so that training wraps it. Remove when transformers wraps it:
the stock control `tests/test_exact_loss.py::test_control_stock_ddp` asserts the trap and fails once stock behaves.
"""

from __future__ import annotations

from torch import nn

__all__ = ["unmark_evaluation_prepare"]


def unmark_evaluation_prepare(model: nn.Module, wrapped: nn.Module, accelerator) -> bool:
    """
    Unmark `model` (the Trainer's `model`) and `wrapped` (its `model_wrapped`) as prepared by accelerate when the
    evaluation-only prepare left them so: no DDP between them (at most `torch.compile`'s wrapper, which the evaluation
    prepare returns), and marked. They are also dropped from the accelerator's models. Returns whether they were: the
    caller then sets `model_wrapped` back to `model`. Call it under DDP only.
    """
    unwrapped = getattr(wrapped, "_orig_mod", wrapped) is model  # no DDP between them, at most torch.compile's
    if not unwrapped or not getattr(model, "_is_accelerate_prepared", False):
        return False
    for prepared in (model, wrapped):
        prepared._is_accelerate_prepared = False
    accelerator._models[:] = [m for m in accelerator._models if m is not model and m is not wrapped]
    return True
