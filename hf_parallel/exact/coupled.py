"""
Contrastive losses (CLIP, SigLIP, ALIGN, CLAP, ... with `return_loss=True`) over the whole step's batch.

Each row's loss depends on every other row of its batch: an image is scored against every text of the batch (softmax
over the batch for CLIP, a sigmoid per pair for SigLIP). Split the batch and each part sees only its own rows as
negatives, which is another loss, not a share of it (a tiny CLIP on 4 rows split 2 x 2: x0.585 of the loss, the
gradient off by 60 % of its norm). No count fixes that, so the loss is computed on the embeddings of the whole step:

- **DataParallel**: each replica returns only its rows' two embeddings (`[rows, dim]`, cheap); the loss is computed
  on GPU 0 from all of them, and its gradient flows back into the replicas through torch's gather.
- **DDP**: the embeddings of every rank are gathered (without gradient) and this rank's own rows put back in
  their place with their graph; each rank computes the loss of the whole batch. The gradient of this rank's rows is
  scaled by the world size, which DDP's averaging divides again; the loss's own parameters (the logit scale, SigLIP's
  bias) get the whole loss's gradient on every rank, which averaging keeps.
- **Gradient accumulation** (G > 1 micro-batches): a cached two-pass, as GradCache does. At the step's first
  micro-batch every micro-batch of the step is embedded without gradient (one more forward each, without
  activations kept); the whole step's loss and its gradient with respect to every embedding (and to the loss's own
  parameters) are computed once; then each micro-batch runs again with gradient, under the random state of its first
  pass (so dropout draws the same masks), and back-propagates `sum(embedding * cached gradient)`: the gradient of the
  whole step's loss. Its cost is one more forward without gradient per micro-batch (`benchmarks.contrastive`).
  `contrastive_negatives="micro_batch"` keeps stock's per-micro-batch negatives instead (with a warning).

The model judges the reconstruction: the first forward asks for the model's own loss on its rows (each replica's,
each rank's), and the loss recomputed from the embeddings must equal it. A contrastive model whose loss is another
(an unknown variant) falls back to the stock loss with a warning naming both values.

```python
from hf_parallel.exact import ExactLoss, RunContext, count_step, micro_batch_loss

exact = ExactLoss()
head = exact.head(clip_model, batch)  # ContrastiveHead(name='contrastive/clip')
step = count_step(exact, head, [batch])
loss, _ = micro_batch_loss(exact, clip_model, head, batch, step, RunContext())  # what one device gives on all rows
```
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..data_parallel.replicas import run_in_replicas
from .compare import tolerance
from .heads.base import index_in_step
from .heads.contrastive import ContrastiveHead

__all__ = ["CONTRASTIVE_NEGATIVES", "contrastive_loss"]

#: The values of `TrainingArguments.contrastive_negatives`: "step", every row of the optimizer step (exact);
#: "micro_batch", the rows of each micro-batch (over every device), as stock's gradient accumulation has them.
CONTRASTIVE_NEGATIVES = ("step", "micro_batch")


@dataclass
class _Cache:
    """The first pass of a step under gradient accumulation: the gradient of the whole step's loss with respect to
    each micro-batch's embeddings and to the loss's parameters, the loss, and each micro-batch's random state."""

    step: Any  # the StepCounts of `hf_parallel.exact.step`, whose `batches` these are
    gradients: list[tuple[torch.Tensor, torch.Tensor]]
    parameter_gradients: list[torch.Tensor]
    loss: torch.Tensor
    random_states: list[Any]


def _embed(head: ContrastiveHead, check: bool, source: Any, run, inputs: dict, labels: dict):
    """One forward's two embeddings, and where `check`, the model's own loss on its rows and the loss recomputed from
    them (each `[1]`): run where the outputs are, in a DataParallel replica on its rows."""
    outputs = run(**inputs, return_loss=check)
    text, other = (outputs[key].float() for key in head.variant.keys)
    own = recomputed = torch.full((1,), float("nan"), device=text.device)
    if check:
        loss = outputs.get("loss") if isinstance(outputs, dict) else None
        if torch.is_tensor(loss) and loss.numel() == 1:
            own = loss.float().reshape(1)
            # In a replica, its own copies of the scale parameters (the replica itself, through `run`).
            source = run if source is None else source
            with torch.no_grad():
                recomputed = head.variant.loss(source, text, other).reshape(1)
    return text, other, own, recomputed


