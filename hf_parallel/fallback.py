"""
The stock loss, where hf_parallel falls back to it (an unknown head, a subclass that overrides `compute_loss`), with
the part of stock's multi-device error removed that can be told apart from a correct loss.

Stock `transformers.Trainer` counts the items of the step (`num_items_in_batch`, summed over every rank and
micro-batch) whenever the model's `forward` takes `**kwargs` (`model_accepts_loss_kwargs`) or a `compute_loss_func`
is set, and then assumes the loss L_r of rank r was divided by that count: S_r / C. Two scalings follow from it:

- `compute_loss` multiplies L_r by the number of processes N (DDP, FSDP and DeepSpeed average gradients over the
  ranks, so the sum of the S_r / C needs the factor N back);
- `training_step` does not divide by the gradient accumulation steps G (S / C already covers the whole step).

Both are right only when the loss really read the count. A model whose `forward` takes `**kwargs` but whose loss
ignores the count (BERT's and most encoders' heads, e.g. `BertForSequenceClassification`: `CrossEntropyLoss()`,
the mean of its own rows) returns the rank's own micro-batch mean; DDP's averaging over the ranks and a division
by G then give the mean over the whole step, and stock's scalings make the loss and gradient N x G times too large
(x2 for a classifier on 2 ranks).

The rule: hand the loss a count that records every read of its value (`WatchedCount`; reading its device, dtype or
shape does not count). When nothing read it, the loss is a per-micro-batch mean: divide out the factor stock's
`compute_loss` multiplied by (`stock_compute_loss`), and let `training_step` divide by G (`stock_training_step`).
When anything read it, leave the loss as it is: S / C is made exact by stock's own scalings, and a subclass that
reads it (TRL's loss types) owns its normalisation. A read by anything, even only for a log line, leaves stock's
scaling in place: a loss is never rescaled on a guess.

Left as stock, because reads cannot be watched or the factor is not the world size: `exact_loss=False` (which asks for
stock), a loss that is a plain sum nothing divides (CTC's `"sum"` reduction: stock's scalings are right for it), a
count that is not a tensor, `torch_compile` (a compiled graph need not call back into the watcher), DataParallel (the
count is scattered into per-replica copies), tensor, context and sequence parallelism, and a subclass that sets
`loss_is_scaled_for_ga` itself (only the division by G is then left alone).

```python
import transformers
from hf_parallel.fallback import stock_compute_loss, stock_training_step

class StockLossTrainer(transformers.Trainer):  # given hf_parallel.TrainingArguments, which carry `exact_loss`
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return stock_compute_loss(self, super().compute_loss, model, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        return stock_training_step(self, super().training_step, model, inputs, num_items_in_batch)
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .upstream import temporarily

__all__ = [
    "FALLBACK_NOTE",
    "WatchedCount",
    "stock_compute_loss",
    "stock_loss_factor",
    "stock_training_step",
    "sums_its_loss",
]

# What the Trainer's fallback warning adds to its reason: that stock's loss is used, what stock does on several
# devices, and what is still corrected.
FALLBACK_NOTE = (
    "The loss is left to the Trainer: the stock transformers loss, or a subclass's own. "
    "Whenever it passes num_items_in_batch (the model's forward takes **kwargs, or a compute_loss_func is set), stock "
    "multiplies that loss by the number of processes (DDP, FSDP, DeepSpeed) and does not divide it by "
    "gradient_accumulation_steps, which is right only for a loss divided by num_items_in_batch. hf_parallel still "
    "removes both where the loss never reads num_items_in_batch (it is then a per-batch mean, as a BERT classifier's "
    "is), and leaves a loss that reads it as it is. Under DataParallel and tensor, context or sequence parallelism "
    "the stock loss is left as it is."
)

# Methods and attribute getters that only describe a tensor: calling them does not read the count's value.
_METADATA = frozenset(
    {
        "__get__",  # .device, .dtype, .shape, .requires_grad, ...: a getter that returns a tensor (.data) still reads
        "_is_view",
        "dim",
        "element_size",
        "is_complex",
        "is_conj",
        "is_contiguous",
        "is_floating_point",
        "is_neg",
        "numel",
        "size",
        "storage_offset",
        "stride",
        "untyped_storage",
    }
)


class WatchedCount(torch.Tensor):
    """
    An item count (`num_items_in_batch`) that counts the operations that read its value, in `reads`. Each operation
    runs on the plain tensor and returns plain tensors, so nothing downstream of a read is watched or changed.

    ```python
    import torch
    from hf_parallel.fallback import WatchedCount

    count = WatchedCount.of(torch.tensor(12))
    count.device, count.shape  # count.reads == 0
    loss = torch.tensor(6.0) / count  # count.reads == 1; type(loss) is torch.Tensor
    ```
    """

    reads: int = 0

    @staticmethod
    def of(count: torch.Tensor) -> WatchedCount:
        """A watched count with the value (and storage) of `count`; `count` itself when it is already one."""
        if isinstance(count, WatchedCount):
            return count
        watched = torch.Tensor._make_subclass(WatchedCount, count.detach())
        watched.reads = 0
        return watched

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():  # run the op on plain tensors, return plain tensors
            result = func(*args, **kwargs)
        if getattr(func, "__name__", None) not in _METADATA or isinstance(result, torch.Tensor):
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, WatchedCount):
                    arg.reads += 1
        return result


def sums_its_loss(model: Any) -> bool:
    """
    Whether `model`'s own loss is a plain sum that nothing divides (CTC with `ctc_loss_reduction="sum"`, the config
    default): stock's scalings are then right (no division by the accumulation steps, the world size taking DDP's
    averaging back), and a loss that never reads the count must not be divided.
    """
    return getattr(getattr(model, "config", None), "ctc_loss_reduction", None) == "sum"


def _watchable(trainer, count: Any) -> bool:
    """Whether the fallback may watch `count` and correct the stock scalings it implies."""
    return (
        trainer.args.exact_loss  # exact_loss=False asks for stock, as it is
        and not sums_its_loss(getattr(trainer, "model", None))
        and torch.is_tensor(count)
        and trainer.args.n_gpu <= 1  # DataParallel scatters the count into copies whose reads are not seen
        and not trainer.args.torch_compile  # a compiled graph need not call back into the watcher
        and trainer.get_tp_size() * trainer.get_cp_size() * trainer.get_sp_size() == 1
    )


def _stock_counts_items(trainer) -> bool:
    """Whether stock treats the loss as divided by the step's count (the condition of both of its scalings)."""
    return bool(trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None)


