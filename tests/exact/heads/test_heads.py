"""Each loss head (`hf_parallel.exact.heads`) against the model's own loss on one batch: its sums, counts and terms."""

from __future__ import annotations

import pytest
import torch
from transformers.trainer_pt_utils import LabelSmoother

from hf_parallel.exact import CrossEntropyHead, MultiLabelHead, QuestionAnsweringHead, RegressionHead, resolve_head
from hf_parallel.exact.step import split_labels
from tests.helpers.heads import CASES, batch_of

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


def _head_loss(model, head, batch) -> torch.Tensor:
    inputs, labels = split_labels(head, batch, model)
    assert not head.has_labels(inputs), "the labels must not reach the model"
    sums, counts = head.row_terms(model(**inputs), labels)
    assert sums.shape == counts.shape == (batch[head.label_keys[0]].shape[0], head.num_terms)
    return head.combine(sums.sum(0), counts.sum(0))


@pytest.mark.parametrize("case_name", list(CASES))
def test_every_head_gives_the_models_own_loss_on_onebatch_of(case_name):
    case = CASES[case_name]
    model = case.build(0).eval()
    batch = batch_of(case_name)
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
