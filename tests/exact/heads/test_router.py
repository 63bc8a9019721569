"""
The router loss of a mixture-of-experts LM (tests/helpers/moe.py: Mixtral, Qwen3-MoE with a dense first layer), exact
over the whole batch: one process, torch's DataParallel (the emulation, even and with `gpu0_bsz`) and 2-rank DDP equal
the model's own loss and gradient on all the step's rows in one forward, and the evaluation loss the model's own loss
on the whole set. Under gradient accumulation (one process, DataParallel, DDP) the router term is that of one forward
over the whole step too (`router_balance="step"`, the default), or with `router_balance="micro_batch"` each
micro-batch's, averaged over the step, with a warning. Stock is the control that must differ.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import MixtralConfig, MixtralForSequenceClassification
from transformers.data.data_collator import default_data_collator
from transformers.utils.output_capturing import maybe_install_capturing_hooks

import hf_parallel
from hf_parallel import ExactLoop
from hf_parallel.exact import resolve_head
from hf_parallel.exact.heads.router import RouterBalance, router_balance_of
from tests.helpers.harness import (
    DDP2,
    DDP2_GA2,
    DP2,
    DP3_GPU0,
    EVAL_ROWS,
    GA2,
    SINGLE,
    TRAIN_ROWS,
    RunResult,
    Topology,
    assert_equivalent,
    max_relative_diff,
    record_hf_parallel_log,
    run_case,
    run_ddp_runs,
)
from tests.helpers.moe import CASES, ROUTER_COEF
from tests.helpers.tiny import tiny

TOL = 1e-5

_single: dict[str, RunResult] = {}


def single(case: str) -> RunResult:
    if case not in _single:
        _single[case] = run_case(CASES[case], SINGLE)
    return _single[case]


def _own_loss_and_grads(case: str, rows: list[dict]) -> tuple[float, dict]:
    model = CASES[case].build(0)
    loss = model(**default_data_collator(rows)).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_is_the_models_own_loss_with_its_router_term(case):
    loss, grads = _own_loss_and_grads(case, CASES[case].rows(TRAIN_ROWS, 1))
    result = single(case)
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL
    # Evaluation: the model's own loss on the whole set in one forward (its router term over every row of the set).
    model = CASES[case].build(0).eval()
    with torch.no_grad():
        whole_set = model(**default_data_collator(CASES[case].rows(EVAL_ROWS, 2))).loss.item()
    assert result.eval_loss == pytest.approx(whole_set, rel=TOL)


DP2_GA2 = Topology("DP 2 x grad-accum 2", per_device=TRAIN_ROWS // 4, accumulation=2, dp_devices=2)


@pytest.mark.parametrize(
    ("case", "topology"),
    [
        pytest.param(case, topology, id=f"{case}-{topology.name}")
        for topology in (DP2, DP3_GPU0, DP2_GA2)
        for case in CASES
    ],
)
def test_data_parallel_equals_one_process(case, topology):
    result = run_case(CASES[case], topology)
    assert_equivalent(result, single(case), f"{case} under {topology.name}", TOL)


class RecordingTrainer(hf_parallel.Trainer):
    """Records the micro-batches a step trains on, in order (the sampler shuffles the rows)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.micro_batches = [*getattr(self, "micro_batches", []), {k: v.clone() for k, v in inputs.items()}]
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize("case", ["mixtral_moe", "qwen3_moe"])
def test_gradient_accumulation_router_loss_over_the_whole_step(case):
    """
    GA 2 with `router_balance="step"` (the default): the loss and gradient of the model's own loss in one forward on
    the step's rows, router term included (the step's first pass gives the expert fractions of both micro-batches);
    no warning. Stock adds up the micro-batches' router terms instead.
    """
    with record_hf_parallel_log() as log:
        ours = run_case(CASES[case], GA2, classes=(RecordingTrainer, hf_parallel.TrainingArguments), eval_rows=0)
    assert "router" not in log.text, log.text
    halves = ours.trainer.micro_batches
    model = CASES[case].build(0)
    whole = model(**default_data_collator([r for b in halves for r in _rows(b)]))
    whole.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert ours.loss == pytest.approx(whole.loss.item(), rel=TOL)
    assert max_relative_diff(ours.grads, grads) < 1e-4
    stock = run_case(CASES[case], GA2, stock=True, eval_rows=0)
    assert abs(stock.loss - whole.loss.item()) > 0.1


def test_router_balance_micro_batch_averages_the_micro_batches_terms():
    """
    GA 2 with `router_balance="micro_batch"`: the loss and gradient of `CE(whole step) + coef x mean over
    micro-batches of the model's own router loss on each`, from the model's own functions; one warning says so.
    Stock sums the router terms instead (x2).
    """
    case = "mixtral_moe"
    with record_hf_parallel_log() as log:
        ours = run_case(
            CASES[case],
            GA2,
            classes=(RecordingTrainer, hf_parallel.TrainingArguments),
            eval_rows=0,
            router_balance="micro_batch",
        )
    assert "averaged over the 2 micro-batches" in log.text
    halves = ours.trainer.micro_batches
    model = CASES[case].build(0)
    whole = model(**default_data_collator([r for b in halves for r in _rows(b)]))
    cross_entropy = whole.loss - ROUTER_COEF * whole.aux_loss
    routers = [model(**half).aux_loss for half in halves]
    reference = cross_entropy + ROUTER_COEF * sum(routers) / len(routers)
    reference.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert ours.loss == pytest.approx(reference.item(), rel=TOL)
    assert max_relative_diff(ours.grads, grads) < 1e-4
    # The control: stock adds up the micro-batches' router terms.
    stock = run_case(CASES[case], GA2, stock=True, eval_rows=0)
    summed = cross_entropy.item() + ROUTER_COEF * sum(r.item() for r in routers)
    assert stock.loss == pytest.approx(summed, rel=1e-4)
    assert abs(stock.loss - reference.item()) > 0.5


