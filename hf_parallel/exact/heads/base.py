"""
The base of every loss head (`LossHead`), how a head's micro-batch loss is made (`Route`, set by `routed`), the
errors that rule a head out, and the registry row a head family declares (`HeadFamily`).

Every family module of this package builds on these alone; nothing here knows a model family.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import inspect
import operator
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers.models.auto import modeling_auto

__all__ = [
    "IGNORE_INDEX",
    "LOSS_CALL_KEY",
    "NO_GRAD_CHUNK_ELEMENTS",
    "HeadFamily",
    "HeadMismatch",
    "LossCall",
    "LossCallWatch",
    "LossHead",
    "ProblemTypeUnsettled",
    "Route",
    "UnsupportedHead",
    "class_names",
    "index_in_step",
    "packed_sample_ids",
    "sample_ids_of",
    "routed",
    "sequence_length",
]

IGNORE_INDEX = -100
#: Logits entries per chunk of a per-position loss computed without autograd (64 MiB of float32).
NO_GRAD_CHUNK_ELEMENTS = 2**24

#: The labels key under which a forward's `LossCallWatch` leaves the arguments of the model's loss call.
LOSS_CALL_KEY = "hf_parallel_loss_call"


@functools.lru_cache(maxsize=64)
def _signature(function: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def call_arguments(function: Callable, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call of `function` by parameter name, positional ones included (as given, no defaults)."""
    signature = _signature(function)
    if signature is None:
        return dict(kwargs)
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return dict(kwargs)
    extra = bound.pop(next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {})
    return {**bound, **extra}


class LossCallWatch:
    """
    The arguments `model` passes to its own `loss_function` in a forward (by parameter name, positional ones too),
    recorded by a stand-in `loss_function` until `remove`. Per thread: each DataParallel replica (a copy of the model's
    attributes, this stand-in included) runs in its own thread and records there.

    The stand-in calls the model's own loss function, within `around()` where given; or, with `instead`, returns
    `instead(arguments)` without calling it (a loss the head computes anyway, and that would cost as much again).

    Args:
        model (`nn.Module`): the transformers model, out of DataParallel/DDP wrappers.
        names (`tuple[str, ...]`): the arguments to record.
        modules (`tuple[str, ...]`, *optional*): submodules of the model (attribute names) whose outputs to record
            under their names, as their forwards run (a segmentation model's `auxiliary_head`).
        instead (`Callable`, *optional*): what the loss call returns, from its arguments, in place of the model's loss.
        around (`Callable`, *optional*): a context manager factory the model's own loss runs within.
    """

    def __init__(
        self,
        model: nn.Module,
        names: tuple[str, ...],
        modules: tuple[str, ...] = (),
        instead: Callable[[dict], object] | None = None,
        around: Callable[[], contextlib.AbstractContextManager] | None = None,
    ):
        self.model, self.names = model, tuple(names)
        self._seen = threading.local()
        self._had_own = "_loss_function" in vars(model)
        self._own = vars(model).get("_loss_function")
        original = model.loss_function

        def recording(*args, **kwargs):
            arguments = call_arguments(original, args, kwargs)
            self._arguments().update({name: arguments[name] for name in self.names if name in arguments})
            if instead is not None:
                return instead(arguments)
            with around() if around is not None else contextlib.nullcontext():
                return original(*args, **kwargs)

        model.loss_function = recording  # transformers' setter: an instance attribute, which replicas copy
        # A replica shares its module's forward hooks (replication copies the module's __dict__): per thread too.
        self._hooks = [
            getattr(model, name).register_forward_hook(self._recorder(name))
            for name in modules
            if isinstance(getattr(model, name, None), nn.Module)
        ]

    def _arguments(self) -> dict:
        if not hasattr(self._seen, "arguments"):
            self._seen.arguments = {}
        return self._seen.arguments

    def _recorder(self, name: str):
        def record(module, args, output):
            self._arguments()[name] = output

        return record

    def take(self) -> dict:
        """What this thread's forward passed (empty when it did not call its `loss_function`). Forgets it."""
        return vars(self._seen).pop("arguments", {})

    def remove(self) -> None:
        """Give the model its own `loss_function` back, and remove the hooks on its submodules."""
        for hook in self._hooks:
            hook.remove()
        if self._had_own:
            self.model._loss_function = self._own
        else:
            vars(self.model).pop("_loss_function", None)


