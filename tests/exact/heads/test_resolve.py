"""Which head a model has (`hf_parallel.exact.resolve`): the registry of head families, and what cannot be exact."""

from __future__ import annotations

import pytest
import torch

from hf_parallel.exact import CrossEntropyHead, ExactLoss, ProblemTypeUnsettled, UnsupportedHead, resolve_head
from hf_parallel.exact import resolve as resolve_module
from tests.tiny import tiny_bert_classifier


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
