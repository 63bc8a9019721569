"""
Contrastive losses over the whole step (tests/helpers/contrastive.py: CLIP and SigLIP, `return_loss=True`): under
gradient accumulation (the cached two-pass), torch's DataParallel (the emulation, even and with `gpu0_bsz`) and 2-rank
DDP (alone and with GA 2), the logged loss, the gradient and the weights after the step equal the model's own loss on
all the step's rows in one forward; evaluation takes each batch over every device as one batch. Stock is the control
that must differ; `contrastive_negatives="micro_batch"` gives stock's per-micro-batch negatives, warned; a contrastive
model whose loss is not the recomputed one falls back with a warning; the hand-written loop (`ExactLoop`) with dropout
equals one forward over the step drawn with the same random state.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import CLIPModel

import hf_parallel
from hf_parallel import ExactLoop
from hf_parallel.exact import resolve_head
from hf_parallel.exact.resolve import UnsupportedHead
from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.contrastive import CASES, _clip, clip_rows, collate
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
    max_relative_diff,
    record_hf_parallel_log,
    run_case,
    run_ddp_runs,
)
from tests.helpers.heads import Case

TOL = 1e-5
EVAL_BATCH = 2  # harness.SGD_STEP's per_device_eval_batch_size

_single: dict[str, RunResult] = {}


def single(case: str) -> RunResult:
    if case not in _single:
        _single[case] = run_case(CASES[case], SINGLE)
    return _single[case]


def own_eval_loss(case: str, global_batch: int) -> float:
    """The model's own loss on each evaluation batch of `global_batch` rows (every device's), averaged over them."""
    model = CASES[case].build(0).eval()
    rows = CASES[case].rows(EVAL_ROWS, 2)  # run_case's evaluation rows, in order
    with torch.no_grad():
        losses = [model(**collate(rows[i : i + global_batch])).loss.item() for i in range(0, len(rows), global_batch)]
    return sum(losses) / len(losses)


def assert_exact(result: RunResult, case: str, devices: int, what: str) -> None:
    reference = single(case)
    assert result.loss == pytest.approx(reference.loss, rel=TOL), f"{what}: logged loss"
    assert max_relative_diff(result.grads, reference.grads) < TOL, f"{what}: gradient"
    assert max_relative_diff(result.params, reference.params) < TOL, f"{what}: parameters after the step"
    assert result.eval_loss == pytest.approx(own_eval_loss(case, EVAL_BATCH * devices), rel=TOL), f"{what}: eval"


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_is_the_models_own_loss(case):
    model = CASES[case].build(0)
    loss = model(**collate(CASES[case].rows(TRAIN_ROWS, 1))).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    result = single(case)
    assert result.loss == pytest.approx(loss.item(), rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL
    assert result.eval_loss == pytest.approx(own_eval_loss(case, EVAL_BATCH), rel=TOL)


@pytest.mark.parametrize(
    ("case", "topology"),
    [pytest.param(c, t, id=f"{c}-{t.name}") for t in (GA2, DP2, DP3_GPU0) for c in CASES],
)
def test_in_process_topologies_equal_one_process(case, topology):
    result = run_case(CASES[case], topology)
    assert_exact(result, case, topology.dp_devices, f"{case} under {topology.name}")


@pytest.mark.parametrize("case", list(CASES))
def test_control_stock_under_gradient_accumulation(case):
    """Stock: each micro-batch scores its rows against its own rows only (x0.6 here), and the gradient is another."""
    stock = run_case(CASES[case], GA2, stock=True, eval_rows=0)
    assert stock.loss / single(case).loss < 0.8
    assert max_relative_diff(stock.grads, single(case).grads) > 0.1


def _with_temperature(features: list[dict]) -> dict:
    return {**collate(features), "temperature": 0.5}


def test_videoprism_with_a_temperature_argument_is_stock_warned():
    """
    VideoPrism scales its similarities by a `temperature` its batch may pass, which the step's loss does not read: the
    check sees the model's loss differ from the one recomputed, falls back to the model's own loss, warned, and
    trains exactly as stock does.
    """
    case = Case("videoprism_temperature", CASES["videoprism_contrastive"].build, CASES["videoprism_contrastive"].rows)
    case = dataclasses.replace(case, collator=_with_temperature)
    with record_hf_parallel_log() as log:
        ours = run_case(case, GA2, eval_rows=0)
    assert "VideoPrismClipModel's own contrastive loss" in log.text and "is not the videoprism loss" in log.text
    stock = run_case(case, GA2, stock=True, eval_rows=0)
    assert ours.loss == pytest.approx(stock.loss, rel=TOL)
    assert max_relative_diff(ours.grads, stock.grads) < TOL
    plain = run_case(CASES["videoprism_contrastive"], GA2, stock=True, eval_rows=0)
    assert abs(stock.loss - plain.loss) > 1e-3  # the temperature changes the loss: the check had something to see


def test_micro_batch_negatives_are_stocks_and_warned():
    case = "clip_contrastive"
    with record_hf_parallel_log() as log:
        ours = run_case(CASES[case], GA2, eval_rows=0, contrastive_negatives="micro_batch")
    assert "contrastive_negatives='micro_batch'" in log.text
    stock = run_case(CASES[case], GA2, stock=True, eval_rows=0)
    assert ours.loss == pytest.approx(stock.loss, rel=TOL)
    assert max_relative_diff(ours.grads, stock.grads) < TOL


def test_contrastive_negatives_must_be_known():
    with pytest.raises(ValueError, match="contrastive_negatives must be 'step' or 'micro_batch', got 'batch'"):
        hf_parallel.TrainingArguments(output_dir="unused", contrastive_negatives="batch", use_cpu=True)


class DoubledLossCLIP(CLIPModel):
    """A CLIP whose own loss is another than CLIP's (twice it): the reconstruction must not be taken."""

    def forward(self, **inputs):
        outputs = super().forward(**inputs)
        if outputs.loss is not None:
            outputs.loss = outputs.loss * 2
        return outputs


