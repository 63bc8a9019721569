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

The checked forward of an encoder-decoder LM's head (`builds_decoder_inputs`) also compares the decoder inputs the
model builds itself with those the later forwards get, built from the labels (`hf_parallel.exact.decoder`): where
they differ on a replica of any rank, the head keeps the labels in the forward from then on (`LabelsInForwardHead`).
`SelfCheck` holds the check's methods of `ExactLoss`.

The same forward tells whether the model's loss honours `num_items_in_batch`, where it may be given one
(`hf_parallel.exact.forward`): it is then given N = 2C + 1/2 (C its items). A loss that divides its sum by that is
S / N: with logits, S is a candidate's sum; without (a fused loss), its gradient with respect to the count is -S / N^2,
and a loss that ignores the count is S / C, about twice as large, whatever C and the loss's precision. Where
every replica and rank that could tell says it honours the count, the head takes the model's own loss from then on
(`with_model_loss`); a forward without logits whose loss ignores the count cannot be made exact (the stock loss).

```python
from hf_parallel.exact.selfcheck import candidate_heads, decide, replica_check

candidates = candidate_heads(head)
outputs = model(**inputs, **labels)  # the model's own loss in outputs.loss
check = replica_check(candidates, outputs, sample_terms)  # per replica
verdict = decide(candidates, check)  # the head to keep, or None
```
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import logging

from .counts import StepCounts
from .decoder import DecoderInputsWatch, keeping_labels_in_forward, needs_decoder_inputs, watch_decoder
from .heads import CrossEntropyHead, LossHead
from .remainder import REAL_ROWS_KEY

__all__ = [
    "MAX_CHECKS",
    "SelfCheck",
    "Verdict",
    "candidate_heads",
    "compared_head",
    "decide",
    "fused_outputs",
    "replica_check",
    "takes_gradient_from_loss",
    "tolerance",
    "with_model_loss",
]

logger = logging.get_logger("hf_parallel.trainer")

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


def fused_outputs(outputs) -> bool:
    """Whether a forward's outputs hold no logits (a loss fused with the LM head, Liger's), only its loss."""
    return isinstance(outputs, dict) and not torch.is_tensor(outputs.get("logits"))


def with_model_loss(head: LossHead) -> LossHead:
    """`head`, taking the model's own loss (given its labels and the step's count) instead of recomputing it."""
    own = copy.copy(head)
    own.uses_model_loss = True
    own.name = f"{head.name}/model_loss"
    return own


