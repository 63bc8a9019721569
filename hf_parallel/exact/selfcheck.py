"""
The model is the judge of its own loss: a check of the head hf_parallel chose against the loss the model computes.

The head of a model is chosen from its class name (`hf_parallel.exact.resolve`), and the loss is then recomputed
from the logits on that assumption. A class name cannot know every model's loss: several `*ForCausalLM` decoders
compute an unshifted cross-entropy, some models add a loss their logits do not carry. So the first forward that
uses a head for a model keeps the labels in the model's inputs: the model returns its own loss next to its logits
(no extra forward), and it is compared with what each candidate head (`candidate_heads`: the chosen one, then the
others the same labels and logits could mean) gives on the same rows. The model's own loss, given no
`num_items_in_batch`, is the mean over its rows: S / C of that batch, which is what a head's `combine` of that
batch's sums and counts gives. Under DataParallel each replica compares its own rows' loss (`replica_check`);
under DDP the votes of every rank are summed before the decision (`decide`), so that every rank keeps the same
head.

A candidate fits when it is within `tolerance` of the model's loss on every replica and rank that could compare. The
decision: the chosen head fits and no other does: it is confirmed; another one fits instead: it replaces the chosen
head (for this micro-batch already, with the step recounted); none fits: the stock loss, with one warning; no
comparison possible (a batch without items, a model that returns no loss) or more than one candidate fits (an
untrained model whose logits hardly depend on the position): checked again at the next forward, up to
`MAX_CHECKS` times.

```python
from hf_parallel.exact.selfcheck import candidate_heads, decide, replica_check

candidates = candidate_heads(head)
outputs = model(**inputs, **labels)  # the model's own loss in outputs.loss
check = replica_check(candidates, outputs, sample_terms)  # per replica
verdict = decide(candidates, check)  # the head to keep, or None
```
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .heads import CrossEntropyHead, LossHead

__all__ = ["MAX_CHECKS", "Verdict", "candidate_heads", "compared_head", "decide", "replica_check", "tolerance"]

#: How many forwards may fail to tell the candidates apart before the chosen head is kept as it is.
MAX_CHECKS = 8

# Relative tolerance of the comparison, by the dtype of the model's loss. The model's loss and a head's are computed
# from the same logits, so in float32 they differ by the order of a sum (~1e-6 relative over a batch); a loss
# computed and rounded in bfloat16/float16 is off by up to half its last bit (2^-9 ~ 0.2%). A wrong head is further
# off: an unshifted cross-entropy instead of a shifted one differs by percents even on an untrained tiny model.
_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
_HALF_TOLERANCE = 1e-2


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of a comparison with a model loss of `dtype`."""
    return _TOLERANCE.get(dtype, _HALF_TOLERANCE)


def candidate_heads(head: LossHead) -> tuple[LossHead, ...]:
    """
    `head`, then the other heads its labels and logits could mean: for a per-position cross-entropy, the same with the
    causal shift toggled (standalone decoders of encoder-decoder families and XLNet do not shift).
    """
    if not isinstance(head, CrossEntropyHead) or not head.per_position or head.name.startswith("seq2seq_lm"):
        return (head,)
    other = copy.copy(head)
    other.shift = not head.shift
    other.name = f"{head.name}/{'shifted' if other.shift else 'unshifted'}"
    return (head, other)


def compared_head(head: LossHead) -> LossHead:
    """The head whose loss is compared with the model's: without label smoothing, which the model's loss lacks."""
    if not getattr(head, "smoothing", 0):
        return head
    plain = copy.copy(head)
    plain.smoothing = 0.0
    return plain


