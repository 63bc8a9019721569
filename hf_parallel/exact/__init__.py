"""
The exact-loss core. The rule, for one optimizer step of micro-batches m on ranks r, with S the sum of the per-item
losses and C the item count of the whole step (non-ignored targets after the causal shift, samples, label elements),
as code that runs on one process:

```python
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
ids = torch.randint(0, 64, (4, 9))
labels = ids.clone()
labels[0, 3:] = -100  # uneven rows: a mean of per-micro-batch means would weigh them wrongly
micro_batches = [(ids[:1], labels[:1]), (ids[1:], labels[1:])]  # gradient accumulation 2 (or 2 DDP ranks)
world_size = 1  # DDP averages gradients over ranks: each rank multiplies its S / C by it

C = sum(int((y[:, 1:] != -100).sum()) for _, y in micro_batches)  # counted before the step (all-reduced under DDP)
for x, y in micro_batches:
    logits = model(input_ids=x).logits[:, :-1]
    S = F.cross_entropy(logits.flatten(0, 1), y[:, 1:].flatten(), ignore_index=-100, reduction="sum")
    (S / C * world_size).backward()  # the step's gradient: that of the model's own loss on all rows at once

reference = LlamaForCausalLM(model.config)
reference.load_state_dict(model.state_dict())
reference(input_ids=ids, labels=labels).loss.backward()
assert all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), reference.parameters()))
```

Evaluation adds S and C over the whole set (padding duplicates left out) and divides once. Each head computes S and
C its own way (`heads`); a head takes one route (`heads.Route`), set in one place (`heads.routed`):

| route | heads | why |
|---|---|---|
| `RECOMPUTED` | every known head (the default) | labels out of the forward, S from the logits |
| `MODEL_LOSS` | a per-position cross-entropy whose model honours the count | S / C in one forward, no logits (Liger) |
| `LABELS_IN_FORWARD` | seq2seq LMs building decoder inputs in the forward; CTC | the model needs its labels |
| `USER_LOSS` | any head, with the Trainer's `compute_loss_func` | the user's loss, given C; the head counts |
| `TRAINER_LOSS` | TRL's SFT, DPO, reward, KTO trainers (`heads.trainers`) | its own `compute_loss`, S made of it |

No head (a model whose loss cannot be recomputed, or a Trainer that overrides `compute_loss`): the stock loss, with
one warning. The one step every run takes (`step`: count, per-micro-batch loss, reduction), the check and how to add a
head family or an engine: `docs/contributing.md`.
"""

from .checked import calibrate_head
from .core import ExactLoss
from .engine import Engine, pick_engine
from .heads import CrossEntropyHead, LossHead, MultiLabelHead, QuestionAnsweringHead, RegressionHead, Route
from .heads.trainers import trainer_loss_head
from .remainder import EpochEnd, LoopPadding, epoch_end, ragged_gathers, real_batches
from .resolve import ProblemTypeUnsettled, UnsupportedHead, resolve_head
from .step import RunContext, StepCounts, count_step, micro_batch_loss, pull_batches
from .streams import count_samples
from .terms import batch_device

__all__ = [
    "CrossEntropyHead",
    "Engine",
    "EpochEnd",
    "ExactLoss",
    "LoopPadding",
    "LossHead",
    "MultiLabelHead",
    "ProblemTypeUnsettled",
    "QuestionAnsweringHead",
    "RegressionHead",
    "Route",
    "RunContext",
    "StepCounts",
    "UnsupportedHead",
    "batch_device",
    "calibrate_head",
    "count_step",
    "count_samples",
    "epoch_end",
    "micro_batch_loss",
    "pick_engine",
    "pull_batches",
    "ragged_gathers",
    "real_batches",
    "resolve_head",
    "trainer_loss_head",
]