def replica_check(
    candidates: tuple[LossHead, ...],
    outputs,
    sample_terms: Callable[[LossHead], tuple[torch.Tensor, torch.Tensor]],
    known: dict[LossHead, tuple[torch.Tensor, torch.Tensor]] | None = None,
    count: torch.Tensor | None = None,
    gradient_from_loss: bool = False,
) -> dict[str, torch.Tensor]:
    """
    What one forward (one DataParallel replica's rows) says about the candidates: `check_fits` `[1, K]`, 1 where
    candidate k is within `tolerance` of the model's loss, 0 where it is not, NaN where the comparison is not possible
    (no model loss, no logits, a term without items, whose mean is NaN); `check_losses` `[1, 2]`, the model's loss and
    the first candidate's, for the warning (means); `check_honours` `[1, 1]`, 1 where the loss divided its sum by
    `count`, 0 where it did not, NaN where not known or no `count` was given; `model_loss` `[1]`, the model's loss as
    the mean of its items (with its graph: the stock loss of this forward if no candidate fits); `sums_k` and
    `counts_k`, the terms of candidate k > 0, in case it is chosen; and, where autograd is on, `graph_sums` `[1, K]`:
    candidate k's loss sum S_k with the graph to back-propagate if it is chosen. `[1, ...]`, not 0-dim, so that
    DataParallel gathers one row per replica; the same keys from every replica.

    Args:
        candidates (`tuple[LossHead, ...]`): from `candidate_heads`.
        outputs (`ModelOutput`): the forward's outputs, computed with the labels.
        sample_terms (`Callable`): `[samples, terms]` loss sums and item counts of a head on these outputs.
        known (`dict`, *optional*): terms computed already, by their head.
        count (`torch.Tensor`, *optional*): the `num_items_in_batch` the model was given (no whole number).
        gradient_from_loss (`bool`, *optional*): whether S_k is the model's own loss times what it divided by (the
            candidates' terms were computed without autograd: `takes_gradient_from_loss`), not candidate k's sums.
    """
    # By the head itself, not its id: a compared copy freed after use could pass its id on to the next one.
    computed = dict(known or {})
    # Only a forward given a count (a per-position cross-entropy's) may have fused its loss and built no logits.
    has_logits = count is None or not fused_outputs(outputs)

    def terms_of(head: LossHead) -> tuple[torch.Tensor, torch.Tensor]:
        if head not in computed:
            computed[head] = sample_terms(head)
        return computed[head]

    first = terms_of(candidates[0])
    check = {}
    for k, candidate in enumerate(candidates[1:], 1):
        # Without logits no other candidate can be computed (nor chosen: it cannot fit); same keys all the same.
        check[f"sums_{k}"], check[f"counts_{k}"] = terms_of(candidate) if has_logits else first
    device = first[0].device
    loss = model_loss(outputs)
    fits = torch.full((1, len(candidates)), float("nan"), device=device)
    losses = torch.full((1, 2), float("nan"), dtype=torch.float64, device=device)
    honours = torch.full((1, 1), float("nan"), device=device)
    check.update(check_fits=fits, check_losses=losses, check_honours=honours)
    divisors: list[float | None] = [None] * len(candidates)
    if loss is not None:
        n = float(count.detach()) if count is not None else None
        if not has_logits:
            honours[0, 0] = _honours_by_gradient(loss, count)
        else:
            honours[0, 0] = _compare(candidates, terms_of, loss, n, fits, losses, divisors)
        mean = loss
        if honours[0, 0] == 1:  # S / N: the mean of its items is S / C
            mean = loss * (n / max(int(first[1].sum()), 1))
        losses[0, 0] = mean.detach().double()
    check["model_loss"] = mean.reshape(1) if loss is not None else torch.zeros(1, device=device)
    if torch.is_grad_enabled():
        terms = [terms_of(c) if has_logits else first for c in candidates]
        sums, counts = [t[0] for t in terms], [t[1] for t in terms]
        check["graph_sums"] = _graph_sums(sums, counts, loss, divisors, gradient_from_loss)
    return check


def takes_gradient_from_loss(head: LossHead, outputs) -> bool:
    """
    Whether a checked forward can take the gradient of its micro-batch from the model's own loss instead of a
    recomputed head (whose log-softmax would be kept for the backward next to the model's: a logits-sized buffer more,
    GiBs for an LLM): training, a float32/64 loss with a graph, and a head of one term without label smoothing (a
    loss of several terms, or smoothed, cannot be read back from the model's mean). The candidates' sums are then
    computed without autograd, only to compare.
    """
    loss = model_loss(outputs)
    return (
        torch.is_grad_enabled()
        and not fused_outputs(outputs)  # a fused loss's terms are the model's own already (`model_terms`)
        and loss is not None
        and loss.requires_grad
        and loss.dtype in (torch.float32, torch.float64)
        and head.num_terms == 1
        and compared_head(head) is head
    )


