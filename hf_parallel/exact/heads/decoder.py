"""
Decoder inputs of an encoder-decoder LM, when the labels are kept out of its forward.

The exact loss takes the labels out of the forward (the loss is computed from the logits), so a model that builds
its decoder inputs from its labels no longer can: the caller builds them, with the model's own
`prepare_decoder_input_ids_from_labels`. Some encoder-decoders build them inside `forward` only, each its own way
(Blenderbot, BlenderbotSmall, M2M100, NLLB-MoE and SeamlessM4T shift the labels right from
`config.decoder_start_token_id`): their head is a `LabelsInForwardHead`, whose forward keeps the labels, so the
model builds its decoder inputs itself (and computes its own loss next to the logits, which the exact loss does not
use: one more cross-entropy per forward, the cost of never guessing).

A `prepare_decoder_input_ids_from_labels` does not prove that the forward builds the same: FSMT's shifts the labels,
while its forward, given labels and no decoder inputs, shifts the *inputs*. So the checked forward of a head (the
labels in, no decoder inputs: see `hf_parallel.exact.check`) watches what its decoder receives
(`DecoderInputsWatch`); where that is not what `decoder_input_ids` builds from the same labels, the head becomes a
`LabelsInForwardHead` (`keeping_labels_in_forward`).

```python
from hf_parallel.exact.heads.decoder import decoder_input_ids, needs_decoder_inputs

if needs_decoder_inputs(head, inputs):
    inputs["decoder_input_ids"] = decoder_input_ids(model, labels["labels"])
```
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from .base import HeadFamily, LossHead, Route, class_names
from .tokens import CrossEntropyHead

__all__ = [
    "MULTIMODAL_LM",
    "SEQ2SEQ_DECODER_LM",
    "SEQ2SEQ_LM",
    "DecoderInputsWatch",
    "LabelsInForwardHead",
    "decoder_input_ids",
    "keeping_labels_in_forward",
    "needs_decoder_inputs",
    "watch_decoder",
]


class LabelsInForwardHead(CrossEntropyHead):
    """The cross-entropy of an encoder-decoder that builds its decoder inputs inside its forward only: the labels
    stay in the model's inputs (`Route.LABELS_IN_FORWARD`), the loss is still recomputed from the logits."""

    route = Route.LABELS_IN_FORWARD