def stock_loss_factor(trainer, count: Any) -> int:
    """
    The factor `transformers.Trainer.compute_loss` multiplies the loss by, given `count` as `num_items_in_batch`
    (1 when it does not): the number of processes sharing no batch with another, or the GPUs under DataParallel.
    """
    if not (trainer.args.average_tokens_across_devices and _stock_counts_items(trainer) and count is not None):
        return 1
    if trainer.args.n_gpu > 1:
        return trainer.args.n_gpu
    return trainer.accelerator.num_processes // trainer.get_tp_size()


def stock_compute_loss(
    trainer, compute: Callable, model, inputs: dict, return_outputs: bool, count: Any
) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """
    `compute_loss` of the stock loss (`compute`, the stock method), without stock's world-size factor when the loss
    never read `count`. Used in training and evaluation alike: stock multiplies an evaluation batch's loss too.

    Args:
        trainer (`transformers.Trainer`): the hf_parallel Trainer falling back.
        compute (`Callable`): stock `compute_loss(model, inputs, return_outputs, num_items_in_batch)`.
        model (`nn.Module`): the model, as `compute_loss` received it.
        inputs (`dict`): the batch.
        return_outputs (`bool`): whether to return `(loss, outputs)`.
        count (`torch.Tensor` or `int`, *optional*): the stock `num_items_in_batch`.
    """
    factor = stock_loss_factor(trainer, count)
    if factor == 1 or not _watchable(trainer, count):
        return compute(model, inputs, return_outputs, count)
    watched = WatchedCount.of(count)
    before = watched.reads  # the count training_step watches may have been read already, by a subclass
    result = compute(model, inputs, return_outputs, watched)
    if watched.reads > before:
        return result  # S_r / C: stock's factor makes it exact
    # The rank's own mean: DDP (FSDP, ZeRO) averaging over the ranks already gives the mean over all of them.
    return (result[0] / factor, result[1]) if return_outputs else result / factor


class _ScaledIfRead:
    """
    `loss_is_scaled_for_ga` for one training step, decided when stock reads it: after `compute_loss` returned, from
    whether the loss read the count. Stock's default (True whenever it passed a count to a model taking `**kwargs`)
    would leave a per-micro-batch mean undivided by the accumulation steps.
    """

    def __init__(self, count: WatchedCount):
        self.count = count

    def __bool__(self) -> bool:
        return self.count.reads > 0


def stock_training_step(trainer, step: Callable, model, inputs: dict, count: Any) -> torch.Tensor:
    """
    `training_step` of the stock loss (`step`, the stock method): the loss is divided by the gradient accumulation
    steps unless it read `count`, where stock would skip the division for any model taking `**kwargs`. A subclass
    that sets `loss_is_scaled_for_ga` keeps its own decision.

    Args:
        trainer (`transformers.Trainer`): the hf_parallel Trainer falling back.
        step (`Callable`): stock `training_step(model, inputs, num_items_in_batch)`.
        model (`nn.Module`): the model, as `training_step` received it.
        inputs (`dict`): the batch.
        count (`torch.Tensor` or `int`, *optional*): the stock `num_items_in_batch`.
    """
    if trainer.loss_is_scaled_for_ga is not None or not _stock_counts_items(trainer) or not _watchable(trainer, count):
        return step(model, inputs, count)
    watched = WatchedCount.of(count)
    with temporarily(trainer, "loss_is_scaled_for_ga", _ScaledIfRead(watched)):
        return step(model, inputs, watched)