def _graph_sums(sums, counts, loss, divisors, from_loss: bool) -> torch.Tensor:
    """
    `[1, K]`: the loss sum of each candidate to back-propagate. From the model's loss L (`from_loss`): L times its
    divisor where L fits (its items, or the count N it honours), 0 without items (no row of this replica counts:
    no gradient, as one device gives none for them), else L times the items (a candidate that does not fit here is
    never chosen). Otherwise the candidates' own sums.
    """
    if not from_loss:
        return torch.stack([s.sum() for s in sums]).reshape(1, -1)
    values = []
    for items, divisor in zip((c.sum() for c in counts), divisors, strict=True):
        if int(items) == 0:
            values.append(loss.new_zeros(()).float())
        else:
            values.append(loss.float() * (divisor if divisor is not None else items.to(loss.device).float()))
    return torch.stack(values).reshape(1, -1)


def _compare(candidates, terms_of, loss: torch.Tensor, n: float | None, fits, losses, divisors) -> float:
    """
    Fill `fits` (whether the loss is each candidate's mean, or its sum / `n` where a count `n` was given), what the
    loss divided each fitting candidate's sum by in `divisors`, and the first candidate's mean in `losses`; return
    whether the loss divided by the count (1 or 0; NaN where nothing fitted or no count was given).
    """
    reference = loss.detach().double()
    divided = []  # per candidate: whether the loss is its sum / count (given one), else whether it is its mean
    for k, candidate in enumerate(candidates):
        sums, counts = terms_of(compared_head(candidate))
        sums, counts = sums.detach().sum(0).double(), counts.sum(0)
        value = candidate.combine(sums, counts)
        if k == 0:
            losses[0, 1] = value
        if bool(counts.eq(0).any()) or not bool(torch.isfinite(reference)):
            continue
        bound = tolerance(loss.dtype) * reference.abs() + 1e-7
        as_mean = bool((value - reference).abs() <= bound)
        # Only per-position cross-entropies are given a count: one term, its sum / N.
        as_sum = n is not None and bool((sums.sum() / n - reference).abs() <= bound)
        fits[0, k] = float(as_mean or as_sum)
        if as_sum or as_mean:
            divided.append(as_sum)
            divisors[k] = n if as_sum else float(counts.sum())
    return float(all(divided)) if n is not None and divided else float("nan")


def _honours_by_gradient(loss: torch.Tensor, count: torch.Tensor | None) -> float:
    """
    Whether `loss` is a sum divided by `count`, from its gradient with respect to it: d(S / N)/dN = -(S / N) / N. 1 or
    0; NaN without a graph to ask (evaluation) or a count. Only the path from the loss to the count is walked.
    """
    if count is None or not (loss.requires_grad and count.requires_grad):
        return float("nan")
    (gradient,) = torch.autograd.grad(loss, count, retain_graph=True, allow_unused=True)
    if gradient is None:
        return 0.0
    # The expected gradient is taken from the loss as returned, rounded to its dtype: a half-precision loss is off from
    # the gradient (computed before rounding) by up to half its last bit. A loss that ignores the count has none.
    expected = -loss.detach().double() / float(count.detach())
    bound = tolerance(loss.dtype) * expected.abs() + 1e-12
    return float(bool((gradient.double() - expected).abs() <= bound))


