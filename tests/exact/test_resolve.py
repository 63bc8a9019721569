"""Which head a model has (`hf_parallel.exact.resolve`): the registry of head families, and what cannot be exact."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_parallel import Trainer
from hf_parallel.exact import CrossEntropyHead, ExactLoss, ProblemTypeUnsettled, UnsupportedHead, resolve_head
from hf_parallel.exact import resolve as resolve_module
from hf_parallel.exact.heads import HEAD_FAMILIES
from tests.helpers import contrastive, detection, heads, modalities
from tests.helpers.harness import SGD_STEP, training_args
from tests.helpers.tiny import tiny_bert_classifier


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


def test_a_head_family_is_one_row_of_the_registry(monkeypatch):
    """A new family: its classes and a builder in `HEAD_FAMILIES`, looked up in order, with no branch elsewhere."""
    model = tiny_bert_classifier()
    built = []

    def build(name, model, labels, smoothing):
        built.append(name)
        return CrossEntropyHead(name="my_family")

    row = resolve_module.HeadFamily(frozenset({type(model).__name__}), build)
    monkeypatch.setattr(resolve_module, "HEAD_FAMILIES", (row, *resolve_module.HEAD_FAMILIES))
    labels = torch.tensor([0, 1])
    assert resolve_head(model, sample_labels=labels).name == "my_family" and built == ["BertForSequenceClassification"]
    monkeypatch.setattr(resolve_module, "HEAD_FAMILIES", resolve_module.HEAD_FAMILIES[1:])
    assert resolve_head(model, sample_labels=labels).name == "sequence_classification/single_label"  # its own row


class _NoHead(torch.nn.Module):
    """A model with a config whose class no row holds."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"is_encoder_decoder": False, "output_router_logits": False})()


def test_a_class_no_row_holds_is_unsupported_with_the_kinds_named():
    with pytest.raises(UnsupportedHead, match="_NoHead is not a head hf_parallel knows"):
        resolve_head(_NoHead())


# ---- Label smoothing: declared by the family's row, refused once where the head is resolved ----

SMOOTHING = 0.1
# (a case of the helpers, and the head whose loss takes no label smoothing)
NOT_SMOOTHED = {
    "regression": (heads.CASES["bert_regression"], "sequence_classification/regression"),
    "multi-label": (heads.CASES["bert_multi_label"], "sequence_classification/multi_label"),
    "question answering": (heads.CASES["bert_question_answering"], "question_answering"),
    "CTC": (modalities.CASES["wav2vec2_ctc_mean"], "ctc/mean"),
    "segmentation": (modalities.CASES["segformer_segmentation"], "semantic_segmentation"),
    "detection": (detection.CASES["detr_detection"], "object_detection/softmax"),
    "contrastive": (contrastive.CASES["clip_contrastive"], "contrastive/clip"),
}


@pytest.mark.parametrize("family", sorted(NOT_SMOOTHED))
def test_label_smoothing_on_a_family_without_it_is_refused_in_one_line(family):
    case, head_name = NOT_SMOOTHED[family]
    model = case.build(0)
    labels = case.dataset(2)[0].get("labels")
    assert resolve_head(model, sample_labels=labels).smoothing == 0  # the same model without smoothing resolves
    with pytest.raises(ValueError, match=rf"label_smoothing_factor=0.1 does not apply to \w+'s {head_name}") as error:
        resolve_head(model, label_smoothing=SMOOTHING, sample_labels=labels)
    assert "Set label_smoothing_factor=0" in str(error.value) and "\n" not in str(error.value)
    assert not isinstance(error.value, UnsupportedHead)  # refused, not a warned fallback to stock


def test_label_smoothing_is_declared_by_the_cross_entropy_families_alone():
    smoothing = {family.build.__module__.rsplit(".", 1)[-1] for family in HEAD_FAMILIES if family.label_smoothing}
    assert smoothing == {"tokens", "classification", "decoder"}
    case = heads.CASES["bert_single_label"]
    labels = case.dataset(2)[0]["labels"]
    smoothed = resolve_head(case.build(0), label_smoothing=SMOOTHING, sample_labels=labels)
    assert smoothed.smoothing == SMOOTHING


def test_detection_with_label_smoothing_stops_at_the_first_step(tmp_path):
    """A DETR trained with `label_smoothing_factor`: stock stops inside its LabelSmoother (a list of targets has no
    `dim`); hf_parallel stops at the first step with one line, where it trained silently without smoothing."""
    case = detection.CASES["detr_detection"]
    args = training_args(tmp_path, **{**SGD_STEP, "per_device_train_batch_size": 2, "label_smoothing_factor": 0.1})
    trainer = Trainer(model=case.build(0), args=args, train_dataset=case.dataset(4), data_collator=case.collator)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1 does not apply to DetrForObjectDetection's"):
        trainer.train()
    assert trainer.state.global_step == 0
    stock_args = training_args(
        tmp_path / "stock",
        args_cls=transformers.TrainingArguments,
        **{**SGD_STEP, "per_device_train_batch_size": 2, "label_smoothing_factor": 0.1},
    )
    stock = transformers.Trainer(
        model=case.build(0), args=stock_args, train_dataset=case.dataset(4), data_collator=case.collator
    )
    with pytest.raises(AttributeError, match="'list' object has no attribute 'dim'"):
        stock.train()