def sequence_length(batch: dict, main_input_name: str = "input_ids") -> int | None:
    """The sequence length of a batch, from its main input (or attention mask); None for inputs without one."""
    main = batch.get(main_input_name, batch.get("attention_mask"))
    return main.shape[1] if torch.is_tensor(main) and main.dim() > 1 else None


def index_in_step(batches: tuple[dict, ...], inputs: dict, what: str) -> int:
    """
    Which of a step's micro-batches `inputs` is: the one holding the same tensors, or equal ones (a batch moved to
    another device, or a copy); tensors whose dtype the Trainer changed (DeepSpeed's cast of floats) are not compared.
    `what` names the caller in the error where `inputs` is none of them.
    """
    tensors = [(key, value) for key, value in inputs.items() if torch.is_tensor(value) and key != "return_loss"]
    for same in (operator.is_, _equal):
        for index, batch in enumerate(batches):
            if all(same(batch.get(key), value) for key, value in tensors if _comparable(batch.get(key), value)):
                return index
    raise ValueError(
        f"{what}: this micro-batch is not one of the step's counted micro-batches, so the step has nothing counted "
        "for it. Pass the step's batches unchanged."
    )


def _comparable(own, given: torch.Tensor) -> bool:
    return not torch.is_tensor(own) or own.dtype == given.dtype


def _equal(own, given: torch.Tensor) -> bool:
    return torch.is_tensor(own) and own.shape == given.shape and torch.equal(own.to(given.device), given)


def packed_sample_ids(batch: dict) -> torch.Tensor | None:
    """
    For a batch of one row with `position_ids` (a packed row of several sequences, restarting at 0 at each), the
    sample index of each position, `[positions]`; None for any other batch (there a row is a sample).
    """
    position_ids = batch.get("position_ids")
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    # Without reading how many times the positions restart (a device sync per micro-batch): a row that starts once
    # is one sequence, sample 0 throughout (positions before its start, left padding, count as sample 0 too).
    return (position_ids[0].eq(0).cumsum(0) - 1).clamp(min=0)


def sample_ids_of(head, batch: dict) -> torch.Tensor | None:
    """The sample of each position of a packed row (see `packed_sample_ids`); None for a head that is not per position
    (only those are packed: several sequences in one row)."""
    return packed_sample_ids(batch) if head.per_position else None


class LossCall(NamedTuple):
    """
    What a head needs of the model's own loss call and forward, declared by its family (`LossHead.loss_call`): the
    forward then keeps the labels, and a `LossCallWatch` records what is named into the labels under `LOSS_CALL_KEY`.

    Args:
        arguments (`tuple[str, ...]`, *optional*): the arguments of the model's `loss_function` call the head reads
            (CTC's `logit_lengths`).
        submodules (`tuple[str, ...]`, *optional*): submodules whose outputs the head reads and the model's outputs do
            not carry (a segmentation model's `auxiliary_head`), recorded by name.
        stand_in (`Callable`, *optional*): what the loss call returns, from its arguments, in a forward whose loss is
            not checked, in place of the model's own loss (which the head recomputes: a DETR's matching would run
            twice).
        own_context (`Callable`, *optional*): a context manager factory the model's own loss runs within in a checked
            forward (a DETR's: its box count kept to its own rows).
        inferred (`Callable`, *optional*): `inferred(model, inputs)`, the arguments as a model that computes its loss
            inline (and so passes nothing) computes them.
    """

    arguments: tuple[str, ...] = ()
    submodules: tuple[str, ...] = ()
    stand_in: Callable[[dict], object] | None = None
    own_context: Callable[[], contextlib.AbstractContextManager] | None = None
    inferred: Callable[[nn.Module, dict], dict] | None = None


class HeadMismatch(ValueError):
    """
    A head's loss cannot be computed from these outputs and labels (their shapes do not match: something between
    them adds or drops positions). In the checked forward it only rules the head out; after it, it stops the run.
    """


def _logits(outputs, key: str = "logits") -> torch.Tensor:
    if isinstance(outputs, dict):
        return outputs[key]
    return outputs[0]