def test_router_balance_is_checked():
    with pytest.raises(ValueError, match="router_balance must be 'step' or 'micro_batch', got 'batch'"):
        hf_parallel.TrainingArguments(output_dir="out", router_balance="batch", use_cpu=True, report_to="none")


def _rows(batch: dict) -> list[dict]:
    return [{key: value[i] for key, value in batch.items()} for i in range(len(batch["input_ids"]))]


def _hooks_installed_first(build):
    """
    The model with transformers' output-capturing hooks installed, as a first forward on one device installs them.

    Without it, stock's DataParallel races: each replica's first forward installs the hooks again into the hook dicts
    the replicas share with the model (replication copies `__dict__` shallowly), so a replica that runs while another
    installs records its router logits once or twice, and torch's gather fails now and then on tuples of different
    lengths ("zip() argument 2 is longer than argument 1"). hf_parallel installs them once before replicating.
    """

    def hooked(seed: int):
        model = build(seed)
        maybe_install_capturing_hooks(model)
        return model

    return hooked


def test_control_stock_data_parallel_takes_each_replicas_router_term():
    """Stock's torch DataParallel averages the replicas' losses, each with the router term of its own rows."""
    case = dataclasses.replace(CASES["mixtral_moe"], build=_hooks_installed_first(CASES["mixtral_moe"].build))
    stock = run_case(case, DP2, stock=True, eval_rows=0)
    assert abs(stock.loss - single("mixtral_moe").loss) > 0.5
    assert max_relative_diff(stock.grads, single("mixtral_moe").grads) > 0.1


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> dict:
    runs = {f"DDP 2: {case}": (CASES[case], DDP2, False, {}) for case in CASES}
    runs |= {f"DDP 2 x GA 2: {case}": (CASES[case], DDP2_GA2, False, {}) for case in CASES}
    runs["stock DDP 2: mixtral_moe"] = (CASES["mixtral_moe"], DDP2, True, {})
    return run_ddp_runs(runs, tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_two_ranks_equal_one_process(ddp_results):
    for case in CASES:
        result = ddp_results[f"DDP 2: {case}"]
        assert result.wrapped == "DistributedDataParallel"
        assert result.max_rank_param_diff == 0.0
        assert_equivalent(result, single(case), f"{case} under DDP 2", TOL)
        # Under accumulation too: the step's first pass counts the router statistics of both ranks' micro-batches.
        accumulated = ddp_results[f"DDP 2 x GA 2: {case}"]
        assert accumulated.max_rank_param_diff == 0.0
        assert_equivalent(accumulated, single(case), f"{case} under DDP 2 x GA 2", TOL)
    # The control: stock's router term is each rank's own, x the world size (transformers #48690).
    stock = ddp_results["stock DDP 2: mixtral_moe"]
    assert abs(stock.loss - single("mixtral_moe").loss) > 0.5
    assert max_relative_diff(stock.grads, single("mixtral_moe").grads) > 0.1


@pytest.mark.parametrize("accumulation", [1, 2], ids=lambda ga: f"GA{ga}")
def test_exact_loop_one_step_is_the_models_own_loss(accumulation):
    """The step's rows in one batch, or in 2 micro-batches (the router statistics from the step's first pass)."""
    case = CASES["qwen3_moe"]
    rows = case.rows(TRAIN_ROWS, 1)
    loss, grads = _own_loss_and_grads("qwen3_moe", rows)
    model = case.build(0)
    loader = torch.utils.data.DataLoader(rows, batch_size=TRAIN_ROWS // accumulation, collate_fn=default_data_collator)
    (step,) = ExactLoop().steps(loader, accumulation)
    for batch in step:
        step.loss(model, batch).backward()
    assert step.logged_loss() == pytest.approx(loss, rel=TOL)
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert max_relative_diff(ours, grads) < TOL


def test_router_balance_reads_the_model_and_checks_its_sizes():
    model = CASES["mixtral_moe"].build(0)
    router = router_balance_of(model)
    assert (router.experts, router.top_k, router.coef) == (4, 2, ROUTER_COEF)
    assert resolve_head(model).router is not None
    with pytest.raises(ValueError, match="top_k=5"):
        RouterBalance(4, 5, 0.1)
    # A MoE classifier adds no router term to its loss: its head has none (the check confirms the plain loss).
    config = tiny(
        MixtralConfig, num_local_experts=4, output_router_logits=True, problem_type="single_label_classification"
    )
    classifier = MixtralForSequenceClassification(config)
    assert resolve_head(classifier).router is None
