"""
The stock-loss fallback (hf_parallel.fallback): where hf_parallel leaves the loss to the Trainer (here a
subclass that overrides `compute_loss`), it still removes stock's world-size factor and its skipped division by the
accumulation steps when the loss never reads `num_items_in_batch` (a BERT classifier's mean), and leaves a loss that
reads it (TRL-like) as it is. Each case next to a stock control; the DDP cases run in one spawn of 2 CPU ranks.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers

from hf_parallel import Trainer, TrainingArguments
from hf_parallel.fallback import (
    FALLBACK_NOTE,
    WatchedCount,
    stock_compute_loss,
    stock_loss_factor,
    stock_training_step,
)
from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.harness import SINGLE, TRAIN_ROWS, RunResult, Topology, run_case, runs_worker
from tests.helpers.heads import Case
from tests.helpers.tiny import classification_rows, tiny_bert_classifier


def _classifier_rows(n: int, seed: int) -> list[dict]:
    return classification_rows(n, seed=seed).rows


# BertForSequenceClassification: its forward takes **kwargs, its loss is CrossEntropyLoss() (the mean of its rows).
# Every row has a label, so the mean of equal micro-batches' means is the mean of the whole step: a fallback that
# scales right is exact.
CASE = Case("bert_classifier", tiny_bert_classifier, _classifier_rows)
TOL = 1e-6


# ---- Trainer subclasses that compute the loss themselves ------------------------------------------------------------


class _CallsSuper:
    """Overrides compute_loss only to call super() (as logging or bookkeeping overrides do)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class _OwnMean:
    """Its own loss, without super(): the mean over its rows, ignoring num_items_in_batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs.logits, labels)
        return (loss, outputs) if return_outputs else loss


class _CountedSum:
    """Like TRL's SFTTrainer: its own loss, a sum over num_items_in_batch times the number of processes."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        count = labels.numel() if num_items_in_batch is None else num_items_in_batch
        loss = F.cross_entropy(outputs.logits, labels, reduction="sum") / torch.as_tensor(count).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss


class OursCallsSuper(_CallsSuper, Trainer):
    pass


class StockCallsSuper(_CallsSuper, transformers.Trainer):
    pass


class OursOwnMean(_OwnMean, Trainer):
    pass


class StockOwnMean(_OwnMean, transformers.Trainer):
    pass


class OursCountedSum(_CountedSum, Trainer):
    pass


class StockCountedSum(_CountedSum, transformers.Trainer):
    pass


OURS_ARGS, STOCK_ARGS = TrainingArguments, transformers.TrainingArguments


@functools.cache
def single() -> RunResult:
    """One process on the whole batch, with the exact loss of the plain Trainer: the value every exact run equals."""
    return run_case(CASE, SINGLE)


def update_error(result: RunResult, reference: RunResult) -> float:
    """Largest parameter difference from the reference, relative to the largest change the reference made."""
    initial = dict(CASE.build(0).named_parameters())
    params, expected = result.params, reference.params
    update = max((expected[n] - initial[n]).abs().max().item() for n in initial)
    return max((params[n] - expected[n]).abs().max().item() for n in initial) / update


def assert_exact(result: RunResult, what: str) -> None:
    reference = single()
    assert result.loss == pytest.approx(reference.loss, rel=TOL), f"{what}: logged loss"
    assert update_error(result, reference) < TOL, f"{what}: the update"


# ---- WatchedCount ---------------------------------------------------------------------------------------------------


def test_watched_count_counts_reads_of_its_value_only():
    count = WatchedCount.of(torch.tensor(12))
    assert (count.device, count.dtype, count.shape, count.dim(), count.size(), count.requires_grad) == (
        torch.device("cpu"), torch.int64, torch.Size([]), 0, torch.Size([]), False,
    )  # fmt: skip
    assert count.reads == 0
    loss = torch.tensor(6.0) / count
    assert count.reads == 1 and type(loss) is torch.Tensor and loss.item() == 0.5
    assert int(count) == 12 and count.item() == 12 and count.reads == 3
    clamped = torch.as_tensor(count).clamp(min=1)  # what TRL's SFTTrainer does with it
    assert type(clamped) is torch.Tensor and count.reads >= 4
    assert WatchedCount.of(count) is count
    data = WatchedCount.of(torch.tensor(3)).data  # a getter that returns the value reads it
    assert type(data) is torch.Tensor


