"""
The one-device reference of the tests that train several steps: the model's own loss on each step's rows in one
forward, plain SGD by hand, no hf_parallel and no Trainer. An exact run under any engine ends where this ends.
"""

from __future__ import annotations

import torch
from torch import nn


def stack_rows(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Rows of equal-shaped tensors as one batch."""
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter of `model`, flattened into one tensor (a copy)."""
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def steps_of(rows: list[dict], step_rows: int, epochs: int = 1) -> list[list[dict]]:
    """The rows of each optimizer step, in order: `step_rows` a step, an epoch's last step the rows left."""
    return [rows[start : start + step_rows] for _ in range(epochs) for start in range(0, len(rows), step_rows)]


def sgd_reference(model: nn.Module, steps: list[list[dict]], lr: float, eval_rows: list[dict] | None = None) -> dict:
    """
    Train `model` (changed in place) one step per entry of `steps`, each the model's own loss on its rows in one
    forward and SGD by hand (`p -= lr * p.grad`); then its loss on `eval_rows` in one forward.

    Returns:
        `dict`: `init` (the flat parameters before), `losses` (one per step), `params` (the flat parameters after
        each step) and `eval_loss` (None without `eval_rows`).
    """
    init, losses, params = flat_params(model), [], []
    for rows in steps:
        loss = model(**stack_rows(rows)).loss
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(lr * p.grad)
        losses.append(loss.item())
        params.append(flat_params(model))
    eval_loss = None
    if eval_rows is not None:
        model.eval()
        with torch.no_grad():
            eval_loss = model(**stack_rows(eval_rows)).loss.item()
    return {"init": init, "losses": losses, "params": params, "eval_loss": eval_loss}