class UnsupportedHead(ValueError):
    """The model's loss cannot be recomputed exactly from its logits; the reason names what to do."""


class ProblemTypeUnsettled(UnsupportedHead):
    """
    A sequence classifier whose `config.problem_type` is unset, before any labels were seen: transformers settles it
    from the first labels (their dtype and the number of labels), so the head is known at the first batch.
    """


class Route(enum.Enum):
    """
    How a head's micro-batch loss S / C is made (the table in `hf_parallel.exact`'s docstring says which heads take
    which, and why). The Trainer's stock loss, where no head applies, is no route: the head is None.
    """

    #: The labels are kept out of the forward; S is computed from the logits by the head (the default).
    RECOMPUTED = "recomputed"
    #: The labels stay in the forward (the model builds its decoder inputs from them); S from the logits, as above.
    LABELS_IN_FORWARD = "labels_in_forward"
    #: The model's own loss, given its labels and `num_items_in_batch` = C, is S / C itself (it honours the count).
    MODEL_LOSS = "model_loss"
    #: The Trainer's `compute_loss_func`, given the step's count; the head only counts the items.
    USER_LOSS = "user_loss"
    #: The Trainer subclass's own `compute_loss` (TRL's), given the step's count; the head turns it into S
    #: (`hf_parallel.exact.heads.trainers`).
    TRAINER_LOSS = "trainer_loss"


def routed(head: LossHead, route: Route) -> LossHead:
    """
    A copy of `head` that takes `route`; the one place a route is set. A route the check chose names the head for it
    (`causal_lm/model_loss`); the user's loss keeps the head's name.
    """
    other = copy.copy(head)
    other.route = route
    if route in (Route.MODEL_LOSS, Route.LABELS_IN_FORWARD) and not head.name.endswith(f"/{route.value}"):
        other.name = f"{head.name}/{route.value}"
    return other


