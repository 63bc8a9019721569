"""
The head families: how each kind of model head turns its outputs and labels into per-row loss **sums** and item
**counts**. One module per family, each with the same small surface:

- a `LossHead` subclass: `count(labels)`, the items per term from the labels alone (so a step is counted before it
  runs); `row_terms(outputs, labels)`, `[rows, terms]` loss sums and item counts; `combine(sums, counts)`,
  `sum_k weight_k * sums_k / counts_k`, a term without items contributing 0;
- one `HeadFamily` row per group of model classes: which classes, and a `build` that gives the head or raises
  `UnsupportedHead` naming why the family cannot be exact for this model (what it warns about);
- an entry in `HEAD_FAMILIES` below, in the order a class name is looked up.

| module | heads | families |
|---|---|---|
| `base` | `LossHead`, `Route`, `routed` | (the registry row, `HeadFamily`) |
| `tokens` | `CrossEntropyHead`, `token_losses` | causal LM, masked LM, token classification |
| `classification` | `RegressionHead`, `MultiLabelHead`, `QuestionAnsweringHead` | sequence / media classes, QA |
| `decoder` | `LabelsInForwardHead` | seq2seq LMs, multimodal LMs |
| `ctc` | `CTCHead` | CTC speech recognition |
| `segmentation` | `SegmentationHead` | semantic segmentation |
| `frames` | `FrameClassificationHead` | audio frame classification |
| `contrastive` | `ContrastiveHead` | contrastive dual encoders |
| `detection` | `DetectionHead` | DETR-style object detection |
| `router` | `RouterBalance` | (the MoE load-balancing term added to an LM head) |
| `unsupported` | | losses that are not a sum over items (depth, mask matching, ...) |

A new family is one new module here and one entry in `HEAD_FAMILIES`. `hf_parallel.exact.resolve_head` reads the
registry; the machinery of `hf_parallel.exact` never names a family's classes.

How a head is used on one batch: the example in `tokens`' docstring.
"""

from .base import (
    IGNORE_INDEX,
    NO_GRAD_CHUNK_ELEMENTS,
    HeadFamily,
    HeadMismatch,
    LossHead,
    ProblemTypeUnsettled,
    Route,
    UnsupportedHead,
    routed,
)
from .classification import (
    MEDIA_CLASSIFICATION,
    MULTIPLE_CHOICE,
    QUESTION_ANSWERING,
    SEQUENCE_CLASSIFICATION,
    MultiLabelHead,
    QuestionAnsweringHead,
    RegressionHead,
)
from .contrastive import CONTRASTIVE
from .ctc import CTC
from .decoder import MULTIMODAL_LM, SEQ2SEQ_DECODER_LM, SEQ2SEQ_LM
from .detection import OBJECT_DETECTION
from .frames import AUDIO_FRAME_CLASSIFICATION
from .segmentation import SEMANTIC_SEGMENTATION
from .tokens import CAUSAL_LM, MASKED_LM, TOKEN_CLASSIFICATION, CrossEntropyHead, token_losses
from .unsupported import NOT_A_SUM_FAMILIES

__all__ = [
    "HEAD_FAMILIES",
    "IGNORE_INDEX",
    "NO_GRAD_CHUNK_ELEMENTS",
    "CrossEntropyHead",
    "HeadFamily",
    "HeadMismatch",
    "LossHead",
    "MultiLabelHead",
    "ProblemTypeUnsettled",
    "QuestionAnsweringHead",
    "RegressionHead",
    "Route",
    "UnsupportedHead",
    "routed",
    "token_losses",
]

#: The registry: the head families in the order a class name is looked up; the first row that holds the class (with
#: a matching `encoder_decoder`) gives its head. Order matters where transformers files a class under several
#: mappings: a class of the pre-training mapping may also be an LM, so the families that are not a sum come last.
HEAD_FAMILIES: tuple[HeadFamily, ...] = (
    QUESTION_ANSWERING,
    SEQUENCE_CLASSIFICATION,
    SEQ2SEQ_LM,
    CAUSAL_LM,
    MASKED_LM,
    TOKEN_CLASSIFICATION,
    MULTIPLE_CHOICE,
    MEDIA_CLASSIFICATION,
    CTC,
    SEMANTIC_SEGMENTATION,
    AUDIO_FRAME_CLASSIFICATION,
    MULTIMODAL_LM,
    CONTRASTIVE,
    SEQ2SEQ_DECODER_LM,
    OBJECT_DETECTION,
    *NOT_A_SUM_FAMILIES,
)