# ---- The decision, on a stand-in Trainer (no training) --------------------------------------------------------------


def _stand_in(n_gpu=1, processes=2, exact_loss=True, accepts_kwargs=True, scaled=None, tp=1):
    args = SimpleNamespace(exact_loss=exact_loss, n_gpu=n_gpu, average_tokens_across_devices=True, torch_compile=False)
    return SimpleNamespace(
        args=args, model_accepts_loss_kwargs=accepts_kwargs, compute_loss_func=None, loss_is_scaled_for_ga=scaled,
        accelerator=SimpleNamespace(num_processes=processes),
        get_tp_size=lambda: tp, get_cp_size=lambda: 1, get_sp_size=lambda: 1,
    )  # fmt: skip


def _stock(reads: bool):
    """A stock compute_loss on a per-row loss of 1 or, reading the count, 1 / count; times the factor stock uses."""

    def compute(model, inputs, return_outputs, count):
        loss = torch.tensor(1.0) / count if reads else torch.tensor(1.0)
        return loss * model.factor

    return compute


@pytest.mark.parametrize(
    ("trainer", "reads", "expected"),
    [
        (_stand_in(), False, 1.0),  # DDP 2, the loss ignores the count: stock's x2 removed
        (_stand_in(), True, 2 / 4),  # the loss reads the count: stock's S / C x 2 kept
        (_stand_in(n_gpu=2), False, 2.0),  # DataParallel: left as stock
        (_stand_in(exact_loss=False), False, 2.0),  # exact_loss=False asks for stock
        (_stand_in(tp=2, processes=4), False, 2.0),  # tensor parallelism: left as stock
        (_stand_in(processes=1), False, 1.0),  # one process: stock multiplies by 1
    ],
    ids=["ddp-ignores", "ddp-reads", "data-parallel", "exact-off", "tensor-parallel", "one-process"],
)
def test_stock_compute_loss_removes_the_world_size_only_from_a_loss_that_ignores_the_count(trainer, reads, expected):
    model = SimpleNamespace(factor=stock_loss_factor(trainer, torch.tensor(4)))
    loss = stock_compute_loss(trainer, _stock(reads), model, {}, False, torch.tensor(4))
    assert loss.item() == pytest.approx(expected)


def test_stock_compute_loss_keeps_the_outputs_and_a_missing_count():
    def compute(model, inputs, return_outputs, count):
        return (torch.tensor(2.0), "outputs") if return_outputs else torch.tensor(2.0)

    loss, outputs = stock_compute_loss(_stand_in(), compute, None, {}, True, torch.tensor(4))
    assert loss.item() == 1.0 and outputs == "outputs"  # the count was not read: stock's x2 removed
    # No count: stock multiplied nothing, and nothing is divided.
    assert stock_compute_loss(_stand_in(), compute, None, {}, False, None).item() == 2.0


@pytest.mark.parametrize(
    ("scaled", "reads", "seen"),
    [(None, False, False), (None, True, True), (False, True, False), (True, False, True)],
    ids=["ignores-the-count", "reads-the-count", "subclass-says-unscaled", "subclass-says-scaled"],
)
def test_stock_training_step_divides_by_ga_unless_the_loss_read_the_count(scaled, reads, seen):
    trainer = _stand_in(processes=1, scaled=scaled)

    def step(model, inputs, count):
        # What stock's training_step does: compute_loss, then read loss_is_scaled_for_ga.
        if reads:
            torch.tensor(1.0) / count
        return bool(trainer.loss_is_scaled_for_ga)

    assert stock_training_step(trainer, step, None, {}, torch.tensor(4)) is seen
    assert trainer.loss_is_scaled_for_ga is scaled  # restored after the step


# ---- One process, gradient accumulation 2 ---------------------------------------------------------------------------