def decoder_input_ids(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """
    The decoder inputs `model` builds from `labels` when it is given no decoder inputs.

    Args:
        model (`nn.Module`): the encoder-decoder model, out of DataParallel/DDP wrappers.
        labels (`torch.Tensor`): `[rows, positions]` target ids, -100 where ignored.
    """
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if not callable(prepare):
        raise ValueError(
            f"{type(model).__name__} has no prepare_decoder_input_ids_from_labels: its head keeps the labels in the "
            "forward (LabelsInForwardHead), so that the model builds its decoder inputs itself."
        )
    # A copy: FSMT's shift_tokens_right replaces the -100 of the labels by the pad id in place, which would make the
    # ignored positions items of the loss.
    return prepare(labels=labels.clone())


def needs_decoder_inputs(head: LossHead, inputs: dict) -> bool:
    """Whether a forward of `inputs` without the labels needs decoder inputs built from them: `head` is an
    encoder-decoder LM's (`builds_decoder_inputs`) and `inputs` hold no decoder inputs of their own."""
    return head.builds_decoder_inputs and "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs


def keeping_labels_in_forward(head: CrossEntropyHead) -> LabelsInForwardHead:
    """`head` (an encoder-decoder LM's, `builds_decoder_inputs`), with the labels kept in the forward instead."""
    return LabelsInForwardHead(
        head.label_keys,
        f"{head.name}/labels_in_forward",
        shift=head.shift,
        smoothing=head.smoothing,
        per_position=head.per_position,
        shift_ambiguous=head.shift_ambiguous,
    )


class DecoderInputsWatch:
    """
    The decoder inputs a model builds itself in a forward that has the labels and no decoder inputs, recorded by a
    forward pre-hook on its decoder until `remove`. Per thread: each DataParallel replica runs in its own thread, and
    its decoder (a copy that shares the hooks of the model's) records there, for its own rows.

    Args:
        model (`nn.Module`): the encoder-decoder model, out of DataParallel/DDP wrappers.
        decoder (`nn.Module`): its decoder (`watch_decoder` finds it).
    """

    def __init__(self, model: nn.Module, decoder: nn.Module):
        self.model = model
        self._seen = threading.local()
        self._handle = decoder.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # The first call only: the inputs of the forward's decoder pass, not of a later call in the same thread.
        if not hasattr(self._seen, "ids"):
            self._seen.ids = kwargs["input_ids"] if "input_ids" in kwargs else (args[0] if args else None)

    def matches(self, labels: torch.Tensor) -> torch.Tensor:
        """
        `[1, 1]`: 1 where the decoder inputs this thread's forward built are those `decoder_input_ids` builds from
        `labels` (its rows), 0 where they differ, NaN where the decoder saw no ids. Forgets what it saw.
        """
        seen = vars(self._seen).pop("ids", None)
        if not torch.is_tensor(seen):
            return torch.full((1, 1), float("nan"), device=labels.device)
        try:
            # On the CPU (a copy of a few ids, once): a model's shift can fail on labels its forward never shifts
            # (FSMT's indexes a row without targets at -1), an exception here, a device-side assert on a GPU.
            built = decoder_input_ids(self.model, labels.cpu())
        except (IndexError, RuntimeError, ValueError):
            built = None  # split_labels cannot build them, where the model's forward did
        same = built is not None and seen.shape == built.shape and torch.equal(seen.cpu(), built)
        return torch.full((1, 1), float(same), device=labels.device)

    def remove(self) -> None:
        """Remove the hook."""
        self._handle.remove()


def watch_decoder(model: nn.Module) -> DecoderInputsWatch | None:
    """A `DecoderInputsWatch` on the decoder of `model` (unwrapped), or None when it has no decoder of its own."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    # transformers' get_decoder returns the model itself when it finds no decoder: its input_ids are the encoder's.
    if not isinstance(decoder, nn.Module) or decoder is model:
        return None
    return DecoderInputsWatch(model, decoder)


def _seq2seq_lm(name: str, model, labels, smoothing: float) -> LossHead:
    head = CrossEntropyHead(
        name="seq2seq_lm", smoothing=smoothing, builds_decoder_inputs=True, per_position=True, shift_ambiguous=False
    )
    if callable(getattr(model, "prepare_decoder_input_ids_from_labels", None)):
        return head
    # It builds its decoder inputs inside its forward only, from the labels (or, FSMT, from the inputs).
    return keeping_labels_in_forward(head)


def _multimodal_lm(name: str, model, labels, smoothing: float) -> LossHead:
    if getattr(model.config, "is_encoder_decoder", False):
        return _seq2seq_lm(name, model, labels, smoothing)
    return CrossEntropyHead(name="multimodal_lm", shift=True, smoothing=smoothing, per_position=True)


SEQ2SEQ_LM = HeadFamily(
    class_names("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    _seq2seq_lm,
    encoder_decoder=True,
    label_smoothing=True,
)
# Decoders in the seq2seq mapping (AudioFlamingo3, MusicFlamingo: audio placeholders, then text): a causal LM.
SEQ2SEQ_DECODER_LM = HeadFamily(SEQ2SEQ_LM.classes, _multimodal_lm, encoder_decoder=False, label_smoothing=True)
# Language models conditioned on images, audio or video: encoder-decoders (Whisper, Speech2Text, TrOCR and Donut as
# VisionEncoderDecoderModel) have the seq2seq LM loss, decoders with placeholder positions (LLaVA, Qwen2-VL,
# Voxtral, ...) the causal LM loss over every position the labels do not ignore.
MULTIMODAL_LM = HeadFamily(
    class_names(
        "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
        "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
        "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
    ),
    _multimodal_lm,
    label_smoothing=True,
)
