"""Which `LossHead` a transformers model has, from its class and config; or why it cannot be made exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers.models.auto import modeling_auto

from .decoder import LabelsInForwardHead
from .heads import CrossEntropyHead, LossHead, MultiLabelHead, QuestionAnsweringHead, RegressionHead

__all__ = ["HEAD_FAMILIES", "HeadFamily", "ProblemTypeUnsettled", "UnsupportedHead", "resolve_head"]


def _class_names(*mappings: str) -> frozenset[str]:
    names = set()
    for mapping in mappings:
        for value in getattr(modeling_auto, mapping).values():
            names.update(value if isinstance(value, (tuple, list)) else (value,))
    return frozenset(names)


CAUSAL_LM = _class_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
SEQ2SEQ_LM = _class_names("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES")
MASKED_LM = _class_names("MODEL_FOR_MASKED_LM_MAPPING_NAMES")
TOKEN_CLASSIFICATION = _class_names("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES")
SEQUENCE_CLASSIFICATION = _class_names("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES")
MULTIPLE_CHOICE = _class_names("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES")
QUESTION_ANSWERING = _class_names("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES")
# PEFT adapters that leave the sequence as it is: prefix tuning and cartridges add keys and values, not positions.
# Every other prompt-learning adapter prepends virtual tokens to the input, so a decoder's logits have more
# positions than its labels.
_SEQUENCE_KEEPING_PROMPTS = frozenset({"PREFIX_TUNING", "CARTRIDGE"})


class UnsupportedHead(ValueError):
    """The model's loss cannot be recomputed exactly from its logits; the reason names what to do."""


class ProblemTypeUnsettled(UnsupportedHead):
    """
    A sequence classifier whose `config.problem_type` is unset, before any labels were seen: transformers settles it
    from the first labels (their dtype and the number of labels), so the head is known at the first batch.
    """


def _problem_type(config, labels: torch.Tensor | None) -> str | None:
    """transformers' rule in `ForSequenceClassificationLoss`, which also stores it on the config."""
    if config.problem_type is None and labels is not None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    return config.problem_type


def _sequence_classification(name: str, model, labels, smoothing: float) -> LossHead:
    problem = _problem_type(model.config, labels)
    if problem is None:
        raise ProblemTypeUnsettled(f"{name}: problem_type is unset and no labels were seen to settle it.")
    if problem == "single_label_classification":
        return CrossEntropyHead(name="sequence_classification/single_label", smoothing=smoothing)
    if smoothing:
        raise UnsupportedHead(f"label smoothing does not apply to {name} with problem_type={problem!r}.")
    if problem == "regression":
        return RegressionHead(name="sequence_classification/regression")
    if problem == "multi_label_classification":
        return MultiLabelHead(name="sequence_classification/multi_label")
    raise UnsupportedHead(f"{name} has an unknown problem_type {problem!r}.")


def _question_answering(name: str, model, labels, smoothing: float) -> LossHead:
    if smoothing:
        raise UnsupportedHead(f"label smoothing does not apply to {name}'s start/end positions.")
    return QuestionAnsweringHead()


def _seq2seq_lm(name: str, model, labels, smoothing: float) -> LossHead:
    if not callable(getattr(model, "prepare_decoder_input_ids_from_labels", None)):
        # It builds its decoder inputs inside its forward only, from the labels (or, FSMT, from the inputs).
        return LabelsInForwardHead(name="seq2seq_lm/labels_in_forward", smoothing=smoothing, per_position=True)
    return CrossEntropyHead(name="seq2seq_lm", smoothing=smoothing, builds_decoder_inputs=True, per_position=True)


def _cross_entropy(head_name: str, **options) -> Callable[..., LossHead]:
    def build(name: str, model, labels, smoothing: float) -> LossHead:
        return CrossEntropyHead(name=head_name, smoothing=smoothing, **options)

    return build


class HeadFamily(NamedTuple):
    """
    One row of `HEAD_FAMILIES`: the model classes of a kind of head (by class name), whether they must be
    encoder-decoders (True), must not be (False) or either (None), and `build(name, model, labels, smoothing)`, which
    gives their `LossHead` or raises `UnsupportedHead`.
    """

    classes: frozenset[str]
    build: Callable[..., LossHead]
    encoder_decoder: bool | None = None