DoubledLossCLIP.__name__ = "CLIPModel"  # the head is chosen by class name: this one is taken for CLIP


def _doubled(seed: int):
    model = _clip(seed)
    model.__class__ = DoubledLossCLIP
    return model


def test_an_unknown_contrastive_loss_falls_back_with_a_warning():
    case = Case("doubled_clip", _doubled, clip_rows, collator=collate)
    with record_hf_parallel_log() as log:
        ours = run_case(case, GA2, eval_rows=0)
    assert "is not the clip loss recomputed" in log.text
    stock = run_case(case, GA2, stock=True, eval_rows=0)
    assert ours.loss == pytest.approx(stock.loss, rel=TOL)
    assert max_relative_diff(ours.grads, stock.grads) < TOL


def test_a_model_without_known_scale_parameters_is_unsupported():
    model = _clip(0)
    del model.logit_scale
    with pytest.raises(UnsupportedHead, match="scale parameters hf_parallel does not know"):
        resolve_head(model)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> dict:
    # SigLIP under DDP alone; CLIP also with GA 2 (the two-pass across ranks).
    runs = {f"{DDP2.name}: {case}": (CASES[case], DDP2, False, {}) for case in CASES}
    runs[f"{DDP2_GA2.name}: clip_contrastive"] = (CASES["clip_contrastive"], DDP2_GA2, False, {})
    runs["stock DDP 2: clip_contrastive"] = (CASES["clip_contrastive"], DDP2, True, {"eval_rows": 0})
    return run_ddp_runs(runs, tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_two_ranks_equal_one_process(ddp_results):
    for name, result in ddp_results.items():
        if name.startswith("stock"):
            continue
        topology, case = name.split(": ")
        assert result.wrapped == "DistributedDataParallel"
        assert result.max_rank_param_diff == 0.0
        assert_exact(result, case, 2, f"{case} under {topology}")
    stock = ddp_results["stock DDP 2: clip_contrastive"]
    assert stock.loss / single("clip_contrastive").loss < 0.8


def test_exact_loop_two_pass_with_dropout_is_one_forward_over_the_step():
    """
    ExactLoop, 2 micro-batches of a CLIP with dropout: the gradient is that of the whole step's loss with the masks the
    micro-batches drew (one forward each, from the same random state, in one graph), and the logged loss its value.
    """
    rows = clip_rows(TRAIN_ROWS, 1)
    reference_model = _clip(0, dropout=0.3).train()
    torch.manual_seed(7)
    halves = list(DataLoader(rows, batch_size=4, collate_fn=collate))  # its iterator draws a seed, as the loop's
    outputs = [reference_model(**{k: v for k, v in half.items() if k != "return_loss"}) for half in halves]
    text = torch.cat([o.text_embeds for o in outputs])
    image = torch.cat([o.image_embeds for o in outputs])
    logits = text @ image.t() * reference_model.logit_scale.exp()
    targets = torch.arange(TRAIN_ROWS)
    reference = (
        torch.nn.functional.cross_entropy(logits, targets) + torch.nn.functional.cross_entropy(logits.t(), targets)
    ) / 2
    reference.backward()
    grads = {n: p.grad for n, p in reference_model.named_parameters() if p.grad is not None}

    model = _clip(0, dropout=0.3).train()
    loader = DataLoader(rows, batch_size=4, collate_fn=collate)
    torch.manual_seed(7)
    (step,) = ExactLoop().steps(loader, accumulation_steps=2)
    for batch in step:
        step.loss(model, batch).backward()
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert step.logged_loss() == pytest.approx(reference.item(), rel=TOL)
    assert max_relative_diff(ours, grads) < 1e-4


def _loop_worker(out_dir: str) -> None:
    """One rank of a hand-written DDP loop: CLIP, 2 rows x GA 2 per rank, then an evaluation whose last batch holds a
    row the DistributedSampler repeats."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    torch.set_num_threads(1)
    model = _clip(0)
    wrapped = DistributedDataParallel(model)
    train, evaluation = clip_rows(TRAIN_ROWS, 1), clip_rows(EVAL_ROWS, 2)
    loader = DataLoader(train, batch_size=2, sampler=DistributedSampler(train, shuffle=False), collate_fn=collate)
    loop = ExactLoop()
    (step,) = loop.steps(loader, accumulation_steps=2)
    for index, batch in enumerate(step):
        context = wrapped.no_sync() if index == 0 else contextlib.nullcontext()
        with context:
            step.loss(wrapped, batch).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    logged = step.logged_loss()
    sampler = DistributedSampler(evaluation, shuffle=False)
    eval_loss = loop.evaluate(wrapped, DataLoader(evaluation, batch_size=2, sampler=sampler, collate_fn=collate))
    torch.save({"loss": logged, "grads": grads, "eval_loss": eval_loss}, f"{out_dir}/rank{dist.get_rank()}.pt")


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_exact_loop_on_two_ddp_ranks_equals_one_process(tmp_path):
    spawn_cpu_ranks(_loop_worker, args=(str(tmp_path),), num_processes=2, timeout=240)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    model = _clip(0)
    loss = model(**collate(clip_rows(TRAIN_ROWS, 1))).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    evaluation = clip_rows(EVAL_ROWS, 2)
    with torch.no_grad():  # global evaluation batches of 2 x 2 rows: rows 0-3, then 4-6 (the repeat dropped)
        own = [model(**collate(evaluation[i : i + 4])).loss.item() for i in (0, 4)]
    for rank in ranks:
        assert rank["loss"] == pytest.approx(loss.item(), rel=TOL)
        assert max_relative_diff(rank["grads"], grads) < TOL
        assert rank["eval_loss"] == pytest.approx(sum(own) / 2, rel=TOL)
