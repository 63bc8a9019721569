"""Which `LossHead` a transformers model has, from its class and config; or why it cannot be made exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers.models.auto import modeling_auto

from .contrastive import ContrastiveHead, contrastive_variant
from .ctc import CTCHead
from .decoder import LabelsInForwardHead
from .frames import FrameClassificationHead
from .heads import CrossEntropyHead, LossHead, MultiLabelHead, QuestionAnsweringHead, RegressionHead
from .router import router_balance_of, text_config
from .segmentation import SegmentationHead

__all__ = ["HEAD_FAMILIES", "HeadFamily", "ProblemTypeUnsettled", "UnsupportedHead", "resolve_head"]


def _class_names(*mappings: str) -> frozenset[str]:
    names = set()
    for mapping in mappings:
        for value in getattr(modeling_auto, mapping, {}).values():  # a mapping a release lacks: no classes
            names.update(value if isinstance(value, (tuple, list)) else (value,))
    return frozenset(names)


CAUSAL_LM = _class_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
SEQ2SEQ_LM = _class_names("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES")
MASKED_LM = _class_names("MODEL_FOR_MASKED_LM_MAPPING_NAMES")
TOKEN_CLASSIFICATION = _class_names("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES")
SEQUENCE_CLASSIFICATION = _class_names("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES")
MULTIPLE_CHOICE = _class_names("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES")
QUESTION_ANSWERING = _class_names("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES")
# Beyond text. A classifier of images, videos or audio clips has the loss of a sequence classifier (transformers maps
# them to `ForSequenceClassificationLoss`, or writes the same rule out).
MEDIA_CLASSIFICATION = _class_names(
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
)
CTC = _class_names("MODEL_FOR_CTC_MAPPING_NAMES")
SEMANTIC_SEGMENTATION = _class_names("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES")
AUDIO_FRAME_CLASSIFICATION = _class_names("MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES")
# Language models conditioned on images, audio or video: encoder-decoders (Whisper, Speech2Text, TrOCR and Donut as
# VisionEncoderDecoderModel) have the seq2seq LM loss, decoders with placeholder positions (LLaVA, Qwen2-VL,
# Voxtral, ...) the causal LM loss over every position the labels do not ignore.
MULTIMODAL_LM = _class_names(
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
)
# Contrastive dual encoders (`return_loss=True`): each row's loss depends on every other row of the batch, so they are
# computed on the whole step's embeddings (`hf_parallel.exact.contrastive`). The zero-shot image classifiers, and the
# dual encoders of other modalities that the mappings file elsewhere. Not X-CLIP: it scores each video against text
# embeddings made for that video (`[videos, texts, dim]`), which no gather of two embedding tables reproduces.
CONTRASTIVE = _class_names("MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES") | frozenset(
    {"ClapModel", "GroupViTModel", "VisionTextDualEncoderModel", "OwlViTModel", "Owlv2Model"}
)
# Losses that are not a sum over items, by mapping: why each stays on the stock loss.
NOT_A_SUM = {
    "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES": "matches predictions to boxes over the whole batch (Hungarian "
    "matching); note that under DDP transformers divides its box terms by the ranks' mean box count over the world "
    "size again (DETR-style losses), so those terms come out x world size, which hf_parallel cannot take out of the "
    "summed loss",
    "MODEL_FOR_ZERO_SHOT_OBJECT_DETECTION_MAPPING_NAMES": "matches predictions to boxes over the whole batch",
    "MODEL_FOR_UNIVERSAL_SEGMENTATION_MAPPING_NAMES": "matches predicted masks to the labels' masks over the batch",
    "MODEL_FOR_INSTANCE_SEGMENTATION_MAPPING_NAMES": "matches predicted masks to the labels' masks over the batch",
    "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES": "is a scale-invariant log loss of the whole batch, not a sum over "
    "pixels",
    "MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES": "reconstructs masked patches (normalised targets, a mask the "
    "model may draw itself), which the logits do not give per item",
    "MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES": "is an additive-margin softmax of speaker embeddings",
    "MODEL_FOR_PRETRAINING_MAPPING_NAMES": "adds pre-training objectives the logits do not carry",
}
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


def _ctc(name: str, model, labels, smoothing: float) -> LossHead:
    if smoothing:
        raise UnsupportedHead(f"label smoothing does not apply to {name}'s CTC loss.")
    config = model.config
    reduction = getattr(config, "ctc_loss_reduction", None)
    if reduction not in ("mean", "sum"):
        raise UnsupportedHead(f"{name} has ctc_loss_reduction={reduction!r}; hf_parallel knows 'mean' and 'sum'.")
    blank = getattr(config, "pad_token_id", None)
    if not isinstance(blank, int):
        raise UnsupportedHead(f"{name} has no pad_token_id, which its CTC loss takes as the blank token.")
    return CTCHead(blank, reduction, getattr(config, "ctc_zero_infinity", False), name=f"ctc/{reduction}")


def _segmentation(name: str, model, labels, smoothing: float) -> LossHead:
    config = model.config
    if smoothing:
        raise UnsupportedHead(f"label smoothing does not apply to {name}'s per-pixel loss.")
    if getattr(config, "use_auxiliary_head", False):
        raise UnsupportedHead(
            f"{name} adds an auxiliary head's loss (config.use_auxiliary_head=True) whose logits its outputs do not "
            "carry; set use_auxiliary_head=False in its config to train it exactly without that head."
        )
    if getattr(config, "num_labels", 2) == 1:
        raise UnsupportedHead(f"{name} with num_labels=1 has a binary loss averaged over every pixel, ignored or not.")
    ignore = getattr(config, "semantic_loss_ignore_index", getattr(config, "loss_ignore_index", 255))
    return SegmentationHead(ignore_index=ignore)


def _frames(name: str, model, labels, smoothing: float) -> LossHead:
    if smoothing:
        raise UnsupportedHead(f"label smoothing does not apply to {name}'s frame labels.")
    return FrameClassificationHead()


def _multimodal_lm(name: str, model, labels, smoothing: float) -> LossHead:
    if getattr(model.config, "is_encoder_decoder", False):
        return _seq2seq_lm(name, model, labels, smoothing)
    return CrossEntropyHead(name="multimodal_lm", shift=True, smoothing=smoothing, per_position=True)


def _contrastive(name: str, model, labels, smoothing: float) -> LossHead:
    if smoothing:
        raise UnsupportedHead(f"label smoothing does not apply to {name}'s contrastive loss.")
    variant = contrastive_variant(model, name)
    if variant is None:
        raise UnsupportedHead(
            f"{name}'s contrastive loss reads scale parameters hf_parallel does not know (it knows CLIP's "
            "logit_scale, SigLIP's logit_scale and logit_bias, ALIGN's temperature and CLAP's two scales), so "
            "each device keeps its own rows as negatives."
        )
    return ContrastiveHead(variant)


def _not_a_sum(reason: str) -> Callable[..., LossHead]:
    def build(name: str, model, labels, smoothing: float) -> LossHead:
        raise UnsupportedHead(f"{name}'s loss {reason}: it is not a sum over items that can be split exactly.")

    return build


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
    HeadFamily(MEDIA_CLASSIFICATION, _sequence_classification),
    HeadFamily(CTC, _ctc),
    HeadFamily(SEMANTIC_SEGMENTATION, _segmentation),
    HeadFamily(AUDIO_FRAME_CLASSIFICATION, _frames),
    HeadFamily(MULTIMODAL_LM, _multimodal_lm),
    HeadFamily(CONTRASTIVE, _contrastive),
    # Decoders in the seq2seq mapping (AudioFlamingo3, MusicFlamingo: audio placeholders, then text): a causal LM.
    HeadFamily(SEQ2SEQ_LM, _multimodal_lm, encoder_decoder=False),
    *(HeadFamily(_class_names(mapping), _not_a_sum(reason)) for mapping, reason in NOT_A_SUM.items()),
)


def _head_by_class(model: nn.Module, sample_labels, smoothing: float) -> LossHead:
    name = _class_name(model)
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    for family in HEAD_FAMILIES:
        if name in family.classes and family.encoder_decoder in (None, encoder_decoder):
            return family.build(name, model, sample_labels, smoothing)
    raise UnsupportedHead(
        f"{name} is not a head hf_parallel knows (causal/seq2seq/masked/multimodal LM, token/sequence/image/video/"
        "audio classification, multiple choice, question answering, CTC, semantic segmentation)."
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


def _returns_router_logits(config) -> bool:
    text = text_config(config)
    return bool(getattr(config, "output_router_logits", False) or getattr(text, "output_router_logits", False))


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
    head = _head_by_class(model, sample_labels, label_smoothing)
    if head.shift and _returns_router_logits(config):
        # A MoE LM adds its router's load-balancing loss to the cross-entropy. One whose sizes cannot be read (or that
        # adds none: several return their router logits only) keeps the plain head, and the check judges it.
        head.router = router_balance_of(model)
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
