"""
The one way the tests train: `training_args` builds the arguments of a tiny CPU training, `run_case` trains a case
(a tiny model and its rows, tests/helpers/heads.py) under a topology and reports what an exact loss must keep equal,
and `run_ddp` / `run_ddp_runs` run cases on spawned CPU ranks. `record_hf_parallel_log` records what hf_parallel warns
about (the `hf_parallel_log` fixture of tests/conftest.py, or in a spawned rank).

A topology is (per-device batch, gradient accumulation, DDP processes, emulated DataParallel devices, gpu0_bsz or
gpu0_weight).
Every topology of the exact-loss matrix sees the same 2B training rows in one optimizer step, so the loss, the
gradient and the parameters after the step must equal those of one process with batch 2B.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers

from hf_parallel import ExactLoop, Trainer, TrainingArguments, unwrap_model
from hf_parallel.testing import simulate_data_parallel, simulated_training_args, spawn_cpu_ranks
from tests.helpers.heads import CASES, Case
from tests.helpers.tiny import IterableRows

TRAIN_ROWS = 8  # 2B with B = 4
EVAL_ROWS = 7  # not divisible by 2 ranks x 2 rows: DDP evaluation pads with duplicates

# Every tiny training: nothing reported, saved or drawn, on the CPU, one seed.
COMMON = dict(report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)

# One plain SGD step that applies the gradient as it is (what `run_case` trains): a wrong scale shows in the weights.
SGD_STEP = dict(
    max_steps=1,
    optim="sgd",
    learning_rate=0.5,
    lr_scheduler_type="constant",
    max_grad_norm=0.0,  # clipping would hide a wrong scale
    weight_decay=0.0,
    logging_steps=1,
    logging_nan_inf_filter=False,
    per_device_eval_batch_size=2,
    data_seed=0,
    dataloader_num_workers=0,
    remove_unused_columns=False,
    include_num_input_tokens_seen="no",
)


def training_args(
    output_dir: str | Path, *, args_cls: type = TrainingArguments, dp_devices: int | None = None, **overrides
):
    """
    The arguments of a tiny training: `COMMON`, then `overrides`. With `dp_devices`, arguments that report that
    many simulated GPUs (`args.n_gpu == dp_devices`: from 2 on, train inside `simulate_data_parallel(dp_devices)`).
    `args_cls` is `transformers.TrainingArguments` for stock runs.
    """
    kwargs = {**COMMON, "output_dir": str(output_dir), **overrides}
    if dp_devices is not None:
        return simulated_training_args(dp_devices, args_cls, **kwargs)
    return args_cls(**kwargs)


@dataclass(frozen=True)
class Topology:
    name: str
    per_device: int
    accumulation: int = 1
    processes: int = 1
    dp_devices: int = 1
    gpu0_bsz: int | None = None
    gpu0_weight: float | None = None

    def arguments(self) -> dict:
        """The `training_args` keywords of this topology (its DDP processes come from the launch)."""
        kwargs = dict(per_device_train_batch_size=self.per_device, gradient_accumulation_steps=self.accumulation)
        if self.dp_devices > 1:
            kwargs["dp_devices"] = self.dp_devices
        if self.gpu0_bsz is not None:
            kwargs["gpu0_bsz"] = self.gpu0_bsz
        if self.gpu0_weight is not None:
            kwargs["gpu0_weight"] = self.gpu0_weight
        return kwargs


SINGLE = Topology("single 2B", per_device=TRAIN_ROWS)
# The topologies of the modality, router and contrastive matrices: each sees the 2B rows of SINGLE in one step.
GA2 = Topology("grad-accum 2", per_device=TRAIN_ROWS // 2, accumulation=2)
DP2 = Topology("DP 2", per_device=TRAIN_ROWS // 2, dp_devices=2)
DP3_GPU0 = Topology("DP 3 balanced gpu0_bsz=1", per_device=3, dp_devices=3, gpu0_bsz=1)
DDP2 = Topology("DDP 2", per_device=TRAIN_ROWS // 2, processes=2)
DDP2_GA2 = Topology("DDP 2 x grad-accum 2", per_device=TRAIN_ROWS // 4, accumulation=2, processes=2)


class Capture(transformers.TrainerCallback):
    """The logged losses and the gradient that the optimizer is about to apply in the first step."""

    def __init__(self):
        self.loss = None
        self.losses = []  # every logged training loss, one per logging step
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            if self.loss is None:
                self.loss = logs["loss"]


@dataclass
class RunResult:
    """
    What `run_case` reports of one training: the first logged loss and every logged one, `train_loss`, `eval_loss`
    (None without evaluation), the first step's gradient and the parameters after training (by name), the wrapper the
    Trainer trained through (`wrapped`), the topology it saw, the trainer itself (None once it crossed processes), the
    emulated DataParallel's records (`emulation`, None without it), from a DDP spawn how far the ranks' parameters are
    apart, and whether the last steps were counted with a settled head.
    """

    loss: float | None
    losses: list[float]
    train_loss: float
    eval_loss: float | None
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    wrapped: str
    world_size: int
    parallel_mode: str
    trainer: Any = None
    emulation: Any = None
    max_rank_param_diff: float | None = None
    #: Whether the run's last steps were counted with a settled head (the check of the head decided); None for stock.
    settled: bool | None = None


def run_case(
    case: str | Case,
    topology: Topology,
    stock: bool = False,
    exact_loss: bool = True,
    train_rows: int = TRAIN_ROWS,
    eval_rows: int = EVAL_ROWS,
    evaluate_first: bool = True,
    iterable: bool = False,
    callbacks: tuple = (),
    classes: tuple[type, type] | None = None,
    data_parallel: type | None = None,
    **overrides,
) -> dict:
    """
    Train `case` (a name in `CASES`, or a `Case`) under `topology` for one SGD step (`SGD_STEP`; `overrides` change
    it) and evaluate; return a `RunResult`.

    `evaluate_first` (the default) evaluates before training, on purpose: under DDP stock then trains without DDP,
    so every DDP case also checks that hf_parallel still wraps the model. `eval_rows=0` does not evaluate at all.
    Under emulated DataParallel, `result.emulation` holds its records (chunk sizes, bytes gathered).
    `iterable` trains on the rows as an iterable dataset (no length), which accelerate dispatches from rank 0 under
    DDP. `classes` (a Trainer and an arguments class) replaces hf_parallel's (or, with `stock`, transformers').
    `data_parallel` (a `torch.nn.DataParallel` subclass) stands in for `torch.nn.DataParallel` instead of the
    emulation, under a topology with `dp_devices`.
    """
    case = CASES[case] if isinstance(case, str) else case
    if classes is not None:
        trainer_cls, args_cls = classes
    elif stock:
        trainer_cls, args_cls = transformers.Trainer, transformers.TrainingArguments
    else:
        trainer_cls, args_cls = Trainer, TrainingArguments
    extra = overrides if stock else {"exact_loss": exact_loss, **overrides}
    capture = Capture()
    rows = case.dataset(train_rows, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        arguments = {**SGD_STEP, **topology.arguments(), "label_smoothing_factor": case.label_smoothing, **extra}
        trainer = trainer_cls(
            model=case.build(0),
            args=training_args(tmp, args_cls=args_cls, **arguments),
            train_dataset=IterableRows(rows) if iterable else rows,
            eval_dataset=case.dataset(eval_rows, seed=2) if eval_rows else None,
            callbacks=[capture, *callbacks],
            **({"data_collator": case.collator} if case.collator is not None else {}),
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        simulation = (
            simulate_data_parallel(topology.dp_devices) if topology.dp_devices > 1 else contextlib.nullcontext()
        )
        if data_parallel is not None:
            simulation = _standing_in(data_parallel)
        eval_loss = None
        with simulation as emulation:
            if eval_rows and evaluate_first:
                eval_loss = trainer.evaluate()["eval_loss"]
            train_loss = trainer.train().training_loss
            if eval_rows and not evaluate_first:
                eval_loss = trainer.evaluate()["eval_loss"]
        model = trainer.accelerator.unwrap_model(trainer.model)
        return RunResult(
            loss=capture.loss,
            losses=capture.losses,
            train_loss=train_loss,
            eval_loss=eval_loss,
            grads=capture.grads,
            params={n: p.detach().clone() for n, p in model.named_parameters()},
            wrapped=type(trainer.model_wrapped).__name__,
            world_size=trainer.args.world_size,
            parallel_mode=str(trainer.args.parallel_mode),
            trainer=trainer,
            emulation=emulation,
            settled=getattr(trainer, "_settled_head", None) is not None if not stock else None,
        )


@contextlib.contextmanager
def _standing_in(data_parallel: type) -> Iterator[None]:
    """`torch.nn.DataParallel` is `data_parallel` within the block (the class the stock Trainer wraps a model in)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn, "DataParallel", data_parallel)
        yield None


