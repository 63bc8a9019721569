"""
`ExactLoop` over a DeepSpeed engine of the user's own `deepspeed.initialize` (no accelerate), on 2 CPU ranks (gloo),
ZeRO 1, 2 and 3, gradient accumulation inside DeepSpeed's config: against one process on each step's rows in one
forward (the model's own loss, SGD by hand), the logged loss and the parameters after every step and the evaluation
loss. The epoch of 10 rows runs in steps of 8 (2 ranks x 2 rows x GA 2); its last step holds the 2 leftover rows in
one micro-batch, where the engine's own counter would not step: the loop marks the boundary. With
`engine.backward(loss)`, and with a plain `loss.backward()` (which DeepSpeed scales through hooks on the forward's
outputs, under ZeRO 1 and 2 twice). Control: the canonical DeepSpeed loop, `engine.backward(engine(**batch).loss)`.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from hf_parallel import ExactLoop
from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.compare import assert_losses_close
from tests.helpers.heads import llama, lm_rows
from tests.helpers.reference import sgd_reference, steps_of

deepspeed = pytest.importorskip("deepspeed", reason='deepspeed is not installed: pip install -e ".[deepspeed]"')

# `full`: kept out of the default suite's 10 minutes (a spawn of 2 ranks running DeepSpeed, ~40 s); .ci/run runs it in
# its own step, in the environment that has deepspeed.
pytestmark = [pytest.mark.slow, pytest.mark.full]

TRAIN_ROWS, STEP_ROWS, PER_DEVICE, ACCUMULATION = 10, 8, 2, 2
EVAL_ROWS = 7  # 2 ranks x 2 rows: the sampler repeats a row to fill the last batch
LR = 1.0
TOLERANCE = 1e-5
STAGES = (1, 2, 3)
LOOPS = ("engine.backward", "loss.backward", "stock", "stock loss.backward")


def train_rows() -> list[dict]:
    """The causal LM rows reordered so that each rank's micro-batches hold very uneven target counts."""
    rows = lm_rows(TRAIN_ROWS, 1)
    return [rows[i] for i in (2, 3, 0, 1, 4, 5, 6, 9, 7, 8)]


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole: gathered from its ZeRO-3 partitions first (every rank must call this)."""
    params = list(model.parameters())
    partitioned = any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params) if partitioned else contextlib.nullcontext():
        return torch.cat([p.detach().flatten() for p in params]).clone()


@functools.cache
def reference() -> dict:
    """One process, no DeepSpeed: each step's rows in one forward, SGD by hand."""
    return sgd_reference(llama(0), steps_of(train_rows(), STEP_ROWS), LR, lm_rows(EVAL_ROWS, 2))