def test_gradient_accumulation_of_a_subclass_calling_super(hf_parallel_log):
    """Stock skips the division by the accumulation steps for BERT (its forward takes **kwargs): x2."""
    topology = Topology("grad-accum 2", per_device=TRAIN_ROWS // 2, accumulation=2)
    stock = run_case(CASE, topology, stock=True, classes=(StockCallsSuper, STOCK_ARGS))
    ours = run_case(CASE, topology, classes=(OursCallsSuper, OURS_ARGS))
    assert stock.loss / single().loss == pytest.approx(2.0, rel=1e-5)
    assert update_error(stock, single()) > 0.5
    assert_exact(ours, "subclass calling super(), GA 2")
    fallbacks = [m for m in hf_parallel_log.messages if m.startswith("exact_loss:")]
    assert len(fallbacks) == 1, fallbacks
    assert "_CallsSuper overrides compute_loss" in fallbacks[0] and FALLBACK_NOTE in fallbacks[0]
    assert fallbacks[0].count("The loss is left to the Trainer") == 1, fallbacks[0]


# ---- DDP, 2 CPU ranks, one spawn ------------------------------------------------------------------------------------

DDP = Topology("DDP 2", per_device=TRAIN_ROWS // 2, processes=2)
DDP_GA = Topology("DDP 2 x grad-accum 2", per_device=TRAIN_ROWS // 4, accumulation=2, processes=2)
# Stock runs train without evaluating first (stock would then never wrap the model in DDP).
STOCK_TRAIN_ONLY = {"eval_rows": 0}
DDP_RUNS = {
    # name: (case, topology, stock, overrides)
    "stock, super()": (CASE, DDP, True, {"classes": (StockCallsSuper, STOCK_ARGS), **STOCK_TRAIN_ONLY}),
    "ours, super()": (CASE, DDP, False, {"classes": (OursCallsSuper, OURS_ARGS)}),
    "ours, super(), exact_loss=False": (
        CASE,
        DDP,
        False,
        {"classes": (OursCallsSuper, OURS_ARGS), "exact_loss": False},
    ),
    "stock, own mean, GA 2": (CASE, DDP_GA, True, {"classes": (StockOwnMean, STOCK_ARGS), **STOCK_TRAIN_ONLY}),
    "ours, own mean, GA 2": (CASE, DDP_GA, False, {"classes": (OursOwnMean, OURS_ARGS), "eval_rows": 0}),
    "stock, counted sum, GA 2": (CASE, DDP_GA, True, {"classes": (StockCountedSum, STOCK_ARGS), **STOCK_TRAIN_ONLY}),
    "ours, counted sum, GA 2": (CASE, DDP_GA, False, {"classes": (OursCountedSum, OURS_ARGS), "eval_rows": 0}),
}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("fallback_ddp")
    spawn_cpu_ranks(runs_worker, (DDP_RUNS, str(out_dir)), num_processes=2)
    return torch.load(out_dir / "results.pt", weights_only=False)


def _assert_ddp(result: RunResult) -> None:
    assert result.world_size == 2 and result.parallel_mode == "ParallelMode.DISTRIBUTED"
    assert result.wrapped == "DistributedDataParallel"
    assert result.max_rank_param_diff == 0.0


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_subclass_calling_super_loses_the_world_size_factor(ddp_results):
    stock, ours, off = (ddp_results[n] for n in ("stock, super()", "ours, super()", "ours, super(), exact_loss=False"))
    for result in (stock, ours, off):
        _assert_ddp(result)
    # Stock multiplies BERT's own mean by the 2 processes: loss and gradient x2.
    assert stock.loss / single().loss == pytest.approx(2.0, rel=1e-5)
    assert update_error(stock, single()) > 0.5
    assert_exact(ours, "subclass calling super() under DDP 2")
    # exact_loss=False is stock, as it is; and stock's evaluation multiplies each batch's mean by 2 too.
    assert off.loss == stock.loss
    assert off.eval_loss / ours.eval_loss == pytest.approx(2.0, rel=TOL)


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_subclass_with_its_own_mean_is_divided_by_the_accumulation_steps(ddp_results):
    stock, ours = ddp_results["stock, own mean, GA 2"], ddp_results["ours, own mean, GA 2"]
    _assert_ddp(stock)
    _assert_ddp(ours)
    assert stock.loss / single().loss == pytest.approx(2.0, rel=1e-5)  # not divided by the 2 steps
    assert_exact(ours, "own mean under DDP 2 x GA 2")


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_subclass_that_reads_the_count_is_left_alone(ddp_results):
    stock, ours = ddp_results["stock, counted sum, GA 2"], ddp_results["ours, counted sum, GA 2"]
    _assert_ddp(ours)
    # Bit for bit what stock does: the loss divides by num_items_in_batch, so it owns its normalisation ...
    assert ours.loss == stock.loss
    assert all(torch.equal(ours.params[n], stock.params[n]) for n in stock.params)
    # ... which here is right, as TRL's is.
    assert_exact(ours, "counted sum under DDP 2 x GA 2")