def runs_worker(runs: dict[str, tuple[str, Topology, bool, dict]], out_dir: str) -> None:
    """
    Body of each DDP rank: every named run (case, topology, stock, overrides) of `run_ddp_runs`, and how far the
    ranks' parameters are apart after it; rank 0 saves the results (without the trainers).
    """
    results = {}
    for name, (case, topology, stock, overrides) in runs.items():
        result = run_case(case, topology, stock=stock, **overrides)
        # Parameters must be equal on every rank, or the ranks trained apart.
        flat = torch.cat([p.flatten() for p in result.params.values()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        spread = max((g - flat).abs().max().item() for g in gathered)
        results[name] = dataclasses.replace(result, trainer=None, emulation=None, max_rank_param_diff=spread)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_ddp_runs(runs: dict[str, tuple[str, Topology, bool, dict]], tmp_path, processes: int = 2) -> dict:
    """Every named run (case, topology, stock, overrides) in one spawn of `processes` CPU ranks: name -> result."""
    spawn_cpu_ranks(runs_worker, (runs, str(tmp_path)), processes)
    return torch.load(os.path.join(tmp_path, "results.pt"), weights_only=False)


def run_ddp(case_names: list[str], topology: Topology, tmp_path, stock: bool = False, **overrides) -> dict:
    """Each case under the same DDP topology, in one spawn: case name -> result."""
    runs = {name: (name, topology, stock, overrides) for name in case_names}
    return run_ddp_runs(runs, tmp_path, topology.processes)


class OneProcess:
    """The one-process run (`SINGLE`) of each case, run once per test module: `single = OneProcess(CASES)`."""

    def __init__(self, cases: dict[str, Case]):
        self.cases, self.results = cases, {}

    def __call__(self, name: str) -> RunResult:
        if name not in self.results:
            self.results[name] = run_case(self.cases[name], SINGLE)
        return self.results[name]


def own_step(case: Case, rows: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """The model's own loss on `rows` in one forward (the case's collator, or transformers' default), and its
    gradient: the reference a step over those rows must equal."""
    collate = case.collator or transformers.default_data_collator
    model = case.build(0)
    loss = model(**collate(rows)).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def exact_loop_step(case: Case, rows: list[dict], first: int = 3) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of `hf_parallel.ExactLoop` without an accelerator over `rows` as two micro-batches (the first `first`
    rows, then the rest): its logged loss and the gradient it leaves."""
    collate = case.collator or transformers.default_data_collator
    model = case.build(0)
    logged = None
    for step in ExactLoop().steps([collate(rows[:first]), collate(rows[first:])], accumulation_steps=2):
        for batch in step:
            step.loss(model, batch).backward()
        logged = step.logged_loss()
    return logged, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def max_relative_diff(a: dict, b: dict) -> float:
    """
    Largest |a - b| over all tensors of two name -> tensor dicts, relative to the largest |b| of them all.

    Relative to the whole set, not per tensor: some gradients are zero in exact arithmetic (an attention key
    bias, a bias shared by all positions of a softmax) and per-tensor ratios of rounding noise mean nothing.
    """
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    scale = max(t.abs().max().item() for t in b.values()) or 1.0
    return max((a[name] - b[name]).abs().max().item() for name in a) / scale


def assert_equivalent(result: RunResult, reference: RunResult, what: str, tol: float = 1e-5) -> None:
    """`result` trained as `reference` did: the logged loss, eval_loss, gradient and parameters after the step."""
    assert result.loss == pytest.approx(reference.loss, rel=tol), f"{what}: logged loss"
    assert result.eval_loss == pytest.approx(reference.eval_loss, rel=tol), f"{what}: eval_loss"
    assert max_relative_diff(result.grads, reference.grads) < tol, f"{what}: gradient"
    assert max_relative_diff(result.params, reference.params) < tol, f"{what}: parameters after the step"


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the state dict of the model inside any wrappers."""
    return {k: v.detach().clone() for k, v in unwrap_model(model).state_dict().items()}


def assert_same_weights(a: dict, b: dict, atol: float = 1e-6) -> None:
    """Two state dicts hold the same keys and values within `atol` (`atol=0`: bit-equal)."""
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


class LogRecords(logging.Handler):
    """The records of the `hf_parallel` loggers, WARNING and above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]

    @property
    def text(self) -> str:
        return "\n".join(self.messages)


@contextlib.contextmanager
def record_hf_parallel_log() -> Iterator[LogRecords]:
    """
    Record the warnings of the `hf_parallel` loggers in the block. transformers' `warning_once` remembers every
    message for the whole process: forget them first, so that a warning an earlier test gave is given here again.
    """
    cache_clear = getattr(logging.Logger.warning_once, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
    logger = logging.getLogger("hf_parallel")
    handler, level = LogRecords(), logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
