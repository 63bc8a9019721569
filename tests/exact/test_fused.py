"""
A forward that fuses its loss with the LM head and never builds the logits (Liger's `use_liger_kernel=True`; the
CPU stand-in of tests/helpers/fused.py) trains and evaluates exactly through the model's own loss, given its labels and
the step's item count: under gradient accumulation, emulated DataParallel (torch's own replicate / parallel_apply), DDP
on 2 CPU ranks, the padded last step of an epoch and evaluation duplicates; and with `use_liger_kernel=True` the
Trainer's own Liger path (`skip_logits=True` in evaluation) runs with the stand-in applied in place of the kernel.

The reference is the unpatched model's own loss on the whole step in one process, by hand.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import default_data_collator

from hf_parallel.exact import Route
from tests.helpers.compare import assert_losses_close
from tests.helpers.fused import fuse_loss
from tests.helpers.harness import (
    EVAL_ROWS,
    SINGLE,
    TRAIN_ROWS,
    Topology,
    max_relative_diff,
    record_hf_parallel_log,
    run_case,
    run_ddp_runs,
)
from tests.helpers.heads import Case, llama, lm_rows

TOL = 1e-5


def fused_llama(seed: int) -> torch.nn.Module:
    """The matrix's tiny Llama, its forward fused as Liger's (chunks of 5 positions: several per batch)."""
    model = llama(seed)
    fuse_loss(model, chunk_size=5)
    return model


FUSED = Case("llama_fused", fused_llama, lm_rows)
PLAIN = Case("llama_plain", llama, lm_rows)

TOPOLOGIES = (
    SINGLE,
    Topology("GA 2 x B", per_device=TRAIN_ROWS // 2, accumulation=2),
    Topology("DP 2 x B", per_device=TRAIN_ROWS, dp_devices=2),
    Topology("DP 3 gpu0_bsz=1", per_device=TRAIN_ROWS, dp_devices=3, gpu0_bsz=1),
)


def _reference(rows: int, seed: int) -> tuple[float, dict]:
    """The unpatched model's own mean loss over all `rows` rows and its gradient: the definition of exact."""
    model = llama(0)
    loss = model(**default_data_collator(lm_rows(rows, seed))).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _record(result):
    return result.trainer.accelerator.unwrap_model(result.trainer.model).fused_calls_record


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=[t.name for t in TOPOLOGIES])
def test_fused_loss_trains_exactly_without_logits(topology):
    loss, grads = _reference(TRAIN_ROWS, seed=1)
    eval_loss, _ = _reference(EVAL_ROWS, seed=2)
    result = run_case(FUSED, topology, evaluate_first=False)
    record = _record(result)
    fused = [call.fused for call in record.calls]
    trained = fused.index(False) if False in fused else len(fused)  # evaluation (after training) builds logits
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL
    # Training never built the logits: every training forward took the fused path (in every replica under DP), and so
    # did the check's two before the first step (given N and 2N: a fused loss has no logits to compare).
    forwards = (topology.accumulation + 2) * topology.dp_devices
    assert all(fused[:trained]) and not any(fused[trained:]) and trained == forwards
    assert result.trainer.exact.head(result.trainer.model).route is Route.MODEL_LOSS
    # Evaluation (after training, on the trained model) equals the plain model's Σ S / Σ C with the same weights.
    model = llama(0)
    model.load_state_dict(result.params, strict=False)
    reference = model(**default_data_collator(lm_rows(EVAL_ROWS, seed=2))).loss.item()
    assert result.eval_loss == pytest.approx(reference, rel=TOL)
    assert eval_loss != pytest.approx(reference, rel=1e-4)  # training moved the weights: the check can fail


