"""
What one checked forward says about the candidate heads: its rows' loss as the model computes it, against what each
candidate computes from the same logits (`replica_check`; in a DataParallel replica, for its own rows).

A candidate fits when its mean S / C is the model's loss within `tolerance`, or, where the forward was given a count N
(`num_items_in_batch`; the probe of `hf_parallel.exact.checked` gives 2C + 1/2), its sum S / N: the loss then honours
the count. Without logits (a loss fused with the LM head) only the honouring can be told, from the loss of a second
forward given 2N: S / N halves, a mean does not. The candidates are computed without autograd: the check forward is
only compared, never back-propagated (`hf_parallel.exact.checked`).

```python
from hf_parallel.exact.compare import candidate_heads, replica_check

candidates = candidate_heads(head)
outputs = model(**inputs, **labels)  # the model's own loss in outputs.loss
check = replica_check(candidates, outputs, sample_terms)  # a ReplicaCheck, [1, ...] tensors
```
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ..saving.unwrap import unwrap_model
from .heads import HeadMismatch, LossHead, Route
from .resolve import inside_adapters

__all__ = [
    "ReplicaCheck",
    "accepts_item_count",
    "can_use_model_loss",
    "candidate_heads",
    "compared_head",
    "fused_outputs",
    "model_loss",
    "probe_count",
    "replica_check",
    "tolerance",
]

# Relative tolerance of the comparison, by the dtype of the model's loss. The model's loss and a head's are computed
# from the same logits, so in float32 they differ by the order of a sum (~1e-6 relative over a batch); a loss
# computed and rounded in bfloat16/float16 is off by up to half its last bit (2^-9 ~ 0.2%). A wrong head is further
# off: an unshifted cross-entropy instead of a shifted one differs by percents even on an untrained tiny model.
_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}

# A head's `[samples, terms]` loss sums and item counts (not `hf_parallel.exact.terms.Terms`, a forward's whole).
SampleTerms = tuple[torch.Tensor, torch.Tensor]


def probe_count(items: torch.Tensor) -> torch.Tensor:
    """
    The `num_items_in_batch` a checked forward of a micro-batch with `items` items passes: 2C + 1/2, in float32 (see
    the module docstring): never a whole number, so no count of items, and twice C, so that S / N and S / C differ at
    every size and precision.
    """
    return items.float() * 2.0 + 0.5


def can_use_model_loss(head: LossHead | None, model: nn.Module) -> bool:
    """
    Whether the model's own loss could be the exact one for `head`: a per-position cross-entropy without label
    smoothing (the model's loss has none), no user loss, and a forward that takes `num_items_in_batch`. Whether the
    loss honours the count is for the check's forward to show (`replica_check`).
    """
    return (
        head is not None
        and head.ignore_index_items
        and head.per_position
        and not head.smoothing
        and head.route is not Route.USER_LOSS
        and head.router is None  # the model's loss adds a router term of its own rows only
        and accepts_item_count(model)
    )


def accepts_item_count(model: nn.Module) -> bool:
    """
    Whether `model` (out of its wrappers) may be given `num_items_in_batch`: its `accepts_loss_kwargs` where it sets
    one, else whether its `forward` (an instance's own, as Liger patches it, or its class's) takes it or `**kwargs`.
    """
    inner, _ = inside_adapters(unwrap_model(model))  # PEFT: its forward passes **kwargs on to the model's
    flag = getattr(inner, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return flag
    # An instance's own forward first (Liger patches the instance), else its class's.
    return _takes_count(getattr(inner.forward, "__func__", inner.forward))


@functools.lru_cache(maxsize=256)
def _takes_count(forward: Callable) -> bool:
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "num_items_in_batch" or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


class ReplicaCheck(NamedTuple):
    """
    What one forward (one replica's rows) says; `[1, ...]` tensors, not 0-dim, so that DataParallel gathers one row
    per replica (a NamedTuple: its `gather` and `scatter` keep the type).

    Args:
        fits (`torch.Tensor`): `[1, K]`: 1 where candidate k fits the model's loss, 0 where not, NaN where it could not
            be compared (no model loss, no logits, a term without items).
        losses (`torch.Tensor`): `[1, 2]` float64: the model's loss and the first candidate's, as means (warnings).
        honours (`torch.Tensor`): `[1, 1]`: 1 where the loss divided by the count it was given, 0 where not, NaN where
            not known.
        decoder (`torch.Tensor`): `[1, 1]`: 1 where the model built the decoder inputs the labels give, 0 where it
            built others, NaN where not known.
    """

    fits: torch.Tensor
    losses: torch.Tensor
    honours: torch.Tensor
    decoder: torch.Tensor


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of a comparison with a model loss of `dtype`."""
    return _TOLERANCE.get(dtype, 1e-2)  # bfloat16, float16


def candidate_heads(head: LossHead) -> tuple[LossHead, ...]:
    """
    `head`, then the other heads its labels and logits could mean: for a per-position cross-entropy, the same with the
    causal shift toggled (standalone decoders of encoder-decoder families and XLNet do not shift).
    """
    if not head.shift_ambiguous:
        return (head,)
    other = copy.copy(head)
    other.shift = not head.shift
    other.name = f"{head.name}/{'shifted' if other.shift else 'unshifted'}"
    return (head, other)


def compared_head(head: LossHead) -> LossHead:
    """The head whose loss is compared with the model's: without label smoothing, which the model's loss lacks."""
    if not head.smoothing:
        return head
    plain = copy.copy(head)
    plain.smoothing = 0.0
    return plain


def model_loss(outputs) -> torch.Tensor | None:
    """The model's own loss in its outputs, or None when it returned none."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else None
    return loss if torch.is_tensor(loss) and loss.numel() == 1 else None


def fused_outputs(outputs) -> bool:
    """Whether a forward's outputs hold no logits (a loss fused with the LM head, Liger's), only its loss."""
    return isinstance(outputs, dict) and not torch.is_tensor(outputs.get("logits"))


def replica_check(
    candidates: tuple[LossHead, ...],
    outputs,
    sample_terms: Callable[[LossHead], SampleTerms],
    known: dict[LossHead, SampleTerms] | None = None,
    count: torch.Tensor | None = None,
    decoder: torch.Tensor | None = None,
    on_mismatch: Callable[[str], None] | None = None,
    router: torch.Tensor | None = None,
    doubled: torch.Tensor | None = None,
) -> ReplicaCheck:
    """
    What one forward of `candidates` (from `candidate_heads`) says, as a `ReplicaCheck`; the candidates' terms are
    computed without autograd (only compared).

    Args:
        candidates (`tuple[LossHead, ...]`): the chosen head, then the others it could be.
        outputs (`ModelOutput`): the forward's outputs, computed with the labels.
        sample_terms (`Callable`): `[samples, terms]` loss sums and item counts of a head on these outputs.
        known (`dict`, *optional*): terms computed already, by their head.
        count (`torch.Tensor`, *optional*): the `num_items_in_batch` the model was given (no whole number).
        decoder (`torch.Tensor`, *optional*): `[1, 1]`, whether the model built the decoder inputs the labels give.
        on_mismatch (`Callable`, *optional*): told why a candidate could not be computed from these outputs
            (`HeadMismatch`: it then does not fit).
        router (`torch.Tensor`, *optional*): the router term a MoE model adds to its loss on these rows
            (`hf_parallel.exact.heads.router`), added to every candidate's.
        doubled (`torch.Tensor`, *optional*): without logits, the model's loss on the same rows given twice `count`.
    """
    # By the head itself, not its id: a compared copy freed after use could pass its id on to the next one.
    computed = dict(known or {})
    mismatched: set[LossHead] = set()
    # The device of the outputs: that of their first tensor.
    values = outputs.values() if isinstance(outputs, dict) else outputs
    device = next((value.device for value in values if torch.is_tensor(value)), torch.device("cpu"))

    def terms_of(head: LossHead) -> SampleTerms:
        if head not in computed:
            try:
                with torch.no_grad():
                    computed[head] = sample_terms(head)
            except HeadMismatch as mismatch:
                # Its loss cannot be computed from these outputs: it does not fit (zeros only stand in for its terms).
                mismatched.add(head)
                if on_mismatch is not None:
                    on_mismatch(str(mismatch))
                empty = torch.zeros(1, head.num_terms, device=device)
                computed[head] = (empty, empty.long())
        return computed[head]

    # Only a forward given a count (a per-position cross-entropy's) may have fused its loss and built no logits.
    has_logits = count is None or not fused_outputs(outputs)
    first = terms_of(candidates[0])
    # NaN where the forward returned no loss (or nothing could be compared).
    fits = torch.full((1, len(candidates)), float("nan"), device=device)
    losses = torch.full((1, 2), float("nan"), dtype=torch.float64, device=device)
    honours = torch.full((1, 1), float("nan"), device=device)
    loss = model_loss(outputs)
    n = float(count.detach()) if count is not None else None
    if loss is not None:
        if has_logits:
            extra = float(router) if router is not None else 0.0
            honours[0, 0] = _compare(candidates, terms_of, loss, n, fits, losses, mismatched, extra)
        else:  # without logits no other candidate can be computed (nor chosen: it cannot fit)
            honours[0, 0] = _halves(loss, doubled)
        mean = loss * (n / max(int(first[1].sum()), 1)) if honours[0, 0] == 1 else loss  # S / N: its mean is S / C
        losses[0, 0] = mean.detach().double()
    decoder = decoder.to(device) if decoder is not None else torch.full((1, 1), float("nan"), device=device)
    return ReplicaCheck(fits, losses, honours, decoder)


def _compare(
    candidates, terms_of, loss: torch.Tensor, n: float | None, fits, losses, mismatched, extra: float = 0.0
) -> float:
    """
    Fill `fits` (whether the loss is each candidate's mean, or its sum / `n` where a count `n` was given; 0 for one
    `mismatched` with the outputs) and the first candidate's mean in `losses`; return whether the loss divided by the
    count (1 or 0; NaN where nothing fitted or no count was given). `extra`, the router term of a MoE model, is added
    to every candidate's loss.
    """
    reference = loss.detach().double()
    divided: dict[int, bool] = {}  # per candidate that fits: whether the loss is its sum / n (else its mean)
    for k, candidate in enumerate(candidates):
        compared = compared_head(candidate)
        sums, counts = terms_of(compared)
        if compared in mismatched or candidate in mismatched:
            fits[0, k] = 0.0
            continue
        sums, counts = sums.detach().sum(0).double(), counts.sum(0)
        value = candidate.combine(sums, counts) + extra
        if k == 0:
            losses[0, 1] = value
        if bool(counts.eq(0).any()) or not bool(torch.isfinite(reference)):
            continue
        bound = tolerance(loss.dtype) * reference.abs() + 1e-7
        as_mean = bool((value - reference).abs() <= bound)
        # Only per-position cross-entropies are given a count: one term, its sum / N.
        as_sum = n is not None and bool((sums.sum() / n + extra - reference).abs() <= bound)
        fits[0, k] = float(as_mean or as_sum)
        if as_sum or as_mean:
            divided[k] = as_sum
    return float(all(divided.values())) if n is not None and divided else float("nan")


def _halves(loss: torch.Tensor, doubled: torch.Tensor | None) -> float:
    """
    Whether `loss`, given a count N, is a sum divided by it: given 2N (`doubled`, the same rows' loss) it halves, where
    a mean keeps its value. 1 or 0; NaN without the second loss, or where the loss is 0 (no items tell).
    """
    if doubled is None or float(loss) == 0:
        return float("nan")
    bound = tolerance(loss.dtype) * abs(float(loss)) + 1e-12
    return float(abs(2 * float(doubled) - float(loss)) <= bound)
