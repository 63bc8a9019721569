"""
Which `LossHead` a transformers model has, from its class and config (the families' registry,
`hf_parallel.exact.heads.HEAD_FAMILIES`), through PEFT adapters and FSDP2's classes; or why it cannot be made exact.
"""

from __future__ import annotations

import torch
from torch import nn

from .heads import HEAD_FAMILIES, CrossEntropyHead, HeadFamily, LossHead, ProblemTypeUnsettled, UnsupportedHead
from .heads.router import router_balance_of, text_config

__all__ = [
    "HEAD_FAMILIES",
    "HeadFamily",
    "ProblemTypeUnsettled",
    "UnsupportedHead",
    "counting_head",
    "inside_adapters",
    "resolve_head",
]

# PEFT adapters that leave the sequence as it is: prefix tuning and cartridges add keys and values, not positions.
# Every other prompt-learning adapter prepends virtual tokens to the input, so a decoder's logits have more
# positions than its labels.
_SEQUENCE_KEEPING_PROMPTS = frozenset({"PREFIX_TUNING", "CARTRIDGE"})


def inside_adapters(model: nn.Module) -> tuple[nn.Module, str | None]:
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
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch build without distributed support: no class derived by FSDP2
        FSDPModule = ()
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule)).__name__


def counting_head(shift: bool) -> LossHead:
    """The head of a Trainer's `compute_loss_func` on a model hf_parallel does not know: it only counts the items of
    a step (non-ignored targets, shifted where stock's count is), as stock counts them."""
    return CrossEntropyHead(name="compute_loss_func", shift=shift)


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
    model, virtual_tokens = inside_adapters(model)
    name = _class_name(model)
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedHead(f"{name} has no `config`: not a transformers model with a known head.")
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    families = (f for f in HEAD_FAMILIES if name in f.classes and f.encoder_decoder in (None, encoder_decoder))
    family = next(families, None)
    if family is None:
        raise UnsupportedHead(
            f"{name} is not a head hf_parallel knows (causal/seq2seq/masked/multimodal LM, token/sequence/image/video/"
            "audio classification, multiple choice, question answering, CTC, semantic segmentation)."
        )
    head = family.build(name, model, sample_labels, label_smoothing)
    if label_smoothing and not (family.label_smoothing and head.smoothing == label_smoothing):
        # Stock applies its LabelSmoother to whatever the logits are (a regression's, a DETR's: there it stops with
        # "'list' object has no attribute 'dim'"), or skips it where the labels have other keys.
        raise ValueError(
            f"label_smoothing_factor={label_smoothing} does not apply to {name}'s {head.name} loss: label smoothing "
            "is for a cross-entropy over classes (language models, token, sequence and single-label media "
            "classification, multiple choice). Set label_smoothing_factor=0 for this model."
        )
    if head.shift and any(getattr(c, "output_router_logits", False) for c in (config, text_config(config))):
        # A MoE LM adds its router's load-balancing loss to the cross-entropy. One whose sizes cannot be read (or that
        # adds none: several return their router logits only) keeps the plain head, and the check judges it.
        head.router = router_balance_of(model)
    if virtual_tokens is not None and head.per_position and not head.builds_decoder_inputs:
        raise UnsupportedHead(
            f"the {virtual_tokens} adapter on {name} prepends virtual tokens, so the logits have more positions "
            "than the labels."
        )
    if label_names is not None and tuple(label_names) != head.label_keys:
        raise UnsupportedHead(
            f"{name} takes labels {list(head.label_keys)}, but the Trainer's label_names are {label_names}."
        )
    return head