@dataclass(frozen=True)
class Verdict:
    """
    What the votes decided: `index` of the candidate to use (None: no candidate fits, the stock loss), whether the
    decision is `final` (False: the check runs again at the next forward), the mean `model_loss` and `head_loss` (of
    the first candidate) over the comparisons, for the warning, and whether the model built other decoder inputs
    than those built from its labels on a replica of any rank (`decoder_differs`), and whether its loss divided by the
    count it was given on every replica that could tell, and on one at least (`honours_count`).
    """

    index: int | None
    final: bool
    model_loss: float
    head_loss: float
    decoder_differs: bool = False
    honours_count: bool = False


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
        checks (`dict`): `check_fits` `[replicas, K]`, `check_losses` `[replicas, 2]` and, optionally,
            `check_decoder` `[replicas, 1]` (1: the decoder inputs are those built from the labels, 0: they differ).
        reduce_sum (`Callable`, *optional*): sums a tensor over the DDP ranks.
    """
    fits, losses = checks["check_fits"].detach().double(), checks["check_losses"].detach().double()
    decoder = checks.get("check_decoder")
    honours = checks.get("check_honours")
    honours = fits.new_full((fits.shape[0], 1), float("nan")) if honours is None else honours.detach().double()
    # Replicas whose model built other decoder inputs; always a vote, so that every rank sums as many.
    other_decoder = fits.new_zeros(1) if decoder is None else (decoder.detach() == 0).to(fits).sum().reshape(1)
    compared = ~torch.isnan(fits).any(-1)
    votes = torch.cat(
        [
            fits.nan_to_num(0.0).sum(0),  # replicas where candidate k fits
            (fits == 0).double().sum(0),  # replicas where it does not
            compared.double().sum().reshape(1),
            losses.nan_to_num(0.0).sum(0),
            (~torch.isnan(losses[:, 0])).double().sum().reshape(1),
            other_decoder,
            (honours == 1).double().sum().reshape(1),
            (honours == 0).double().sum().reshape(1),
        ]
    )
    if reduce_sum is not None:
        votes = reduce_sum(votes)
    k = len(candidates)
    fit, miss, comparisons = votes[:k], votes[k : 2 * k], float(votes[2 * k])
    seen = max(float(votes[2 * k + 3]), 1.0)
    model_value, head_value = float(votes[2 * k + 1]) / seen, float(votes[2 * k + 2]) / seen
    differs = float(votes[2 * k + 4]) > 0
    honoured, ignored = float(votes[2 * k + 5]), float(votes[2 * k + 6])
    native = honoured > 0 and ignored == 0
    if comparisons == 0:
        if honoured + ignored > 0 and float(votes[2 * k + 3]) > 0:
            # No logits to compare (a fused loss), but its gradient told: the model's own loss, or none exact.
            return Verdict(0 if native else None, True, model_value, head_value, differs, native)
        return Verdict(0, False, model_value, head_value, differs)
    fitting = [i for i in range(k) if miss[i] == 0 and fit[i] > 0]
    if not fitting:
        return Verdict(None, True, model_value, head_value, differs)
    return Verdict(fitting[0], len(fitting) == 1, model_value, head_value, differs, native)


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


class SelfCheck:
    """
    The check's methods of `ExactLoss`, which holds the state they use: `_checks` (per cached head, the forwards that
    checked it, -1 once decided), `_decoder_watch` (during a checked forward), `_heads`, `_counted`, and its methods
    `_key`, `_sample_terms`, `count_step`, `unwrap`, `warn_fallback`, `warn_once`.
    """

    def pending_check(
        self, head: LossHead | None, model: nn.Module, inputs: dict, loss_func: Callable | None = None
    ) -> tuple[LossHead, ...] | None:
        """
        The candidate heads to compare with the model's own loss in the forward of `inputs` (the model then gets the
        labels), or None: decided already, a user loss (its own judge), or padding rows the model's loss would count.
        `head` is what `head(model)` returned; `loss_func` the Trainer's `compute_loss_func`.
        """
        if head is None or loss_func is not None:
            return None
        if REAL_ROWS_KEY in inputs and not isinstance(head, CrossEntropyHead):
            return None  # the model's loss would count the padding rows (a cross-entropy's targets are masked)
        return candidate_heads(head) if self._checks.get(self._key(model, None), 0) >= 0 else None

    @contextlib.contextmanager
    def watching_decoder(
        self, candidates: tuple[LossHead, ...] | None, model: nn.Module, inputs: dict
    ) -> Iterator[DecoderInputsWatch | None]:
        """
        Around the checked forward of `inputs` (`candidates` from `pending_check`; None: no check, nothing to do):
        records the decoder inputs the model builds itself, for `check_terms` to compare with those `split_labels`
        builds from the labels, when it builds any (`needs_decoder_inputs`).
        """
        watch = None
        if candidates is not None and needs_decoder_inputs(candidates[0], inputs):
            watch = watch_decoder(self.unwrap(model))
        self._decoder_watch = watch
        try:
            yield watch
        finally:
            self._decoder_watch = None
            if watch is not None:
                watch.remove()

    def check_terms(
        self,
        candidates: tuple[LossHead, ...],
        outputs,
        labels: dict,
        inputs: dict,
        terms: dict,
        count: torch.Tensor | None = None,
    ) -> dict:
        """
        In the forward (in a DataParallel replica: for its rows), `replica_check` of `candidates` on `outputs` (given
        `count` as `num_items_in_batch`, if any), and `check_decoder` `[1, 1]`: whether the model built the decoder
        inputs `split_labels` builds (NaN: not known).
        """
        known = {candidates[0]: (terms["sums"], terms["counts"])}
        from_loss = takes_gradient_from_loss(candidates[0], outputs)

        def sample_terms(head: LossHead) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.no_grad() if from_loss else contextlib.nullcontext():
                return self._sample_terms(head, outputs, dict(labels), inputs)

        check = replica_check(candidates, outputs, sample_terms, known, count, gradient_from_loss=from_loss)
        watch = self._decoder_watch
        unknown = check["check_fits"].new_full((1, 1), torch.nan)
        check["check_decoder"] = watch.matches(labels["labels"]) if watch is not None else unknown
        return check

    def settle(
        self, candidates: tuple[LossHead, ...], model: nn.Module, terms: dict, step: StepCounts | None
    ) -> LossHead | None:
        """
        Decide from the gathered `check_terms` of every replica and rank: the head to compute this micro-batch's loss
        with (its terms moved to `sums`/`counts`, the step recounted when it changed; with the labels kept in the
        forward from the next one where the model built other decoder inputs), or None for the stock loss (warned
        once, naming the model and both losses). The choice is cached for `model`.
        """
        verdict = decide(candidates, terms, self.reduce_sum if self.num_processes > 1 else None)
        key = self._key(model, None)
        checks = self._checks.get(key, 0) + 1
        self._checks[key] = -1 if verdict.final or checks >= MAX_CHECKS else checks
        if verdict.index is None:
            self._heads[key] = (model, None)
            self.warn_fallback(mismatch_reason(model, candidates, verdict))
            return None
        if not verdict.final and checks >= MAX_CHECKS:
            self.warn_once(undecided_reason(model, candidates, verdict, checks))
        head = candidates[verdict.index]
        if verdict.index > 0:
            terms["sums"], terms["counts"] = terms[f"sums_{verdict.index}"], terms[f"counts_{verdict.index}"]
        if "graph_sums" in terms:
            # Training: the chosen candidate's sum per replica, with the graph to back-propagate (the model's own loss
            # where it fits, see `takes_gradient_from_loss`); the per-row sums were computed only to compare.
            terms["sums"] = terms["graph_sums"][:, verdict.index : verdict.index + 1]
        why = "own loss is that of"
        if verdict.decoder_differs and head.builds_decoder_inputs:
            # This micro-batch is right already: its forward had the labels, its terms come from its own logits.
            head, why = keeping_labels_in_forward(head), "forward builds other decoder inputs than its labels give:"
        if verdict.honours_count and verdict.final:
            # Its loss divides by the count it is given: from now on it gets its labels and the step's count.
            head, why = with_model_loss(head), "own loss honours num_items_in_batch; it is"
        if head is not candidates[0]:
            self._heads[key] = (model, head)
            logger.info(f"exact_loss: {type(self.unwrap(model)).__name__}'s {why} {head}; using it.")
            counted = self._counted
            if step is not None and counted is not None and counted[0] is step:
                # Counted with the head the check replaced: count again (every rank does, as all decided alike).
                step.counts.copy_(self.count_step(head, *counted[1:]).counts)
        return head
