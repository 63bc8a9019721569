"""Which `LossHead` a transformers model has, from its class and config; or why it cannot be made exact."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.auto import modeling_auto

from .decoder import LabelsInForwardHead
from .heads import CrossEntropyHead, LossHead, MultiLabelHead, QuestionAnsweringHead, RegressionHead

__all__ = ["ProblemTypeUnsettled", "UnsupportedHead", "resolve_head"]


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
# Heads whose loss is a plain cross-entropy over their labels, by the name used in messages.
_PLAIN_CROSS_ENTROPY = (
    ("masked_lm", MASKED_LM, True),
    ("token_classification", TOKEN_CLASSIFICATION, True),
    ("multiple_choice", MULTIPLE_CHOICE, False),
)
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


def _sequence_classification(name: str, config, labels, smoothing: float) -> LossHead:
    problem = _problem_type(config, labels)
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


def _head_by_class(model: nn.Module, sample_labels, smoothing: float) -> LossHead:
    name, config = _class_name(model), model.config
    encoder_decoder = getattr(config, "is_encoder_decoder", False)
    if name in QUESTION_ANSWERING:
        if smoothing:
            raise UnsupportedHead(f"label smoothing does not apply to {name}'s start/end positions.")
        return QuestionAnsweringHead()
    if name in SEQUENCE_CLASSIFICATION:
        return _sequence_classification(name, config, sample_labels, smoothing)
    if encoder_decoder and name in SEQ2SEQ_LM:
        if not callable(getattr(model, "prepare_decoder_input_ids_from_labels", None)):
            # It builds its decoder inputs inside its forward only, from the labels (or, FSMT, from the inputs).
            return LabelsInForwardHead(name="seq2seq_lm/labels_in_forward", smoothing=smoothing, per_position=True)
        return CrossEntropyHead(name="seq2seq_lm", smoothing=smoothing, builds_decoder_inputs=True, per_position=True)
    if name in CAUSAL_LM and not encoder_decoder:
        return CrossEntropyHead(name="causal_lm", shift=True, smoothing=smoothing, per_position=True)
    for head_name, names, per_position in _PLAIN_CROSS_ENTROPY:
        if name in names:
            return CrossEntropyHead(name=head_name, smoothing=smoothing, per_position=per_position)
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
