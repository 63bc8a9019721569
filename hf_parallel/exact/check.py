"""
The model is the judge of its own loss: the check of the head hf_parallel chose against the loss the model computes.

A head is chosen from the model's class name (`hf_parallel.exact.resolve`), which cannot know every model's loss
(several `*ForCausalLM` decoders compute an unshifted cross-entropy; some models add a term the logits do not carry).
So before the first step that uses a head is counted, a forward of its first micro-batch keeps the labels in the
model's inputs, and the model's own loss is compared with each candidate head on the same rows
(`hf_parallel.exact.checked`, `hf_parallel.exact.compare`). `ModelLossCheck` holds the check's state (per
model: how many forwards checked it; the decoder watch of the forward under way) and decides from the votes of every
replica and rank, so that all keep the same head:

- the chosen head fits and no other does: confirmed; another fits instead: it replaces the chosen head, from the step
  about to be counted on;
- none fits: the stock loss, with one warning naming the model and both losses;
- nothing could be compared, or several fit (an untrained model): checked again at the next step, up to `MAX_CHECKS`
  checks, then the chosen head is kept with a warning;
- the model's loss honours `num_items_in_batch` wherever it could tell: the head takes `Route.MODEL_LOSS`; the model
  built other decoder inputs than its labels give: `Route.LABELS_IN_FORWARD` (`LabelsInForwardHead`).

```python
from hf_parallel.exact.check import ModelLossCheck

check = ModelLossCheck()
candidates = check.pending(head, key)  # None: decided already
# ... the forward, then `replica_check` in each replica (hf_parallel.exact.compare), gathered ...
settled = check.settle(candidates, key, model, gathered)  # settled.head: the head to keep, or None (stock)
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .compare import ReplicaCheck, candidate_heads
from .heads import LossHead, Route, routed
from .heads.decoder import DecoderInputsWatch, keeping_labels_in_forward, needs_decoder_inputs, watch_decoder

__all__ = ["MAX_CHECKS", "ModelLossCheck", "Settlement", "Verdict", "Votes", "decide"]

#: How many forwards may fail to tell the candidates apart before the chosen head is kept as it is.
MAX_CHECKS = 8


class Votes(NamedTuple):
    """
    The counts the decision rests on, summed over replicas (and, flattened into one tensor, over ranks).

    Args:
        fit (`torch.Tensor`): `[K]`, replicas where candidate k fits.
        miss (`torch.Tensor`): `[K]`, replicas where it does not.
        compared (`torch.Tensor`): `[1]`, replicas that could compare.
        losses (`torch.Tensor`): `[2]`, the model's and the first candidate's mean losses, summed.
        seen (`torch.Tensor`): `[1]`, replicas whose model returned a loss.
        other_decoder (`torch.Tensor`): `[1]`, replicas whose model built other decoder inputs than its labels give.
        honoured (`torch.Tensor`): `[1]`, replicas whose loss divided by the count given.
        ignored (`torch.Tensor`): `[1]`, replicas whose loss did not.
    """

    fit: torch.Tensor
    miss: torch.Tensor
    compared: torch.Tensor
    losses: torch.Tensor
    seen: torch.Tensor
    other_decoder: torch.Tensor
    honoured: torch.Tensor
    ignored: torch.Tensor

    @classmethod
    def of(cls, check: ReplicaCheck) -> Votes:
        """The votes of the gathered checks of every replica of this process."""
        fits, losses = check.fits.detach().double(), check.losses.detach().double()
        honours, decoder = check.honours.detach().double(), check.decoder.detach().double()
        return cls(
            fit=fits.nan_to_num(0.0).sum(0),
            miss=(fits == 0).double().sum(0),
            compared=(~torch.isnan(fits).any(-1)).double().sum().reshape(1),
            losses=losses.nan_to_num(0.0).sum(0),
            seen=(~torch.isnan(losses[:, 0])).double().sum().reshape(1),
            other_decoder=(decoder == 0).double().sum().reshape(1),
            honoured=(honours == 1).double().sum().reshape(1),
            ignored=(honours == 0).double().sum().reshape(1),
        )

    def summed(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> Votes:
        """The votes of every rank: one collective over the votes flattened into one tensor."""
        sizes = [vote.numel() for vote in self]
        return Votes(*reduce_sum(torch.cat(list(self))).split(sizes))


@dataclass(frozen=True)
class Verdict:
    """
    What the votes decided: `index` of the candidate to use (None: no candidate fits, the stock loss), whether the
    decision is `final` (False: the check runs again at the next step), the mean `model_loss` and `head_loss` (of
    the first candidate) over the comparisons, for the warning, whether the model built other decoder inputs than
    those built from its labels on a replica of any rank (`decoder_differs`), and whether its loss divided by the
    count it was given on every replica that could tell, and on one at least (`honours_count`).
    """

    index: int | None
    final: bool
    model_loss: float
    head_loss: float
    decoder_differs: bool = False
    honours_count: bool = False


def decide(votes: Votes) -> Verdict:
    """Decide from the `votes` of every replica and rank (every rank then decides the same)."""
    seen = max(float(votes.seen), 1.0)
    model_value, head_value = float(votes.losses[0]) / seen, float(votes.losses[1]) / seen
    honoured, ignored = float(votes.honoured), float(votes.ignored)
    native = honoured > 0 and ignored == 0
    no_logits = float(votes.fit.sum() + votes.miss.sum()) == 0  # no candidate compared on any replica
    if float(votes.compared) > 0:
        fitting = [k for k in range(len(votes.fit)) if votes.miss[k] == 0 and votes.fit[k] > 0]
        index, final = (fitting[0], len(fitting) == 1) if fitting else (None, True)
    elif no_logits and honoured + ignored > 0 and float(votes.seen) > 0:
        # No logits to compare (a fused loss), but its gradient told: the model's own loss, or none exact.
        index, final = 0 if native else None, True
    else:
        # Some candidate had no items to compare (the other shift of a one-target batch): ask the next forward.
        index, final = 0, False
    return Verdict(index, final, model_value, head_value, float(votes.other_decoder) > 0, native)


@dataclass(frozen=True)
class Settlement:
    """
    What a checked forward settled: the `head` to compute the model's loss with from now on (None: the stock loss),
    and the warning to give once (`warning`) or, for the stock loss, the reason of the fallback (`fallback`).
    `changed`: the head differs from the one chosen before the check, or takes another route.
    """

    head: LossHead | None
    changed: bool = False
    warning: str | None = None
    fallback: str | None = None
    why: str = ""


class ModelLossCheck:
    """
    The check of a model's head against the model's own loss: which models are still to be checked, the decoder watch
    of the forward under way, and the decision.

    Args:
        reduce_sum (`Callable`, *optional*): sums a tensor over the DDP ranks (None: one process).
    """

    def __init__(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.reduce_sum = reduce_sum or (lambda flat: flat)  # one process: its votes are every rank's
        self._checks: dict[tuple, int] = {}  # per model key: the forwards that checked it; -1 once decided
        self._decoder_watch: DecoderInputsWatch | None = None
        self._mismatches: list[str] = []  # why a candidate could not be computed, in the checked forward under way

    def note_mismatch(self, reason: str) -> None:
        """In a checked forward (any replica's thread): a candidate's loss could not be computed, and why."""
        self._mismatches.append(reason)

    def pending(self, head: LossHead | None, key: tuple, padded: bool = False) -> tuple[LossHead, ...] | None:
        """
        The candidate heads to compare with the model's own loss in the next forward (the model then gets the labels),
        or None: decided already, no head, a loss that is its own judge (a user's, a Trainer subclass's, a contrastive
        one, checked in `hf_parallel.exact.coupled`), or a batch with `padded` rows (an epoch's)
        the model's loss would count (a cross-entropy's padding targets are masked, any other head's are not).
        """
        own_judge = head is None or head.route in (Route.USER_LOSS, Route.TRAINER_LOSS) or head.batch_coupled
        if own_judge or self._checks.get(key, 0) < 0:
            return None
        return None if padded and not head.ignore_index_items else candidate_heads(head)

    def decided(self, key: tuple) -> bool:
        """Whether the check of the model of `key` is decided (or never started)."""
        return self._checks.get(key, -1) < 0

    def concluded(self, key: tuple) -> bool:
        """Whether the check of the model of `key` ran and is decided."""
        return self._checks.get(key, 0) < 0

    @contextlib.contextmanager
    def watching_decoder(
        self, candidates: tuple[LossHead, ...] | None, model: nn.Module, inputs: dict
    ) -> Iterator[DecoderInputsWatch | None]:
        """
        Around the checked forward of `inputs` (None: no check, nothing to do): records the decoder inputs the model
        (unwrapped) builds itself, for `decoder_vote` to compare with those built from the labels.
        """
        watching = candidates is not None and needs_decoder_inputs(candidates[0], inputs)
        self._decoder_watch = watch = watch_decoder(model) if watching else None
        try:
            yield watch
        finally:
            self._decoder_watch = None
            if watch is not None:
                watch.remove()

    def decoder_vote(self, labels: dict) -> torch.Tensor | None:
        """In the checked forward (its replica's thread): `[1, 1]`, whether the decoder got the labels' inputs."""
        watch = self._decoder_watch
        return watch.matches(labels["labels"]) if watch is not None else None

    def settle(
        self, candidates: tuple[LossHead, ...], key: tuple, name: str, check: ReplicaCheck | None
    ) -> Settlement:
        """Decide from `check`, gathered from every replica of this process, for the model `name` of `key`; None where
        no replica ran it (a wrapper's forward that does not call its module, warned): the chosen head, unchecked."""
        if check is None:
            self._checks[key] = -1
            return Settlement(candidates[0])
        verdict = decide(Votes.of(check).summed(self.reduce_sum))
        mismatches, self._mismatches = self._mismatches, []
        checks = self._checks.get(key, 0) + 1
        self._checks[key] = -1 if verdict.final or checks >= MAX_CHECKS else checks
        if verdict.index is None:
            return Settlement(None, changed=True, fallback=_mismatch(name, candidates, verdict, mismatches))
        warning = _undecided(name, candidates, verdict, checks) if not verdict.final and checks >= MAX_CHECKS else None
        head, why = candidates[verdict.index], "own loss is that of"
        if verdict.decoder_differs and head.builds_decoder_inputs:
            head, why = keeping_labels_in_forward(head), "forward builds other decoder inputs than its labels give:"
        if verdict.honours_count and verdict.final:
            # Its loss divides by the count it is given: from now on it gets its labels and the step's count.
            head, why = routed(head, Route.MODEL_LOSS), "own loss honours num_items_in_batch; it is"
        return Settlement(head, changed=head is not candidates[0], warning=warning, why=why)


def _names(candidates: tuple[LossHead, ...]) -> str:
    return ", ".join(candidate.name for candidate in candidates)


def _mismatch(name: str, candidates: tuple[LossHead, ...], verdict: Verdict, mismatches: list[str]) -> str:
    """The warning of a model whose own loss no candidate head gives: the model, both losses (or why a head could not
    be computed from its outputs), what to do."""
    if mismatches:
        return (
            f"{name}'s outputs do not fit the loss {_names(candidates)}: {mismatches[0]} Its own loss is the one "
            "trained on."
        )
    return (
        f"{name} computes its own loss {verdict.model_loss:.6g} on a batch where the loss recomputed from its "
        f"logits as {candidates[0].name} gives {verdict.head_loss:.6g} (also tried: {_names(candidates[1:]) or 'none'}"
        "): its loss is not one hf_parallel can recompute (it adds a term the logits do not carry, or counts other "
        "items). If the model's loss is the one to train on, this fallback is right; to train on "
        f"{candidates[0].name} instead, pass it as compute_loss_func."
    )


def _undecided(name: str, candidates: tuple[LossHead, ...], verdict: Verdict, checks: int) -> str:
    """The warning of a model whose own loss could not tell the candidate heads apart in `checks` forwards."""
    return (
        f"exact_loss: in {checks} forwards the own loss of {name} ({verdict.model_loss:.6g} in the mean) could not "
        f"tell the heads {_names(candidates)} apart (several were within the tolerance, or no batch had items); "
        f"keeping {candidates[0].name}."
    )
