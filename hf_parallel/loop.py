"""
`ExactLoop`: the exact loss in a hand-written training loop (accelerate, `torchrun` + DDP, a DeepSpeed engine,
`nn.DataParallel`).

The canonical loop, `loss = model(**batch).loss` with `accelerator.accumulate` dividing by the accumulation steps,
averages per-device, per-micro-batch means: under DDP the ranks' means are averaged, under gradient accumulation the
micro-batches' means, under DataParallel the replicas'. Where the batches hold uneven numbers of items (valid tokens
of a causal LM, the padded last batch of an epoch) that is not the loss of the whole step, nor its gradient. An
`ExactLoop` hands out the micro-batches of one optimizer step at a time, counted before they run (all micro-batches,
all ranks), and gives each one's share of the exact loss, S_m / C, to back-propagate:

```python
from hf_parallel import ExactLoop

exact = ExactLoop(accelerator)                       # or ExactLoop() under torchrun / one process
for step in exact.steps(train_dataloader):           # one optimizer step's micro-batches
    for batch in step:
        with accelerator.accumulate(model):
            loss = step.loss(model, batch)           # instead of model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    print(step.logged_loss())                        # the step's loss, as one device computes it (every rank calls)
eval_loss = exact.evaluate(model, eval_dataloader)   # sum of losses / sum of items over the set, duplicates left out
```

With an `Accelerator`, back-propagate with `accelerator.backward`: it divides by its `gradient_accumulation_steps`,
which the loss given undoes. The rows a sampler repeats to fill the last batch of an epoch under DDP (accelerate's
`even_batches`, `DistributedSampler`'s padding) are left out of the counts, the sums and the gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device
from torch import nn

from .data_parallel.replicas import caller_autocast, is_data_parallel, replica_autocast
from .engines.deepspeed import check_loop_engine
from .exact import (
    EpochEnd,
    ExactLoss,
    LoopPadding,
    LossHead,
    RunContext,
    StepCounts,
    batch_device,
    calibrate_head,
    count_step,
    epoch_end,
    micro_batch_loss,
    pick_engine,
    pull_batches,
)
from .launch.validation import check_whole_number
from .saving.unwrap import unwrap_model

__all__ = ["ExactLoop", "LoopStep"]

# What a fallback warning of the loop says happens instead of the exact loss.
_LOOP_FALLBACK = (
    "LoopStep.loss gives the model's own loss instead, divided by the step's micro-batches, as the canonical loop "
    "does: a per-device, per-micro-batch mean, which DDP and gradient accumulation average (not exact where the "
    "batches hold uneven numbers of items); ExactLoop.evaluate gives the mean of the batches' losses."
)


class ExactLoop:
    """
    Exact losses for a hand-written training loop: one object per run, made from the accelerator, or from the
    default process group (`torchrun`) or none (one process, `nn.DataParallel`).

    Args:
        accelerator (`accelerate.Accelerator`, *optional*):
            The loop's accelerator: its processes, gradient accumulation steps, mixed precision and dataloaders.
        label_names (`list[str]`, *optional*):
            The batch keys of the labels; the model's head's own when `None` (`labels`; QA: start/end positions).
        label_smoothing (`float`, *optional*, defaults to 0):
            Label smoothing epsilon, as `TrainingArguments.label_smoothing_factor`.
        engine (`deepspeed.DeepSpeedEngine`, *optional*):
            Instead of an accelerator: the engine `deepspeed.initialize` returned. Its data-parallel group counts the
            step, its gradient accumulation steps are the step's micro-batches, and each step's last micro-batch is
            marked as its accumulation boundary (so `engine.step()` steps there, at an epoch's shorter last step too).
        process_group (`ProcessGroup`, *optional*):
            Without an accelerator: the DDP group (the default group when `torch.distributed` is initialised).

    ```python
    exact = ExactLoop()  # torchrun: the default process group
    for step in exact.steps(loader, accumulation_steps=2, device=device):
        for batch in step:
            step.loss(ddp_model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    ```
    """

    def __init__(
        self, accelerator=None, *, engine=None, label_names=None, label_smoothing: float = 0.0, process_group=None
    ):
        if engine is not None:
            if accelerator is not None or process_group is not None:
                raise ValueError("ExactLoop: pass an engine alone; it brings its own data-parallel group.")
            check_loop_engine(engine)
            process_group = engine.data_parallel_group
        self.accelerator, self.engine, self.group = accelerator, engine, process_group
        if accelerator is not None:
            self.num_processes = accelerator.num_processes if accelerator.distributed_type.value != "NO" else 1
            self.process_index = accelerator.process_index
            reduce_sum = functools.partial(accelerator.reduce, reduction="sum")
            unwrap = accelerator.unwrap_model
        else:
            distributed = dist.is_available() and dist.is_initialized()
            self.num_processes = dist.get_world_size(process_group) if distributed else 1
            self.process_index = dist.get_rank(process_group) if distributed else 0
            reduce_sum = self._all_reduce
            unwrap = unwrap_model
        self.exact = ExactLoss(
            label_names=label_names,
            label_smoothing=label_smoothing,
            num_processes=self.num_processes,
            reduce_sum=reduce_sum,
            unwrap=unwrap,
            fallback=_LOOP_FALLBACK,
            process_group=process_group,
        )

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        summed = tensor.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
        return summed

    @property
    def backward_divides_by(self) -> int:
        """What the backward divides a loss by: the accelerator's or the DeepSpeed engine's accumulation steps (its
        `engine.backward`, and its hooks under a plain `loss.backward()`); 1 otherwise."""
        if self.engine is not None:
            return self.engine.gradient_accumulation_steps()
        return self.accelerator.gradient_accumulation_steps if self.accelerator is not None else 1

    # ---- Training ----
    def steps(
        self, dataloader, accumulation_steps: int | None = None, device: torch.device | str | None = None
    ) -> Iterator[LoopStep]:
        """
        The optimizer steps of one pass over `dataloader`: each a `LoopStep` of `accumulation_steps` micro-batches (the
        last one of the epoch possibly fewer), counted over every micro-batch and rank before any runs.

        Args:
            dataloader (`Iterable`): the training batches (dicts with their labels); accelerate-prepared or not.
            accumulation_steps (`int`, *optional*): micro-batches per optimizer step; the accelerator's
                `gradient_accumulation_steps`, or 1, when `None`.
            device (`torch.device`, *optional*): where to move each batch (a dataloader accelerate prepared moves
                them itself).
        """
        accumulation = accumulation_steps if accumulation_steps is not None else self.backward_divides_by
        check_whole_number("accumulation_steps", accumulation, 1)
        if (self.accelerator is not None or self.engine is not None) and accumulation != self.backward_divides_by:
            # accelerator.accumulate steps the optimizer by its own count of micro-batches: with another count here
            # it would step in the middle of a LoopStep (every micro-batch, at gradient_accumulation_steps=1). A
            # DeepSpeed engine divides each loss by its own count.
            owner, setting = (
                ("DeepSpeed config's", '"gradient_accumulation_steps"')
                if self.engine is not None
                else ("accelerator's", "Accelerator(gradient_accumulation_steps=...)")
            )
            raise ValueError(
                f"ExactLoop.steps: accumulation_steps={accumulation} differs from the {owner} "
                f"gradient_accumulation_steps={self.backward_divides_by}; set {setting} to {accumulation} and leave "
                "accumulation_steps out."
            )
        # Checked here, at the call, not at the first step: the steps themselves are a generator.
        return self._steps(dataloader, accumulation, device)

    def _steps(self, dataloader, accumulation: int, device) -> Iterator[LoopStep]:
        padding = self._padding(dataloader, "the training dataloader")
        iterator = iter(dataloader)
        gradient_state = self.accelerator.gradient_state if self.accelerator is not None else None
        while True:
            batches, end = pull_batches(iterator, accumulation, gradient_state, reads_end=gradient_state is not None)
            if not batches:
                return
            yield LoopStep(self, [_to_device(batch, device) for batch in batches], accumulation, end, padding)

    # ---- Evaluation ----
    def evaluate(self, model: nn.Module, dataloader, device: torch.device | str | None = None) -> float:
        """
        The evaluation loss of `model` on `dataloader`: the sum of the per-item losses over the sum of the items, over
        the whole set and every rank, each sample once (the repeats of a padded last batch left out). Runs the model in
        evaluation mode without gradients, and puts it back in the mode it was in. Every rank calls it.
        """
        was_training = model.training
        model.eval()
        self.run_on(model)
        padding = self._padding(dataloader, "the evaluation dataloader")
        stock: list[torch.Tensor] = []
        self.exact.evaluation.start(keep_outputs=False)
        try:
            with torch.no_grad():
                for batch in dataloader:
                    batch = _to_device(batch, device)
                    head, real, context = self.exact.head(model, batch), None, self.run_context()
                    if head is not None and head.has_labels(batch):
                        end = epoch_end(self.accelerator.gradient_state) if self.accelerator is not None else None
                        marks = padding.mark(head, [batch], end)
                        real = marks[0] if marks else None
                        head = calibrate_head(self.exact, model, head, batch, context, real)  # while its check is open
                    if head is None or not head.has_labels(batch):
                        stock.append(_stock_loss(model(**batch)).detach().float())  # the fallback: mean of means
                        continue
                    micro_batch_loss(self.exact, model, head, batch, None, context, real=real)
        finally:
            exact = self.exact.evaluation.finish(self.exact.engine)
            model.train(was_training)
        if exact is not None:
            return exact
        if not stock:
            raise ValueError("ExactLoop.evaluate: the dataloader gave no batch; there is no loss to evaluate.")
        mean = torch.stack(stock).mean()
        return float(self.exact.reduce_sum(mean) / self.num_processes if self.num_processes > 1 else mean)

    # ---- Shared ----
    def run_on(self, model: nn.Module) -> None:
        """The engine follows the model the loop is given: DataParallel replicas where it is an `nn.DataParallel`
        wrapper in one process, else one process or the loop's ranks (`hf_parallel.exact.engine`)."""
        exact, data_parallel = self.exact, self.num_processes == 1 and is_data_parallel(model)
        if data_parallel != exact.engine.replicas:
            exact.engine = pick_engine(
                self.num_processes, reduce_sum=exact.reduce_sum, data_parallel=data_parallel, group=self.group
            )

    def _padding(self, dataloader, name: str) -> LoopPadding:
        return LoopPadding(self.exact, dataloader, name, self.accelerator, self.process_index, self.num_processes)

    def run_context(self) -> RunContext:
        """
        What a micro-batch's loss needs of this loop, read at each call: the autocast dtype of DataParallel replicas,
        the accelerator's mixed precision, else the caller's autocast state.
        """
        if self.accelerator is not None:
            return RunContext(autocast_dtype=replica_autocast(self.accelerator.mixed_precision))
        return RunContext(autocast_dtype=caller_autocast())


class LoopStep:
    """
    One optimizer step of an `ExactLoop`: its micro-batches (iterate over them), each one's loss (`loss`) and the
    step's loss to log (`logged_loss`). Made by `ExactLoop.steps`.
    """

    def __init__(self, loop: ExactLoop, batches: list[dict], accumulation: int, end: EpochEnd | None, padding):
        self.loop = loop
        self.batches = batches
        self._accumulation = accumulation
        self._done: list[torch.Tensor | None] = [None] * len(batches)
        self._counts: StepCounts | None = None
        self._end, self._padding = end, padding

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict]:
        accelerator, engine = self.loop.accelerator, self.loop.engine
        for index, batch in enumerate(self.batches):
            if accelerator is not None:
                self._sync_at(index)
            if engine is not None:
                # Whether this micro-batch is the last of its optimizer step, so that the engine reduces the gradient
                # and `engine.step()` steps there, also at an epoch's shorter last step (its own counter would not).
                engine.set_gradient_accumulation_boundary(index == len(self.batches) - 1)
            yield batch

    def _sync_at(self, index: int) -> None:
        """
        Let `accelerator.accumulate` sync gradients (and step the optimizer) at this step's last micro-batch only.
        Its own rule counts calls and syncs early at an epoch's end: all of an epoch's last micro-batches are pulled
        before the first runs, so the dataloader already says it ended.
        """
        accelerator, last = self.loop.accelerator, index == len(self.batches) - 1
        loader = accelerator.gradient_state.active_dataloader
        if loader is not None and self._end is not None:
            loader.end_of_dataloader = last
        # accumulate() adds one, then syncs where the count is a multiple of its accumulation steps.
        accelerator.step = accelerator.gradient_state.num_steps - 1 if last else index

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """
        The loss of micro-batch `batch` of this step, to back-propagate: S_m / C of the whole step (times the DDP
        world size, which DDP's and DeepSpeed's averaging divide again, and the accumulation steps, which
        `accelerator.backward` or the DeepSpeed engine divides again). `model` is the model as the loop calls it:
        bare, in DDP, in `nn.DataParallel` / `BalancedDataParallel`, prepared by accelerate, or a DeepSpeed engine.
        """
        index = self._index_of(batch)
        loop, exact = self.loop, self.loop.exact
        head = exact.head(model, batch)
        if self._counts is None and exact.labels_present(head, self.batches):
            self._counts = self._count(head, model)
        if head is not None and self._counts is not None:
            head = self._counts.head  # as the check settled it
        if head is None or self._counts is None:
            # The stock loss (warned once, naming why): the model's mean, divided by the micro-batches.
            value = _stock_loss(model(**batch)) / len(self.batches)
        else:
            # The step's batch (the step knows its padding rows, where an epoch's end added some).
            value, _ = micro_batch_loss(exact, model, head, self.batches[index], self._counts, loop.run_context())
        self._done[index] = value.detach()
        return value * loop.backward_divides_by

    def _count(self, head: LossHead, model: nn.Module) -> StepCounts | None:
        """The step's counts for the head its check settles on (first, while the check is open); None: the stock
        loss, warned once."""
        loop = self.loop
        loop.run_on(model)
        real_rows = self._padding.mark(head, self.batches, self._end)
        if loop.exact.pending_check(head, model, False) is not None:  # the check of the head, while it is open
            first_real = real_rows[0] if real_rows else None
            head = calibrate_head(loop.exact, model, head, self.batches[0], loop.run_context(), first_real)
            if head is None:
                return None
        device = batch_device(self.batches[0])
        main_input_name = getattr(loop.exact.unwrap(model), "main_input_name", "input_ids")
        return count_step(loop.exact, head, self.batches, device, main_input_name, model, real_rows=real_rows)

    def _index_of(self, batch: dict) -> int:
        for index, own in enumerate(self.batches):
            if own is batch or _same_labels(own, batch):
                if self._done[index] is not None:
                    raise ValueError(
                        f"LoopStep.loss: the loss of micro-batch {index} of this step was computed already; each "
                        "micro-batch's loss is computed once per step (its count is in the step's count once)."
                    )
                return index
        raise ValueError(
            "LoopStep.loss: this batch is not one of this step's micro-batches, so the step's item count does not "
            "cover it. Pass the batches the step yields (`for batch in step`), unchanged; to move them to a device, "
            "pass device= to ExactLoop.steps."
        )

    def logged_loss(self) -> float:
        """
        The step's loss as one device computes it on all its micro-batches: the sum of per-item losses over the
        item count, over every micro-batch and rank. A collective under DDP: call it on every rank.
        """
        missing = [index for index, value in enumerate(self._done) if value is None]
        if missing:
            raise ValueError(
                f"LoopStep.logged_loss: micro-batches {missing} of this step have no loss yet; call step.loss(model, "
                "batch) for every micro-batch of the step first."
            )
        total = torch.stack([value.float().reshape(()) for value in self._done]).sum()
        loop = self.loop
        # Stock: the mean over ranks of each rank's sum of micro-batch means / G.
        scale = loop.num_processes if self._counts is None else self._counts.scale
        if loop.num_processes > 1:
            total = loop.exact.reduce_sum(total)
        return float(total) / scale


# ---- Helpers ----
def _stock_loss(outputs: Any) -> torch.Tensor:
    """
    The model's own loss, as stock's training step reads it: `outputs["loss"]` of a dict (a `ModelOutput` or a plain
    dict: `outputs.loss` fails on a plain dict), else the first output; under `nn.DataParallel` the mean of the
    replicas' losses (it gathers their 0-dim losses into a vector).
    """
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    return loss.mean()


def _to_device(batch: Any, device) -> Any:
    """The batch on `device` (nested values too; a tensor already there is the same object); as it is for None."""
    return batch if device is None else send_to_device(batch, device)


def _same_labels(own: dict, batch: dict) -> bool:
    """The same micro-batch, in another dict: its tensors are the very same objects (moved nowhere)."""
    if not isinstance(batch, dict) or own.keys() != batch.keys():
        return False
    return all(own[key] is batch[key] for key in batch if torch.is_tensor(batch[key]))
