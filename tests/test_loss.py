"""The exact-loss core on its own: every head against the model's own loss on one batch, and ExactLoss without a
Trainer (head choice and its warnings, step counts, the loss of a step, evaluation totals)."""

from __future__ import annotations

import pytest
import torch
from transformers.trainer_pt_utils import LabelSmoother

from hf_parallel.exact import (
    CrossEntropyHead,
    ExactLoss,
    MultiLabelHead,
    ProblemTypeUnsettled,
    QuestionAnsweringHead,
    RegressionHead,
    Route,
    RunContext,
    StepCounts,
    UnsupportedHead,
    micro_batch_loss,
    resolve_head,
)
from hf_parallel.exact.forward import sample_terms, split_labels
from tests.heads import CASES
from tests.tiny import tiny_bert_classifier

EXPECTED_HEADS = {
    "gpt2_causal_lm": (CrossEntropyHead, "causal_lm"),
    "llama_causal_lm": (CrossEntropyHead, "causal_lm"),
    "llama_shift_labels": (CrossEntropyHead, "causal_lm"),
    "bart_seq2seq": (CrossEntropyHead, "seq2seq_lm"),
    "bert_masked_lm": (CrossEntropyHead, "masked_lm"),
    "bert_token_classification": (CrossEntropyHead, "token_classification"),
    "bert_single_label": (CrossEntropyHead, "sequence_classification/single_label"),
    "bert_multi_label": (MultiLabelHead, "sequence_classification/multi_label"),
    "bert_regression": (RegressionHead, "sequence_classification/regression"),
    "bert_multiple_choice": (CrossEntropyHead, "multiple_choice"),
    "bert_question_answering": (QuestionAnsweringHead, "question_answering"),
    "bert_single_label_smoothing": (CrossEntropyHead, "sequence_classification/single_label"),
    "gpt2_causal_lm_smoothing": (CrossEntropyHead, "causal_lm"),
    # PEFT: the head of the transformers model inside the adapter.
    "lora_bert_single_label": (CrossEntropyHead, "sequence_classification/single_label"),
    "lora_llama_causal_lm": (CrossEntropyHead, "causal_lm"),
}


def _batch(case_name: str, rows: int = 6, seed: int = 3) -> dict[str, torch.Tensor]:
    dataset = CASES[case_name].dataset(rows, seed)
    return {key: torch.stack([dataset[i][key] for i in range(rows)]) for key in dataset[0]}


def _head_loss(model, head, batch) -> torch.Tensor:
    inputs, labels = split_labels(head, batch, model)
    assert not head.has_labels(inputs), "the labels must not reach the model"
    sums, counts = head.row_terms(model(**inputs), labels)
    assert sums.shape == counts.shape == (batch[head.label_keys[0]].shape[0], head.num_terms)
    return head.combine(sums.sum(0), counts.sum(0))


@pytest.mark.parametrize("case_name", list(CASES))
def test_every_head_gives_the_models_own_loss_on_one_batch(case_name):
    case = CASES[case_name]
    model = case.build(0).eval()
    batch = _batch(case_name)
    head = resolve_head(model, label_smoothing=case.label_smoothing, sample_labels=batch.get("labels"))
    head_class, name = EXPECTED_HEADS[case_name]
    assert type(head) is head_class and head.name == name
    with torch.no_grad():
        ours = _head_loss(model, head, batch)
        outputs = model(**batch)
        if case.label_smoothing:
            # The model's own loss has no smoothing: transformers' LabelSmoother is the reference.
            expected = LabelSmoother(case.label_smoothing)(outputs, batch["labels"], shift_labels=head.shift)
        else:
            expected = outputs.loss
    torch.testing.assert_close(ours, expected.float(), rtol=1e-5, atol=1e-6)


def test_counts_are_the_items_of_each_head():
    labels = {"labels": torch.tensor([[5, 6, -100], [7, -100, -100]])}
    assert CrossEntropyHead().count(labels).tolist() == [3]
    assert CrossEntropyHead(shift=True).count(labels).tolist() == [1]  # the first row predicts 6; the rest ignored
    assert RegressionHead().count({"labels": torch.zeros(4, 2)}).tolist() == [8]
    qa = {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 9])}
    assert QuestionAnsweringHead().count(qa, seq_len=8).tolist() == [2, 1]
    with pytest.raises(ValueError, match="no input_ids or attention_mask"):
        QuestionAnsweringHead().count(qa, seq_len=None)


def test_a_term_without_items_contributes_zero_not_nan():
    head = QuestionAnsweringHead()
    loss = head.combine(torch.tensor([0.0, 4.0]), torch.tensor([0, 2]))  # no start item: its sum is 0
    assert loss.item() == pytest.approx(0.5 * 4.0 / 2)


def test_missing_labels_name_the_keys():
    with pytest.raises(KeyError, match=r"no \['labels'\] for the causal_lm loss"):
        CrossEntropyHead(name="causal_lm").pop_labels({"input_ids": torch.zeros(1, 2)})