def model_loss(outputs) -> torch.Tensor | None:
    """The model's own loss in its outputs, or None when it returned none."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else None
    return loss if torch.is_tensor(loss) and loss.numel() == 1 else None


def replica_check(
    candidates: tuple[LossHead, ...],
    outputs,
    sample_terms: Callable[[LossHead], tuple[torch.Tensor, torch.Tensor]],
    known: dict[LossHead, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """
    What one forward (one DataParallel replica's rows) says about the candidates: `check_fits` `[1, K]`, 1 where
    candidate k is within `tolerance` of the model's loss, 0 where it is not, NaN where the comparison is not possible
    (no model loss, a term without items, whose mean is NaN); `check_losses` `[1, 2]`, the model's loss and the first
    candidate's, for the warning; `model_loss` `[1]`, the model's loss itself (with its graph: the stock loss of this
    forward if no candidate fits); `sums_k` and `counts_k`, the terms of candidate k > 0, in case it is chosen.
    `[1, ...]`, not 0-dim, so that DataParallel gathers one row per replica; the same keys from every replica.

    Args:
        candidates (`tuple[LossHead, ...]`): from `candidate_heads`.
        outputs (`ModelOutput`): the forward's outputs, computed with the labels.
        sample_terms (`Callable`): `[samples, terms]` loss sums and item counts of a head on these outputs.
        known (`dict`, *optional*): terms computed already, by their head.
    """
    # By the head itself, not its id: a compared copy freed after use could pass its id on to the next one.
    computed = dict(known or {})

    def terms_of(head: LossHead) -> tuple[torch.Tensor, torch.Tensor]:
        if head not in computed:
            computed[head] = sample_terms(head)
        return computed[head]

    check = {}
    for k, candidate in enumerate(candidates[1:], 1):
        check[f"sums_{k}"], check[f"counts_{k}"] = terms_of(candidate)
    device = terms_of(candidates[0])[0].device
    loss = model_loss(outputs)
    fits = torch.full((1, len(candidates)), float("nan"), device=device)
    losses = torch.full((1, 2), float("nan"), dtype=torch.float64, device=device)
    check.update(check_fits=fits, check_losses=losses)
    if loss is None:
        return {**check, "model_loss": torch.zeros(1, device=device)}
    reference = loss.detach().double()
    losses[0, 0] = reference
    for k, candidate in enumerate(candidates):
        sums, counts = terms_of(compared_head(candidate))
        sums, counts = sums.detach().sum(0), counts.sum(0)
        value = candidate.combine(sums.double(), counts)
        if k == 0:
            losses[0, 1] = value
        if bool(counts.eq(0).any()) or not bool(torch.isfinite(reference)):
            continue
        bound = tolerance(loss.dtype) * reference.abs() + 1e-7
        fits[0, k] = float((value - reference).abs() <= bound)
    return {**check, "model_loss": loss.reshape(1)}


@dataclass(frozen=True)
class Verdict:
    """
    What the votes decided: `index` of the candidate to use (None: no candidate fits, the stock loss), whether the
    decision is `final` (False: the check runs again at the next forward), and the mean `model_loss` and
    `head_loss` (of the first candidate) over the comparisons, for the warning.
    """

    index: int | None
    final: bool
    model_loss: float
    head_loss: float


def decide(
    candidates: tuple[LossHead, ...],
    checks: dict[str, torch.Tensor],
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Verdict:
    """
    Decide from the gathered `replica_check` results of every replica (and, with `reduce_sum`, of every rank: every
    rank then decides the same).

    Args:
        candidates (`tuple[LossHead, ...]`): the candidates the checks compared.
        checks (`dict`): `check_fits` `[replicas, K]` and `check_losses` `[replicas, 2]`.
        reduce_sum (`Callable`, *optional*): sums a tensor over the DDP ranks.
    """
    fits, losses = checks["check_fits"].detach().double(), checks["check_losses"].detach().double()
    compared = ~torch.isnan(fits).any(-1)
    votes = torch.cat(
        [
            fits.nan_to_num(0.0).sum(0),  # replicas where candidate k fits
            (fits == 0).double().sum(0),  # replicas where it does not
            compared.double().sum().reshape(1),
            losses.nan_to_num(0.0).sum(0),
            (~torch.isnan(losses[:, 0])).double().sum().reshape(1),
        ]
    )
    if reduce_sum is not None:
        votes = reduce_sum(votes)
    k = len(candidates)
    fit, miss, comparisons = votes[:k], votes[k : 2 * k], float(votes[2 * k])
    seen = max(float(votes[-1]), 1.0)
    model_value, head_value = float(votes[2 * k + 1]) / seen, float(votes[2 * k + 2]) / seen
    if comparisons == 0:
        return Verdict(0, False, model_value, head_value)
    fitting = [i for i in range(k) if miss[i] == 0 and fit[i] > 0]
    if not fitting:
        return Verdict(None, True, model_value, head_value)
    return Verdict(fitting[0], len(fitting) == 1, model_value, head_value)


def _names(candidates: tuple[LossHead, ...]) -> str:
    return ", ".join(candidate.name for candidate in candidates)


def mismatch_reason(model, candidates: tuple[LossHead, ...], verdict: Verdict) -> str:
    """The warning of a model whose own loss no candidate head gives: the model, both losses, what to do."""
    name = type(getattr(model, "module", model)).__name__
    return (
        f"{name} computes its own loss {verdict.model_loss:.6g} on a batch where the loss recomputed from its "
        f"logits as {candidates[0].name} gives {verdict.head_loss:.6g} (also tried: {_names(candidates[1:]) or 'none'}"
        "): its loss is not one hf_parallel can recompute (it adds a term the logits do not carry, or counts other "
        "items). If the model's loss is the one to train on, this fallback is right; to train on "
        f"{candidates[0].name} instead, pass it as compute_loss_func."
    )


def undecided_reason(model, candidates: tuple[LossHead, ...], verdict: Verdict, checks: int) -> str:
    """The warning of a model whose own loss could not tell the candidate heads apart in `checks` forwards."""
    name = type(getattr(model, "module", model)).__name__
    return (
        f"exact_loss: in {checks} forwards the own loss of {name} ({verdict.model_loss:.6g} in the mean) could not "
        f"tell the heads {_names(candidates)} apart (several were within the tolerance, or no batch had items); "
        f"keeping {candidates[0].name}."
    )