#: The head families, in the order a class name is looked up: the first row that holds it gives its head. A new
#: family is one `LossHead` module and one row here.
HEAD_FAMILIES: tuple[HeadFamily, ...] = (
    HeadFamily(QUESTION_ANSWERING, _question_answering),
    HeadFamily(SEQUENCE_CLASSIFICATION, _sequence_classification),
    HeadFamily(SEQ2SEQ_LM, _seq2seq_lm, encoder_decoder=True),
    HeadFamily(CAUSAL_LM, _cross_entropy("causal_lm", shift=True, per_position=True), encoder_decoder=False),
    HeadFamily(MASKED_LM, _cross_entropy("masked_lm", per_position=True)),
    HeadFamily(TOKEN_CLASSIFICATION, _cross_entropy("token_classification", per_position=True)),
    HeadFamily(MULTIPLE_CHOICE, _cross_entropy("multiple_choice")),
)


def _head_by_class(model: nn.Module, sample_labels, smoothing: float) -> LossHead:
    name = _class_name(model)
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    for family in HEAD_FAMILIES:
        if name in family.classes and family.encoder_decoder in (None, encoder_decoder):
            return family.build(name, model, sample_labels, smoothing)
    raise UnsupportedHead(
        f"{name} is not a head hf_parallel knows (causal/seq2seq/masked LM, token/sequence classification, "
        "multiple choice, question answering)."
    )


def _inside_adapters(model: nn.Module) -> tuple[nn.Module, str | None]:
    """
    The transformers model inside a PEFT wrapper (LoRA, IA3, prefix tuning, ...), and the adapter type when it
    prepends virtual tokens to the input; the model itself and None for anything else.
    """
    config = getattr(model, "active_peft_config", None)
    if config is None or not callable(getattr(model, "get_base_model", None)):
        return model, None
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    virtual = getattr(config, "is_prompt_learning", False) and peft_type not in _SEQUENCE_KEEPING_PROMPTS
    return model.get_base_model(), peft_type if virtual else None


def _class_name(model: nn.Module) -> str:
    """The model's class name; under FSDP2, that of the class `fully_shard` derived `FSDP<Name>` from."""
    cls = type(model)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch build without distributed support
        return cls.__name__
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls.__name__


def resolve_head(
    model: nn.Module,
    label_names: list[str] | None = None,
    label_smoothing: float = 0.0,
    sample_labels: torch.Tensor | None = None,
) -> LossHead:
    """
    The `LossHead` of an (unwrapped) transformers model.

    Args:
        model (`nn.Module`): the model, unwrapped from DataParallel/DDP; a PEFT model is resolved by the
            transformers model inside it.
        label_names (`list[str]`, *optional*): the Trainer's label names; the defaults of the head when `None`.
        label_smoothing (`float`, *optional*, defaults to 0): `TrainingArguments.label_smoothing_factor`.
        sample_labels (`torch.Tensor`, *optional*): a batch's `labels`, to settle a sequence classifier's
            `problem_type` the way transformers does when the config leaves it unset.

    Raises:
        `UnsupportedHead`: the head cannot be made exact; the message says why.
        `ProblemTypeUnsettled`: a sequence classifier whose problem type needs labels to be settled.

    ```python
    from hf_parallel.exact import resolve_head

    resolve_head(model)  # e.g. CrossEntropyHead(name='causal_lm', label_keys=('labels',))
    ```
    """
    model, virtual_tokens = _inside_adapters(model)
    name = _class_name(model)
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedHead(f"{name} has no `config`: not a transformers model with a known head.")
    if getattr(config, "output_router_logits", False):
        raise UnsupportedHead(
            f"{name} adds a router auxiliary loss (config.output_router_logits=True) that the logits do not carry."
        )
    head = _head_by_class(model, sample_labels, label_smoothing)
    if virtual_tokens is not None and getattr(head, "per_position", False) and not head.builds_decoder_inputs:
        raise UnsupportedHead(
            f"the {virtual_tokens} adapter on {name} prepends virtual tokens, so the logits have more positions "
            "than the labels."
        )
    if label_names is not None and tuple(label_names) != head.label_keys:
        raise UnsupportedHead(
            f"{name} takes labels {list(head.label_keys)}, but the Trainer's label_names are {label_names}."
        )
    return head