def test_plain_lm_takes_its_own_loss_too_and_the_check_says_so():
    # A transformers LM's own loss honours num_items_in_batch: the check finds it from the logits.
    result = run_case(PLAIN, Topology("GA 2 x B", per_device=TRAIN_ROWS // 2, accumulation=2), eval_rows=0)
    loss, grads = _reference(TRAIN_ROWS, seed=1)
    assert result.trainer.exact.head(result.trainer.model).name == "causal_lm/model_loss"
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL


def _liger_stand_in(model, kernel_config):
    """What `transformers.trainer.apply_liger_kernel` does with Liger installed, with the CPU stand-in instead."""
    fuse_loss(model, chunk_size=5)


def test_use_liger_kernel_evaluates_with_skip_logits_exactly(monkeypatch):
    # The Trainer's own Liger path: it patches the model at __init__ and passes skip_logits=True in evaluation with
    # prediction_loss_only; no forward builds the logits, evaluation included.
    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", _liger_stand_in)
    eval_loss, _ = _reference(EVAL_ROWS, seed=2)
    result = run_case(PLAIN, SINGLE, use_liger_kernel=True, prediction_loss_only=True, max_steps=1)
    record = _record(result)
    assert record.calls and record.logits_calls == 0
    assert result.eval_loss == pytest.approx(eval_loss, rel=TOL)  # evaluated first, on the initial weights
    loss, grads = _reference(TRAIN_ROWS, seed=1)
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL


def test_a_fused_loss_that_ignores_the_count_falls_back_with_a_warning(monkeypatch):
    # A forward that builds no logits and divides by its own count whatever it is given: nothing can make it exact.
    def mean_only(model):
        fuse_loss(model, chunk_size=5)
        forward = model.forward

        def ignoring(**kwargs):
            kwargs.pop("num_items_in_batch", None)
            return forward(**kwargs)

        model.forward = ignoring
        return model

    case = Case("llama_fused_mean", lambda seed: mean_only(llama(seed)), lm_rows)
    with record_hf_parallel_log() as log:
        result = run_case(case, Topology("GA 2 x B", per_device=TRAIN_ROWS // 2, accumulation=2), eval_rows=0)
    assert result.trainer.exact.head(result.trainer.model) is None
    assert any("computes its own loss" in message or "stock" in message for message in log.messages)


DDP = Topology("DDP 2 x B", per_device=TRAIN_ROWS // 2, processes=2)
# 10 rows, 2 ranks x 4: the second step holds 2 real rows and 6 repeats accelerate added.
PADDED = dict(train_rows=10, max_steps=2, evaluate_first=True)


@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_fused_loss_under_ddp_is_exact_with_padded_steps_and_eval_duplicates(tmp_path):
    runs = {
        "fused": (FUSED, DDP, False, {}),
        "fused padded": (FUSED, DDP, False, PADDED),
        # One evaluation batch per rank, with the duplicate in it: the head is checked (and switches to the model's
        # own loss) on the padded batch itself.
        "fused one eval batch": (FUSED, DDP, False, {"per_device_eval_batch_size": 4}),
        "plain one eval batch": (PLAIN, DDP, False, {"per_device_eval_batch_size": 4}),
        # Trained before any evaluation: stock evaluated first would never wrap the model in DDP (another trap).
        "stock padded": (FUSED, DDP, True, {**PADDED, "evaluate_first": False, "eval_rows": 0}),
    }
    results = run_ddp_runs(runs, tmp_path)
    for result in results.values():
        assert result.world_size == 2 and result.wrapped == "DistributedDataParallel"
        assert result.max_rank_param_diff == 0.0
    loss, grads = _reference(TRAIN_ROWS, seed=1)
    eval_loss, _ = _reference(EVAL_ROWS, seed=2)  # 7 rows on 2 ranks x 2: one duplicate in the last batch
    fused = results["fused"]
    assert fused.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(fused.grads, grads) < TOL
    assert fused.eval_loss == pytest.approx(eval_loss, rel=TOL)
    assert results["fused one eval batch"].eval_loss == pytest.approx(eval_loss, rel=TOL)
    assert results["plain one eval batch"].eval_loss == pytest.approx(eval_loss, rel=TOL)
    # The padded step: one process on the same 10 rows in the same order (batch 8, then the 2 real rows).
    single = run_case(PLAIN, SINGLE, **PADDED)
    padded = results["fused padded"]
    assert_losses_close(padded.losses, single.losses, "fused padded", rel=TOL)
    assert max_relative_diff(padded.params, single.params) < TOL
    # Stock trains the repeats of the last step.
    assert max_relative_diff(results["stock padded"].params, single.params) > 1e-3