def contrastive_loss(
    exact, model: nn.Module, head: ContrastiveHead, inputs: dict, step, context, return_outputs, real
):
    """
    The loss of one micro-batch of a contrastive model: that of the whole step's rows, over every device (training:
    its share, `loss / G` per micro-batch, with the gradient of the whole step), or of this batch over every device
    (evaluation: its loss added to the evaluation totals, their mean over batches at the end). Its rows from `real` on
    (an epoch's padding) are left out. Returns the loss and the outputs (the two embeddings of this forward's rows)
    when `return_outputs`.
    """
    owner = model if context.owner is None else context.owner
    source = exact.unwrap(owner)
    state = exact.coupled.setdefault(exact.key(owner), {"checked": False, "cache": None})
    batch = _model_inputs(inputs)
    micro_batches = step.micro_batches if step is not None else 1
    if micro_batches > 1 and exact.contrastive_negatives == "step":
        return _second_pass(
            exact, model, owner, source, head, inputs, batch, real, step, context, state, return_outputs
        )
    if micro_batches > 1:
        exact.warn_once(
            f"exact_loss: contrastive_negatives='micro_batch': the {head.variant.name} loss of each micro-batch takes "
            f"only its own rows (over every device) as negatives, not those of the {micro_batches} micro-batches of "
            "the step, as stock does; its loss and gradient are not those of one device on the whole step. "
            "contrastive_negatives='step' (the default) makes them exact at the cost of one forward without gradient "
            "per micro-batch."
        )
    text, other, own, recomputed = _forward(exact, model, head, batch, context, not state["checked"], source)
    if not state["checked"] and not _verdict(exact, owner, head, own, recomputed, state):
        return own.mean() / micro_batches, _outputs(head, text, other, return_outputs)
    text, other = text[:real], other[:real]
    loss = head.variant.loss(source, *(_everyones(part, exact.engine) for part in (text, other)))
    if step is None and exact.evaluation.running:
        # Evaluation: this batch over every device as one batch, each row once (the duplicates the sampler added to
        # fill the last batch cut first, `real`): every rank's rows as they are; every rank adds the same loss, once.
        exact.evaluation.add_loss(head, loss)
    return loss / micro_batches, _outputs(head, text, other, return_outputs)


def _model_inputs(inputs: dict) -> dict:
    """The model's inputs without `return_loss`."""
    return {key: value for key, value in inputs.items() if key != "return_loss"}


def _forward(exact, model, head, batch, context, check: bool, source) -> tuple[torch.Tensor, ...]:
    """The two embeddings of `batch` (gathered from the replicas under DataParallel) and, where `check`, each
    replica's own loss and recomputed one."""
    if exact.engine.replicas:
        return run_in_replicas(model, functools.partial(_embed, head, check, None), batch, {}, context.autocast_dtype)
    return _embed(head, check, source, model, batch, {})


def _verdict(exact, owner, head, own: torch.Tensor, recomputed: torch.Tensor, state: dict) -> bool:
    """
    Whether the loss recomputed from the embeddings is the model's own on every replica and rank (every rank decides
    alike). If not, the model falls back to the stock loss, warned once with both values.
    """
    bound = tolerance(own.dtype) * own.detach().abs() + 1e-6
    misses = ((recomputed - own.detach()).abs() > bound) | own.isnan() | recomputed.isnan()
    # The misses, the sums of the two losses, and one for this rank: added over the engine's ranks.
    votes = [part.double().nan_to_num(0).sum() for part in (misses, own.detach(), recomputed)]
    votes = exact.engine.add_counts(torch.stack([*votes, torch.ones((), dtype=torch.float64, device=own.device)]))
    state["checked"] = True
    if float(votes[0]) == 0:
        return True
    name = type(exact.unwrap(owner)).__name__
    replicas = max(float(votes[3]), 1.0)
    exact.forget_head(owner)
    exact.warn_fallback(
        f"{name}'s own contrastive loss ({float(votes[1]) / replicas:.6g}) is not the {head.variant.name} loss "
        f"recomputed from its {head.variant.keys[0]} and {head.variant.keys[1]} ({float(votes[2]) / replicas:.6g}): "
        "hf_parallel does not know this variant, so each device keeps its own rows as negatives."
    )
    return False