def _engine(stage: int):
    config = {
        "train_micro_batch_size_per_gpu": PER_DEVICE,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    model = llama(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def run_loop(stage: int, loop: str) -> dict:
    """One epoch of the hand-written DeepSpeed loop (`loop` names the backward, or the stock loop), then evaluation."""
    engine = _engine(stage)
    rows = train_rows()
    train = DataLoader(rows, batch_size=PER_DEVICE, sampler=DistributedSampler(rows, shuffle=False))
    evaluation_rows = lm_rows(EVAL_ROWS, 2)
    evaluation = DataLoader(evaluation_rows, batch_size=2, sampler=DistributedSampler(evaluation_rows, shuffle=False))
    exact = ExactLoop(engine=engine)
    losses, params = [], []
    if loop.startswith("stock"):
        micro = []
        for index, batch in enumerate(train):
            loss = engine(**batch).loss
            if loop == "stock":
                engine.backward(loss)
            else:
                loss.backward()
            engine.step()
            micro.append(loss.detach())
            if (index + 1) % ACCUMULATION == 0 or index == len(train) - 1:
                logged = torch.stack(micro).mean()
                dist.all_reduce(logged)
                losses.append(logged.item() / dist.get_world_size())
                params.append(_flat(engine.module))
                micro = []
        return {"losses": losses, "params": params, "eval_loss": None, "steps": engine.global_steps}
    for step in exact.steps(train):
        for batch in step:
            loss = step.loss(engine, batch)
            if loop == "engine.backward":
                engine.backward(loss)
            else:
                loss.backward()
            engine.step()
        losses.append(step.logged_loss())
        params.append(_flat(engine.module))
    eval_loss = exact.evaluate(engine, evaluation)
    return {"losses": losses, "params": params, "eval_loss": eval_loss, "steps": engine.global_steps}


def _worker(out_path: str) -> None:
    results = {(stage, loop): run_loop(stage, loop) for stage in STAGES for loop in LOOPS}
    if dist.get_rank() == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def loop_results(tmp_path_factory) -> dict:
    out_path = str(tmp_path_factory.mktemp("deepspeed_loop") / "results.pt")
    spawn_cpu_ranks(_worker, (out_path,), 2, timeout=300)
    return torch.load(out_path, weights_only=False)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"ZeRO-{stage}")
def test_exact_loop_over_a_deepspeed_engine(loop_results, stage):
    result, expected = loop_results[(stage, "engine.backward")], reference()
    assert result["steps"] == 2  # the epoch's shorter last step stepped too
    assert_losses_close(result["losses"], expected["losses"], f"ZeRO-{stage}", rel=TOLERANCE)
    for step, (params, want) in enumerate(zip(result["params"], expected["params"], strict=True)):
        assert _relative(params, want) < TOLERANCE, f"parameters after step {step}"
    assert result["eval_loss"] == pytest.approx(expected["eval_loss"], rel=TOLERANCE)


@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"ZeRO-{stage}")
def test_a_plain_backward_updates_as_deepspeed_makes_it(loop_results, stage):
    """
    `loss.backward()` instead of `engine.backward(loss)`: DeepSpeed scales the gradient through hooks on the forward's
    outputs instead. Under ZeRO-3 that is the same update; under ZeRO 1 and 2 deepspeed 0.19.8 divides by the
    accumulation steps twice (its own canonical loop updates by half at GA 2). ExactLoop's update relates to the
    exact one as DeepSpeed's own plain-backward update relates to its engine.backward one, so it is exact wherever
    DeepSpeed's two backwards agree (ZeRO-3 here), and the docs say to call `engine.backward`.
    """
    exact, plain = loop_results[(stage, "engine.backward")], loop_results[(stage, "loss.backward")]
    stock, stock_plain = loop_results[(stage, "stock")], loop_results[(stage, "stock loss.backward")]
    init = _flat(llama(0))
    ours = _update_ratio(plain["params"][0] - init, exact["params"][0] - init)
    deepspeeds = _update_ratio(stock_plain["params"][0] - init, stock["params"][0] - init)
    assert ours == pytest.approx(deepspeeds, rel=1e-3)
    if stage == 3:
        assert ours == pytest.approx(1.0, rel=1e-4)
        assert _relative(plain["params"][1], reference()["params"][1]) < TOLERANCE


def _update_ratio(update: torch.Tensor, exact_update: torch.Tensor) -> float:
    """The median ratio of two updates over the parameters that moved."""
    moved = exact_update.abs() > 1e-4
    return (update[moved] / exact_update[moved]).median().item()


@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"ZeRO-{stage}")
def test_the_canonical_deepspeed_loop_differs(loop_results, stage):
    """Its loss averages the micro-batches' and ranks' own means, and its last step never steps (the engine waits
    for a second micro-batch that the epoch does not have)."""
    result, expected = loop_results[(stage, "stock")], reference()
    assert result["steps"] == 1
    assert abs(result["losses"][0] / expected["losses"][0] - 1) > 100 * TOLERANCE
    assert _relative(result["params"][0], expected["params"][0]) > 100 * TOLERANCE


def test_an_engine_comes_alone_and_must_be_one():
    with pytest.raises(TypeError, match="takes the engine deepspeed.initialize returns, not Linear"):
        ExactLoop(engine=torch.nn.Linear(2, 2))