def test_unsettled_problem_type_has_its_own_exception():
    model = tiny_bert_classifier()
    model.config.problem_type = None
    with pytest.raises(ProblemTypeUnsettled):
        resolve_head(model)
    assert issubclass(ProblemTypeUnsettled, UnsupportedHead)
    # ExactLoss waits for the first labels instead of warning.
    exact = ExactLoss()
    assert exact.head(model) is None and not exact._warned
    assert isinstance(exact.head(model, {"labels": torch.tensor([0, 1])}), CrossEntropyHead)


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
    whole = _batch("llama_causal_lm", rows=6)
    parts = [{k: v[:2] for k, v in whole.items()}, {k: v[2:] for k, v in whole.items()}]
    exact = ExactLoss(label_names=["labels"])
    head = exact.head(model, parts[0])
    step = exact.count_step(head, parts)
    assert isinstance(step, StepCounts) and step.scale == 1
    assert step.total().item() == head.count(whole).sum().item()
    with torch.no_grad():
        micro = [micro_batch_loss(exact, model, head, part, step, RunContext())[0] for part in parts]
        expected = model(**whole).loss
    torch.testing.assert_close(sum(micro), expected, rtol=1e-5, atol=1e-6)


def test_evaluation_divides_once_over_the_whole_set():
    model = CASES["bert_token_classification"].build(0).eval()
    whole = _batch("bert_token_classification", rows=6)
    exact = ExactLoss()
    head = exact.head(model, whole)
    exact.start_evaluation()
    with torch.no_grad():
        for rows in (slice(0, 1), slice(1, 6)):  # very uneven batches: a mean of means would be off
            micro_batch_loss(exact, model, head, {k: v[rows] for k, v in whole.items()}, None, RunContext())
        expected = model(**whole).loss.item()
    assert exact.finish_evaluation() == pytest.approx(expected, rel=1e-6)
    assert exact.finish_evaluation() is None  # nothing open any more


def test_ddp_counts_need_a_reduction():
    with pytest.raises(ValueError, match="needs reduce_sum"):
        ExactLoss(num_processes=2)
    exact = ExactLoss(num_processes=2, reduce_sum=lambda counts: counts * 2)  # two identical ranks
    step = exact.count_step(CrossEntropyHead(), [{"labels": torch.tensor([[1, -100]])}])
    assert step.counts.tolist() == [2] and step.scale == 2
    assert StepCounts.as_stock(step).item() == 2
    assert StepCounts.as_stock(5) == 5


def test_a_user_loss_function_gets_the_exact_count():
    seen = {}

    def loss_func(outputs, labels, num_items_in_batch):
        seen["count"] = int(num_items_in_batch)
        return outputs["logits"].sum() * 0

    class Logits(torch.nn.Module):  # a model hf_parallel knows no head of
        def forward(self, **inputs):
            return {"logits": torch.ones(1)}

    exact, model = ExactLoss(label_names=["labels"]), Logits()
    head = exact.head(model, loss_func=loss_func, loss_func_shifts=True)
    assert head.name == "compute_loss_func" and head.shift and head.route is Route.USER_LOSS
    batches = [{"labels": torch.tensor([[1, 2, 3]])}, {"labels": torch.tensor([[4, -100, -100]])}]
    step = exact.count_step(head, batches)
    micro_batch_loss(exact, model, head, batches[0], step, RunContext(loss_func=loss_func))
    assert seen["count"] == 2  # shifted: 2 targets in the first row, none in the second


def test_a_packed_row_is_split_into_its_samples():
    """`DataCollatorWithFlattening` packs sequences into one row: the terms are per sequence, as if unpacked."""
    from transformers import DataCollatorWithFlattening

    model = CASES["llama_causal_lm"].build(0).eval()
    sequences = [row["input_ids"][row["attention_mask"].bool()] for row in CASES["llama_causal_lm"].rows(5, 3)]
    packed = DataCollatorWithFlattening()([{"input_ids": s.tolist(), "labels": s.tolist()} for s in sequences])
    head = ExactLoss().head(model, packed)
    with torch.no_grad():
        inputs, labels = split_labels(head, packed, model)
        outputs = model(**inputs)
        # In training the samples are added up in one row (counting them would read a value off the device).
        train_sums, train_counts = sample_terms(head, outputs, dict(labels), inputs, per_sample=False)
        sums, counts = sample_terms(head, outputs, labels, inputs, per_sample=True)
        assert train_sums.shape == (1, 1) and sums.shape == (len(sequences), 1)
        torch.testing.assert_close(train_sums[0], sums.sum(0))
        assert train_counts[0].item() == counts.sum().item()
        for i, ids in enumerate(sequences):
            alone = model(input_ids=ids[None]).logits[0, :-1]
            expected = torch.nn.functional.cross_entropy(alone, ids[1:], reduction="sum") if len(ids) > 1 else 0.0
            torch.testing.assert_close(sums[i, 0], torch.as_tensor(expected, dtype=sums.dtype), rtol=1e-5, atol=1e-5)
            assert counts[i, 0].item() == len(ids) - 1