class _ScaleGradient(torch.autograd.Function):
    """The identity, whose gradient is multiplied by `scale`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):
        return gradient * ctx.scale, None


def _everyones(own: torch.Tensor, engine) -> torch.Tensor:
    """
    The rows of every rank of the `engine`'s group, in rank order, this rank's with their graph and a gradient
    scaled by their number (which DDP's averaging divides again); `own` itself in one process. Ranks may hold
    different numbers of rows.
    """
    if engine.count_ranks == 1:
        return own
    parts = engine.gather_rows(own.detach())
    parts[engine.rank] = _ScaleGradient.apply(own, float(engine.count_ranks))
    return torch.cat(parts)


def _outputs(head: ContrastiveHead, text: torch.Tensor, other: torch.Tensor, wanted: bool):
    return {head.variant.keys[0]: text, head.variant.keys[1]: other} if wanted else None


# ---- Gradient accumulation: the cached two-pass ----
def _random_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_random_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _first_pass(exact, model, owner, source, head, step, context, state) -> _Cache | None:
    """Embed every micro-batch of the step without gradient, then the whole step's loss and its gradients (None: the
    check fell back to the stock loss)."""
    batches = step.batches
    if not batches:
        raise RuntimeError("contrastive loss: the step's micro-batches were not counted (`count_step`).")
    random_states, texts, others = [], [], []
    for batch, real in zip(batches, step.real_rows or (None,) * len(batches), strict=True):
        random_states.append(_random_state())
        inputs = _model_inputs(batch)
        check = not state["checked"]
        with torch.no_grad():
            text, other, own, recomputed = _forward(exact, model, head, inputs, context, check, source)
        if check and not _verdict(exact, owner, head, own, recomputed, state):
            _set_random_state(random_states[0])
            return None
        texts.append(text[:real])
        others.append(other[:real])
    _set_random_state(random_states[0])
    text, other = (torch.cat(parts).requires_grad_(True) for parts in (texts, others))
    parameters = [getattr(source, name) for name in head.variant.parameters]
    with torch.enable_grad():
        everyone = [_everyones(part, exact.engine) for part in (text, other)]
        loss = head.variant.loss(source, *everyone)
        # The rows' gradients come out x world (`_everyones`), ready for DDP's averaging.
        gradients = torch.autograd.grad(loss, [text, other, *parameters])
    sizes = [len(part) for part in texts]
    per_batch = list(zip(gradients[0].split(sizes), gradients[1].split(sizes), strict=True))
    return _Cache(step, per_batch, list(gradients[2:]), loss.detach(), random_states)


def _second_pass(exact, model, owner, source, head, inputs, batch, real, step, context, state, return_outputs):
    """This micro-batch again, with gradient: `sum(embeddings x cached gradients)` back-propagates the whole step's
    gradient through it; its value is the step's loss over its micro-batches."""
    cache = state["cache"]
    if cache is None or cache.step is not step:
        cache = state["cache"] = _first_pass(exact, model, owner, source, head, step, context, state)
        if cache is None:  # the check fell back: this micro-batch's own loss, as stock
            text, other, own, _ = _forward(exact, model, head, batch, context, True, source)
            return own.mean() / step.micro_batches, _outputs(head, text, other, return_outputs)
    index = index_in_step(step.batches, inputs, "contrastive loss")
    _set_random_state(cache.random_states[index])
    text, other, _, _ = _forward(exact, model, head, batch, context, False, source)
    text_gradient, other_gradient = cache.gradients[index]
    surrogate = (text[:real] * text_gradient).sum() + (other[:real] * other_gradient).sum()
    for name, gradient in zip(head.variant.parameters, cache.parameter_gradients, strict=True):
        # The loss's own parameters: the whole gradient over the step, a 1/G share per micro-batch.
        surrogate = surrogate + (getattr(source, name) * gradient).sum() / step.micro_batches
    loss = surrogate - surrogate.detach() + cache.loss / step.micro_batches
    if index == len(step.batches) - 1:
        state["cache"] = None
    return loss, _outputs(head, text, other, return_outputs)
