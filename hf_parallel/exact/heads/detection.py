"""
DETR-style object detection (`DetrForObjectDetection`, Table Transformer, YOLOS; Deformable, Conditional and DAB-DETR):
per-image loss terms once each image's predictions are matched to its boxes.

transformers matches the queries of each image to that image's boxes alone (a Hungarian assignment per image, on a
cost that is elementwise per query and box), so the matching of an image does not depend on the rest of its batch.
Once matched, every term is a sum over the batch's images with its own denominator:

- the box terms: `bbox_loss_coefficient` x L1 + `giou_loss_coefficient` x (1 - GIoU) over the matched pairs, divided
  by the batch's box count (at least 1);
- the class term: for `ForObjectDetectionLoss` (DETR, Table Transformer, YOLOS) a cross-entropy over every query,
  weighted 1 for a class and `eos_coefficient` for "no object", divided by the sum of those weights (the items are
  weights, not whole numbers); for `DeformableDetrForObjectDetectionLoss` (Deformable, Conditional, DAB-DETR) a sigmoid
  focal loss over every query and class, divided by the box count;
- with `config.auxiliary_loss`, each earlier decoder layer's predictions are matched and add the same terms.

So a step's loss is exact as sums over its images and rows over the whole step's counts: the counts of a batch come
from its labels alone (boxes, and per image min(boxes, queries) + eos x the unmatched queries).

The earlier layers' predictions are only built when the model gets its labels: they stay in the forward, and the head
records them from the model's loss call (`LossCallWatch`); outside a checked forward the model's own loss is not run
(`LossCall.stand_in`: its matching would run twice). Under DDP the model divides its box terms by the ranks' mean box
count over the world size again (accelerate's `reduce`: x world size); in the checked forward the model's loss is
computed on its own rows (`LossCall.own_context`), as one device computes it.

The labels (a list of one dict per image, `class_labels` and `boxes`) travel packed (`BoxTargets`, padded tensors with
the images as rows), so that DataParallel splits them with the images and the padding rows of an epoch's last step are
dropped like any other row; the model gets its list back.

```python
from hf_parallel.exact import resolve_head

head = resolve_head(model)  # a DetectionHead, for a DetrForObjectDetection with auxiliary_loss=False
sums, counts = head.row_terms(model(pixel_values=images), head.pop_labels({"labels": targets}))  # [images, 2] each
loss = head.combine(sums.sum(0), counts.sum(0))  # the model's own loss on these images
```
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from transformers.loss import loss_for_object_detection
from transformers.loss.loss_deformable_detr import DeformableDetrForObjectDetectionLoss, DeformableDetrHungarianMatcher
from transformers.loss.loss_for_object_detection import ForObjectDetectionLoss, HungarianMatcher

from .base import LOSS_CALL_KEY, HeadFamily, HeadMismatch, LossCall, LossHead, Route, UnsupportedHead, class_names

try:
    from transformers.loss import loss_lw_detr
except ImportError:  # transformers before LW-DETR
    loss_lw_detr = None

__all__ = ["OBJECT_DETECTION", "BoxTargets", "DetectionHead", "GroupedDetectionHead"]


class BoxTargets(NamedTuple):
    """
    The targets of a batch of images packed by image: `class_labels` `[images, boxes]` (-1 past an image's boxes) and
    `boxes` `[images, boxes, 4]` (center x, center y, width, height, relative). A NamedTuple of tensors whose first
    dimension is the images, so that DataParallel splits it with them.
    """

    class_labels: torch.Tensor
    boxes: torch.Tensor

    @classmethod
    def pack(cls, targets) -> BoxTargets:
        """From the list of one dict per image that the models take (`class_labels`, `boxes`)."""
        if isinstance(targets, BoxTargets):
            return targets
        if not isinstance(targets, (list, tuple)) or not all(
            isinstance(t, dict) and "class_labels" in t and "boxes" in t for t in targets
        ):
            raise HeadMismatch(
                "object detection labels must be a list of one dict per image with `class_labels` [boxes] and `boxes` "
                f"[boxes, 4] (what the DETR image processors make); got {type(targets).__name__}."
            )
        classes = [torch.as_tensor(t["class_labels"]).long().reshape(-1) for t in targets]
        boxes = [torch.as_tensor(t["boxes"]).reshape(-1, 4) for t in targets]
        return cls(pad_sequence(classes, batch_first=True, padding_value=-1), pad_sequence(boxes, batch_first=True))

    def box_counts(self) -> torch.Tensor:
        """`[images]`: the boxes of each image."""
        return self.class_labels.ge(0).sum(-1)

    def for_model(self) -> list[dict[str, torch.Tensor]]:
        """The list of one dict per image that the models take."""
        counts = self.box_counts().tolist()
        return [
            {"class_labels": classes[:n], "boxes": boxes[:n]}
            for classes, boxes, n in zip(self.class_labels, self.boxes, counts, strict=True)
        ]


def _stand_in_loss(arguments: dict):
    """What a DETR model's loss call returns where hf_parallel computes the loss: no loss, and the earlier layers'
    predictions as the model's loss would list them."""
    classes, coords = arguments.get("outputs_class"), arguments.get("outputs_coord")
    if classes is None or coords is None or not getattr(arguments.get("config"), "auxiliary_loss", False):
        return None, None, None
    return None, None, [{"logits": a, "pred_boxes": b} for a, b in zip(classes[:-1], coords[:-1], strict=True)]


class _NoSharedState:
    """Stands for accelerate's `PartialState` where transformers' DETR loss asks whether processes share a state."""

    _shared_state: dict = {}


# (module, name, stand-in) of what makes a detection loss count over every process, where the module has it.
_LOCAL_COUNTS = (
    (loss_for_object_detection, "PartialState", _NoSharedState),
    (loss_lw_detr, "_is_torch_distributed_initialized", lambda: False),
)


_patch_lock = threading.Lock()
_patch_depth = 0


@contextlib.contextmanager
def _rows_alone():
    """
    Within it, transformers' DETR losses count the boxes of their own rows, as on one device: in a run of several
    processes DETR's reduce the count over the ranks (accelerate's `reduce`, a mean) and divide it by the world size
    again, LW-DETR's all-reduce it and divide by the world size. Only where several processes run; nested and
    threaded uses share one patch.
    """
    global _patch_depth
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield
        return
    with _patch_lock:
        if _patch_depth == 0:
            patches = [(module, name, value) for module, name, value in _LOCAL_COUNTS if hasattr(module, name)]
            _rows_alone.saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
            for module, name, value in patches:
                setattr(module, name, value)
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                for module, name, value in _rows_alone.saved:
                    setattr(module, name, value)


class DetectionHead(LossHead):
    """
    The per-image terms of a DETR-style detection loss.

    Args:
        matcher (`nn.Module`): the model's Hungarian matcher (transformers' own class, with the config's costs).
        queries (`int`): the predictions per image (`num_queries`, YOLOS's `num_detection_tokens`).
        num_classes (`int`): `config.num_labels`.
        bbox_weight (`float`), giou_weight (`float`): `config.bbox_loss_coefficient`, `config.giou_loss_coefficient`.
        auxiliary_layers (`int`): the earlier decoder layers whose predictions add their terms (0 without
            `config.auxiliary_loss`).
        eos_weight (`float`, *optional*): `config.eos_coefficient` for a softmax class term; None for the focal one.
        focal_alpha (`float`, *optional*): `config.focal_alpha` of the focal class term.
    """

    route = Route.LABELS_IN_FORWARD
    #: What the matcher takes besides the predictions and targets (LW-DETR's: its query groups).
    match_options: dict = {}
    #: The query groups, each matched to an image's boxes on its own, so that the boxes count once per group (LW-DETR).
    groups: int = 1
    # The earlier layers' predictions exist only inside the forward; the model's own matching is spared outside the
    # check, and in it runs on this rank's rows alone.
    loss_call = LossCall(("outputs_class", "outputs_coord"), stand_in=_stand_in_loss, own_context=_rows_alone)

    def __init__(
        self,
        matcher: nn.Module,
        queries: int,
        num_classes: int,
        bbox_weight: float,
        giou_weight: float,
        auxiliary_layers: int,
        eos_weight: float | None = None,
        focal_alpha: float = 0.25,
    ):
        focal = eos_weight is None
        super().__init__(("labels",), "object_detection/" + ("focal" if focal else "softmax"))
        self.matcher, self.queries, self.num_classes = matcher, int(queries), int(num_classes)
        self.bbox_weight, self.giou_weight = float(bbox_weight), float(giou_weight)
        self.auxiliary_layers, self.eos_weight, self.focal_alpha = int(auxiliary_layers), eos_weight, focal_alpha
        # Softmax: [class term over the class weights, box terms over the boxes]; focal: every term over the boxes.
        # What each term's count is clamped to: the model's max(boxes, 1); a sum of class weights is never clamped
        # (any sum of weights above 0 is at least the smallest weight).
        self.floors = (1.0,) if focal else (min(1.0, eos_weight) if eos_weight > 0 else 1.0, 1.0)
        self.weights = (1.0,) * len(self.floors)

    def pop_labels(self, inputs: dict) -> dict:
        labels = super().pop_labels(inputs)
        labels["labels"] = BoxTargets.pack(labels["labels"])
        return labels

    def count(self, labels: dict, seq_len: int | None = None) -> torch.Tensor:
        return self._row_counts(BoxTargets.pack(labels["labels"])).sum(0)

    def combine(self, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.to(sums.device, sums.dtype)
        return sum((sums[..., k] / counts[..., k].clamp(min=floor)).sum() for k, floor in enumerate(self.floors))

    def row_terms(self, outputs, labels: dict) -> tuple[torch.Tensor, torch.Tensor]:
        targets = BoxTargets.pack(labels["labels"])
        logits, boxes = outputs["logits"], outputs["pred_boxes"]
        self._check_logits(logits, len(targets.class_labels))
        targets = BoxTargets(*(part.to(logits.device) for part in targets))
        lists = targets.for_model()
        class_sums = box_sums = logits.new_zeros(len(lists), dtype=torch.float32)
        for layer_logits, layer_boxes in self._layers(logits, boxes, labels.get(LOSS_CALL_KEY, {}), outputs):
            image, query, target = self._matched(layer_logits, layer_boxes, lists)
            class_sums = class_sums + self._class_sums(layer_logits, layer_boxes, targets, image, query, target)
            pairs = self._box_terms(layer_boxes[image, query].float(), targets.boxes[image, target].float())
            box_sums = box_sums.index_add(0, image, pairs)
        sums = torch.stack([class_sums, box_sums], -1)
        # A focal class term has the boxes for its count too: one term.
        return (sums if self.eos_weight is not None else sums.sum(-1, keepdim=True)), self._row_counts(targets)

    def _check_logits(self, logits: torch.Tensor, rows: int) -> None:
        classes = self.num_classes + (0 if self.eos_weight is None else 1)
        if logits.shape[:2] != (rows, self.queries) or logits.shape[-1] != classes:
            raise HeadMismatch(
                f"{self.name}: logits of shape {tuple(logits.shape)} are not [{rows} images, {self.queries} queries, "
                f"{classes} classes]."
            )

    def _layers(self, logits, boxes, call: dict, outputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (logits, boxes) the loss matches and scores: the last decoder layer's, then the earlier ones' (as the
        model's loss takes them: all but the last layer)."""
        if not self.auxiliary_layers:
            return [(logits, boxes)]
        classes, coords = call.get("outputs_class"), call.get("outputs_coord")
        if classes is None or coords is None:
            raise HeadMismatch(f"{self.name}: the model did not pass its decoder layers' predictions to its loss.")
        return [(logits, boxes), *list(zip(classes[:-1], coords[:-1], strict=True))[: self.auxiliary_layers]]

    def _row_counts(self, targets: BoxTargets) -> torch.Tensor:
        """`[images, terms]` float64: the boxes (once per query group), and for a softmax class term first the sum of
        its class weights."""
        boxes = targets.box_counts().double()
        if self.eos_weight is None:
            return (boxes * self.groups).unsqueeze(-1)
        matched = boxes.clamp(max=self.queries)
        return torch.stack([matched + (self.queries - matched) * self.eos_weight, boxes], -1)

    def _matched(self, logits: torch.Tensor, boxes: torch.Tensor, lists: list[dict]):
        """`(image, query, target)` index vectors of the matched pairs, on the logits' device."""
        indices = self.matcher({"logits": logits.detach(), "pred_boxes": boxes.detach()}, lists, **self.match_options)
        image = torch.cat([torch.full_like(queries, i) for i, (queries, _) in enumerate(indices)])
        query, target = (torch.cat(column) for column in zip(*indices, strict=True))
        return image.to(logits.device), query.to(logits.device), target.to(logits.device)

    def _class_sums(self, logits, boxes, targets: BoxTargets, image, query, target) -> torch.Tensor:
        """`[images]`: the class term's sum of each image (its weighted cross-entropy, or its focal loss)."""
        classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.long, device=logits.device)
        classes[image, query] = targets.class_labels[image, target]
        logits = logits.float()
        if self.eos_weight is not None:
            weight = F.pad(logits.new_ones(self.num_classes), (0, 1), value=self.eos_weight)
            return F.cross_entropy(logits.transpose(1, 2), classes, weight, reduction="none").sum(-1)
        onehot = F.one_hot(classes, self.num_classes + 1)[..., :-1].to(logits.dtype)
        return _focal(logits, onehot, self.focal_alpha).flatten(1).sum(-1)

    def _box_terms(self, predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """`[pairs]`: bbox weight x L1 + GIoU weight x (1 - GIoU) of each matched pair."""
        l1 = (predicted - target).abs().sum(-1)
        return self.bbox_weight * l1 + self.giou_weight * (1 - _pairwise_iou(predicted, target, generalized=True))


class GroupedDetectionHead(DetectionHead):
    """
    LW-DETR's and RF-DETR's detection loss (`LwDetrForObjectDetectionLoss`), per image: the queries come in
    `groups` (group DETR: in training `groups` x `queries` predictions, each group matched to the image's boxes on its
    own; the loss always splits the predictions into `groups`), the class term is IoU-aware (each matched query's
    target is its class probability^alpha x its box's IoU^(1 - alpha), at least 0.01; every other query and class is
    pushed to 0 with a weight of its probability squared), and the decoder's earlier layers and the encoder's
    proposals add the same terms. Every term, weighted by `class_loss_coefficient`, `bbox_loss_coefficient` and
    `giou_loss_coefficient`, is divided by one count: the step's boxes x `groups` (at least 1).

    Args:
        matcher (`nn.Module`), queries (`int`), num_classes (`int`), bbox_weight (`float`), giou_weight (`float`),
            auxiliary_layers (`int`), focal_alpha (`float`): as for `DetectionHead`.
        class_weight (`float`): `config.class_loss_coefficient`.
        groups (`int`): `config.group_detr`.
    """

    loss_call = DetectionHead.loss_call._replace(
        arguments=("outputs_class", "outputs_coord", "enc_outputs_class", "enc_outputs_coord")
    )

    def __init__(self, matcher, queries, num_classes, bbox_weight, giou_weight, auxiliary_layers, **options):
        groups, class_weight = int(options.pop("groups")), float(options.pop("class_weight"))
        super().__init__(matcher, queries, num_classes, bbox_weight, giou_weight, auxiliary_layers, **options)
        self.name = "object_detection/grouped"
        self.groups, self.class_weight = groups, class_weight
        self.match_options = {"group_detr": groups}

    def _check_logits(self, logits: torch.Tensor, rows: int) -> None:
        # The queries: `groups` x `queries` in training, `queries` in evaluation.
        if logits.dim() != 3 or logits.shape[0] != rows or logits.shape[-1] != self.num_classes:
            raise HeadMismatch(
                f"{self.name}: logits of shape {tuple(logits.shape)} are not [{rows} images, queries, "
                f"{self.num_classes} classes]."
            )

    def _layers(self, logits, boxes, call: dict, outputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layers = super()._layers(logits, boxes, call, outputs)
        # Then the encoder's proposals (logits, boxes), which the loss matches and scores like a decoder layer's.
        classes, coords = call.get("enc_outputs_class"), call.get("enc_outputs_coord")
        if classes is None or coords is None:
            classes, coords = outputs.get("enc_outputs_class"), outputs.get("enc_outputs_coord_logits")
        if classes is None or coords is None:
            raise HeadMismatch(f"{self.name}: the model gave no encoder proposals to its loss.")
        return [*layers, (classes, coords)]

    def _class_sums(self, logits, boxes, targets: BoxTargets, image, query, target) -> torch.Tensor:
        """`[images]`: the IoU-aware class term of each image over every query and class, weighted."""
        dtype = logits.dtype
        probability = logits.sigmoid()
        positive = torch.zeros_like(logits)
        negative = probability.pow(2).to(dtype)
        classes = targets.class_labels[image, target]
        iou = _pairwise_iou(boxes[image, query].detach(), targets.boxes[image, target]).to(dtype)
        quality = probability[image, query, classes].pow(self.focal_alpha) * iou.pow(1 - self.focal_alpha)
        quality = quality.clamp(0.01).detach().to(dtype)
        positive[image, query, classes] = quality
        negative[image, query, classes] = 1 - quality
        loss = -positive * probability.log() - negative * (1 - probability).log()
        return self.class_weight * loss.flatten(1).sum(-1).float()


def _focal(logits: torch.Tensor, target: torch.Tensor, alpha: float, gamma: float = 2.0) -> torch.Tensor:
    """The sigmoid focal loss of each entry (RetinaNet's, as transformers' DETR losses take it)."""
    probability = logits.sigmoid()
    loss = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    p_t = probability * target + (1 - probability) * (1 - target)
    loss = loss * (1 - p_t) ** gamma
    if alpha >= 0:
        loss = (alpha * target + (1 - alpha) * (1 - target)) * loss
    return loss


def _pairwise_iou(a: torch.Tensor, b: torch.Tensor, generalized: bool = False) -> torch.Tensor:
    """`[pairs]`: the IoU of boxes `a[i]` and `b[i]` (center format); with `generalized`, their generalized IoU."""
    # Corner format: (x0, y0, x1, y1).
    a, b = (torch.cat([box[..., :2] - box[..., 2:] / 2, box[..., :2] + box[..., 2:] / 2], -1) for box in (a, b))
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    inner = (torch.min(a[:, 2:], b[:, 2:]) - torch.max(a[:, :2], b[:, :2])).clamp(min=0)
    intersection = inner[:, 0] * inner[:, 1]
    union = area_a + area_b - intersection
    if not generalized:
        return intersection / union
    outer = (torch.max(a[:, 2:], b[:, 2:]) - torch.min(a[:, :2], b[:, :2])).clamp(min=0)
    enclosing = outer[:, 0] * outer[:, 1]
    return intersection / union - (enclosing - union) / enclosing


# transformers' DETR loss functions: the matcher each uses, and its class term ("softmax", "focal", or LW-DETR's
# "grouped" IoU-aware one).
_LOSSES = {
    ForObjectDetectionLoss: (HungarianMatcher, "softmax"),
    DeformableDetrForObjectDetectionLoss: (DeformableDetrHungarianMatcher, "focal"),
}
if loss_lw_detr is not None:
    _LOSSES[loss_lw_detr.LwDetrForObjectDetectionLoss] = (loss_lw_detr.LwDetrHungarianMatcher, "grouped")

# Why the other detection losses of transformers stay on the stock loss, by the start of their loss function's name.
_DENOISING_LOSSES = ("RTDetr", "DFine", "Deimv2")
_DENOISING = (
    ": in training its forward adds denoising queries built from the whole batch's boxes (as many groups as its "
    "denoising queries over the batch's largest box count, their noise drawn per batch), so no split of a step "
    "equals one forward"
)


def _detection(name: str, model, labels, smoothing: float) -> LossHead:
    config = model.config
    loss_function = getattr(model, "loss_function", None)
    if loss_function not in _LOSSES:
        function = getattr(loss_function, "__name__", str(loss_function))
        why = _DENOISING if function.startswith(_DENOISING_LOSSES) else ""
        raise UnsupportedHead(
            f"{name}'s detection loss ({function}) is not one hf_parallel computes per image (it knows DETR's and "
            f"Deformable DETR's){why}."
        )
    queries = getattr(config, "num_queries", None) or getattr(config, "num_detection_tokens", None)
    if not isinstance(queries, int):
        raise UnsupportedHead(f"{name}'s config gives no number of queries (num_queries, num_detection_tokens).")
    matcher_class, kind = _LOSSES[loss_function]
    # transformers imports its box helpers (`center_to_corners_format`) only where Pillow is installed, and without
    # them its matcher stops with "NameError: name 'center_to_corners_format' is not defined" (stock's training as
    # well as the head's matching).
    if not hasattr(loss_for_object_detection, "center_to_corners_format"):
        raise ImportError(
            f"{name}'s Hungarian matching (transformers' own) needs Pillow, without which transformers does not "
            "import its box helpers (NameError: name 'center_to_corners_format' is not defined): pip install pillow."
        )
    try:
        matcher = matcher_class(class_cost=config.class_cost, bbox_cost=config.bbox_cost, giou_cost=config.giou_cost)
    except ImportError as missing:  # the matcher needs scipy
        raise UnsupportedHead(f"{name}'s Hungarian matching needs scipy: pip install scipy.") from missing
    auxiliary = max(getattr(config, "decoder_layers", 1) - 1, 0) if getattr(config, "auxiliary_loss", False) else 0
    common = (matcher, queries, config.num_labels, config.bbox_loss_coefficient, config.giou_loss_coefficient)
    alpha = float(getattr(config, "focal_alpha", 0.25))
    if kind == "grouped":
        options = {"groups": config.group_detr, "class_weight": config.class_loss_coefficient}
        return GroupedDetectionHead(*common, auxiliary, focal_alpha=alpha, **options)
    eos_weight = float(config.eos_coefficient) if kind == "softmax" else None
    return DetectionHead(*common, auxiliary, eos_weight=eos_weight, focal_alpha=alpha)


OBJECT_DETECTION = HeadFamily(class_names("MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES"), _detection)
