"""
DeepSpeed, as hf_parallel meets it: checks before its engine starts, so that a run fails with a message that names
the cause and the fix rather than deep inside `deepspeed.initialize`.

The exact loss itself needs nothing of DeepSpeed's: ZeRO 1, 2 and 3 average the gradient over the data-parallel ranks
as DDP does, so the loss each rank backpropagates is its token-loss sum over the step's count times the number of
ranks (`hf_parallel.exact`), and DeepSpeed's gradient accumulation adds the micro-batches' gradients as torch does
(the Trainer tells it the loss is already scaled for accumulation).
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["scalar_parameter_problem"]


def scalar_parameter_problem(model: nn.Module) -> str | None:
    """
    Why DeepSpeed's engine cannot start on `model`, or None: DeepSpeed releases whose engine broadcasts each
    parameter as bytes (`p.data.view(torch.uint8)` in `DeepSpeedEngine._broadcast_model`, 0.19.8 among them) fail on
    a 0-dimensional parameter (CLIP's `logit_scale`, CLAP's) with "self.dim() cannot be 0 to view Float as Byte", on
    GPUs and CPUs alike and under every ZeRO stage.
    """
    scalars = [name for name, parameter in model.named_parameters() if parameter.dim() == 0]
    if not scalars:
        return None
    try:
        import deepspeed
        from deepspeed.runtime.engine import DeepSpeedEngine

        broadcasts_bytes = "view(torch.uint8)" in inspect.getsource(DeepSpeedEngine._broadcast_model)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    if not broadcasts_bytes:
        return None
    return (
        f"DeepSpeed {deepspeed.__version__} cannot start on {type(model).__name__}: its engine broadcasts every "
        f"parameter as bytes when it starts and fails on 0-dimensional parameters ({', '.join(scalars)}) with "
        "'self.dim() cannot be 0 to view Float as Byte'. Train this model with DDP or FSDP2, or give those "
        "parameters one dimension (shape [1]) before training."
    )
