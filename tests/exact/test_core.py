"""`ExactLoss` without a Trainer (`hf_parallel.exact.core`): head choice and its warnings, step counts, the loss of
a step, evaluation totals."""

from __future__ import annotations

import pytest
import torch

from hf_parallel.exact import CrossEntropyHead, ExactLoss, RunContext, StepCounts, count_step, micro_batch_loss
from hf_parallel.exact.compare import ReplicaCheck, candidate_heads
from tests.helpers.heads import CASES, batch_of
from tests.helpers.tiny import tiny_bert_classifier


def test_fallbacks_warn_once_per_reason(hf_parallel_log):
    exact = ExactLoss()
    model = torch.nn.Linear(2, 2)
    assert exact.head(model) is None
    assert exact.head(model) is None
    assert exact.head(tiny_bert_classifier(), blocked="MyTrainer overrides compute_loss.") is None
    messages = [m for m in hf_parallel_log.messages if m.startswith("exact_loss:")]
    assert len(messages) == 2, messages
    assert "Linear has no `config`" in messages[0]
    assert "MyTrainer overrides compute_loss." in messages[1]
    assert ExactLoss(enabled=False).head(tiny_bert_classifier()) is None


def test_a_step_is_exact_over_micro_batches():
    case = CASES["llama_causal_lm"]
    model = case.build(0)
    whole = batch_of("llama_causal_lm", rows=6)
    parts = [{k: v[:2] for k, v in whole.items()}, {k: v[2:] for k, v in whole.items()}]
    exact = ExactLoss(label_names=["labels"])
    head = exact.head(model, parts[0])
    step = count_step(exact, head, parts)
    assert isinstance(step, StepCounts) and step.scale == 1
    assert step.total.item() == head.count(whole).sum().item()
    with torch.no_grad():
        micro = [micro_batch_loss(exact, model, head, part, step, RunContext())[0] for part in parts]
        expected = model(**whole).loss
    torch.testing.assert_close(sum(micro), expected, rtol=1e-5, atol=1e-6)


def test_evaluation_divides_once_over_the_whole_set():
    model = CASES["bert_token_classification"].build(0).eval()
    whole = batch_of("bert_token_classification", rows=6)
    exact = ExactLoss()
    head = exact.head(model, whole)
    exact.evaluation.start()
    with torch.no_grad():
        for rows in (slice(0, 1), slice(1, 6)):  # very uneven batches: a mean of means would be off
            micro_batch_loss(exact, model, head, {k: v[rows] for k, v in whole.items()}, None, RunContext())
        expected = model(**whole).loss.item()
    assert exact.evaluation.finish(exact.engine) == pytest.approx(expected, rel=1e-6)
    assert exact.evaluation.finish(exact.engine) is None  # nothing open any more


def test_ddp_counts_need_a_reduction():
    with pytest.raises(ValueError, match="needs reduce_sum"):
        ExactLoss(num_processes=2)
    exact = ExactLoss(num_processes=2, reduce_sum=lambda counts: counts * 2)  # two identical ranks
    step = count_step(exact, CrossEntropyHead(), [{"labels": torch.tensor([[1, -100]])}])
    assert step.counts.tolist() == [2] and step.scale == 2
    assert step.total.item() == 2  # what stock code gets as num_items_in_batch


def test_the_check_settles_the_head_before_the_step_is_counted_once_for_it():
    # The check of the step's first micro-batch finds the other shift fits: the head is replaced before the step is
    # counted, and the step is counted once, for the head the check settled on.
    reduced = []
    exact, model = (
        ExactLoss(num_processes=2, reduce_sum=lambda counts: reduced.append(counts) or counts * 2),
        torch.nn.Linear(1, 1),
    )
    batches = [{"labels": torch.tensor([[5, 6, -100]])}, {"labels": torch.tensor([[7, 8, 9]])}]
    candidates = candidate_heads(CrossEntropyHead(name="causal_lm", shift=True, per_position=True))
    unknown = torch.full((1, 1), float("nan"))
    check = ReplicaCheck(
        fits=torch.tensor([[0.0, 1.0]]),  # the unshifted candidate fits, the shifted one does not
        losses=torch.ones(1, 2, dtype=torch.float64),
        honours=unknown,
        decoder=unknown,
    )
    head = exact.settle(candidates, model, check)
    assert head is candidates[1] and exact.head(model) is candidates[1]  # cached for the model
    step = count_step(exact, head, batches, model=model)
    assert step.head is head and step.counts.tolist() == [10]  # every target counts unshifted, over both ranks
    assert reduced[-1].tolist() == [5]  # one collective, of the settled head's count alone