class LossHead:
    """
    The base of every head: label keys, term weights, counting, combining. Subclasses say what a target is, which of
    its entries are items, and how the per-row sums are computed.

    Args:
        label_keys (`tuple[str, ...]`, *optional*, defaults to `("labels",)`):
            The batch keys that hold targets; popped before the forward.
        name (`str`, *optional*):
            What the head is, for messages (`"causal_lm"`, `"sequence_classification/regression"`, ...).
    """

    #: How the micro-batch's loss is made (`Route`); set with `routed`.
    route: Route = Route.RECOMPUTED
    #: Weight of each loss term in `combine`.
    weights: tuple[float, ...] = (1.0,)
    #: Whether the model builds its decoder inputs from the labels (encoder-decoder LMs): without the labels, the
    #: caller must build them.
    builds_decoder_inputs: bool = False
    #: Whether the targets are the labels shifted by one position (decoder-only LMs).
    shift: bool = False
    #: Whether the logits have one row per label position (LMs, token classification), not one per sample.
    per_position: bool = False
    #: Whether the items are the targets not set to the ignore index (-100), as in a cross-entropy: the padding rows of
    #: an epoch's last step are then masked in the targets themselves (so a model given its labels counts as the head
    #: does), and the model's own loss, given the step's count, may be the head's (`Route.MODEL_LOSS`).
    ignore_index_items: bool = False
    #: Whether the check also tries this head with the other causal shift (a per-position
    #: cross-entropy whose model may not shift as its class suggests: standalone decoders, XLNet).
    shift_ambiguous: bool = False
    #: The label smoothing epsilon the head applies (`TrainingArguments.label_smoothing_factor`); a family whose row
    #: does not declare `label_smoothing` never gets one (`hf_parallel.exact.resolve_head` refuses it).
    smoothing: float = 0.0
    #: Whether the model's loss is a plain sum over its items (CTC with `ctc_loss_reduction="sum"`): nothing divides
    #: it, so the step's loss is the sum of its micro-batches' sums, and `combine` ignores the counts.
    summed: bool = False
    #: What the head needs of the model's own loss call and forward (`LossCall`: CTC's logit lengths, a DETR's earlier
    #: decoder layers, a segmentation model's auxiliary head); None for a head that needs only the outputs.
    loss_call: LossCall | None = None
    #: The router auxiliary loss the model adds to this head's (a MoE LM with `output_router_logits=True`), made
    #: exact over the whole batch by `hf_parallel.exact.heads.router`; None for a model without one.
    router = None
    #: Whether each row's loss depends on the other rows of the batch (a contrastive loss): the loss is computed on
    #: the whole step's embeddings (`hf_parallel.exact.coupled`), not as a sum over rows.
    batch_coupled: bool = False
    #: Rows of a batch per sample: 2 for a preference batch, whose pairs are `[first rows; second rows]`.
    rows_per_sample: int = 1

    def __init__(self, label_keys: tuple[str, ...] = ("labels",), name: str | None = None):
        self.label_keys = tuple(label_keys)
        self.name = name or type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, label_keys={self.label_keys})"

    @property
    def num_terms(self) -> int:
        return len(self.weights)

    def has_labels(self, batch) -> bool:
        """Whether `batch` holds every label key of this head."""
        return all(key in batch for key in self.label_keys)

    def pop_labels(self, inputs: dict) -> dict[str, torch.Tensor]:
        """Remove the targets from `inputs` (a dict the caller owns) and return them."""
        labels = {key: inputs.pop(key) for key in self.label_keys if key in inputs}
        missing = [key for key in self.label_keys if key not in labels]
        if missing:
            raise KeyError(f"The batch has no {missing} for the {self.name} loss; it has {sorted(inputs)}.")
        return labels

    def targets(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> list[torch.Tensor]:
        """One tensor per term whose valid entries are the items."""
        return [labels["labels"]]

    def valid(self, target: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Which entries of a target are items."""
        return target.ne(IGNORE_INDEX)

    def count(self, labels: dict[str, torch.Tensor], seq_len: int | None = None) -> torch.Tensor:
        """Items per term in a batch, from the labels alone (so a step can be counted before it runs)."""
        return torch.stack([self.valid(t, seq_len).sum() for t in self.targets(labels, seq_len)])

    def row_terms(self, outputs, labels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Per-row loss sums and item counts, each `[rows, num_terms]` (float32 sums, int64 counts).

        Rows are the first dimension of the labels, so evaluation can drop the duplicate rows that distributed
        samplers add, and sum the rest.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define row_terms.")

    def combine(self, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """
        `sum_k weight_k * sums_k / counts_k`, where a term with no item contributes 0 (never NaN); `sum_k weight_k *
        sums_k` for a `summed` head.
        """
        if self.summed:
            return sum(weight * sums[..., k].sum() for k, weight in enumerate(self.weights))
        ratios = sums / counts.to(sums.device, sums.dtype).clamp(min=1)
        # Python floats, not a tensor of the weights: building one each micro-batch is a host-to-device copy (and a
        # sync on CUDA) in the hot path.
        first = self.weights[0]
        if all(weight == first for weight in self.weights):
            return ratios.sum() * first if first != 1 else ratios.sum()
        return sum(weight * ratios[..., k].sum() for k, weight in enumerate(self.weights))


def class_names(*mappings: str) -> frozenset[str]:
    """The model class names of transformers' auto mappings (`MODEL_FOR_..._MAPPING_NAMES`); a release lacks some."""
    names = set()
    for mapping in mappings:
        for value in getattr(modeling_auto, mapping, {}).values():
            names.update(value if isinstance(value, (tuple, list)) else (value,))
    return frozenset(names)


class HeadFamily(NamedTuple):
    """
    One row of the registry (`hf_parallel.exact.heads.HEAD_FAMILIES`), declaring what the family supports and needs.

    Args:
        classes (`frozenset[str]`): the model classes of the family, by class name.
        build (`Callable`): `build(name, model, labels, smoothing)`, which gives their `LossHead` or raises
            `UnsupportedHead` naming why; the head declares what a micro-batch needs beyond one forward
            (`LossHead.loss_call`, `batch_coupled`, `router`) and how the check treats it.
        encoder_decoder (`bool`, *optional*): whether the classes must be encoder-decoders (True), must not be
            (False) or either (None).
        label_smoothing (`bool`, *optional*, defaults to `False`): whether the family applies
            `label_smoothing_factor` (a cross-entropy over classes); `resolve_head` refuses a factor on any other.
    """

    classes: frozenset[str]
    build: Callable[..., LossHead]
    encoder_decoder: bool | None = None
    label_smoothing: bool = False
