"""
`ExactLoop` (hf_parallel/loop.py) in hand-written training loops, against the model's own loss on one device.

The reference is independent of hf_parallel: one process, the model's own `outputs.loss` on all the real rows of an
optimizer step in one forward, and an SGD step by hand. Every run trains `EPOCHS` epochs of `TRAIN_ROWS` rows with a
global batch of `GLOBAL_BATCH` (6 and 12 in two cases; with 8, the second step of each epoch has 2 real rows, which
DDP samplers pad with repeats) and then evaluates on `EVAL_ROWS` rows (padded with repeats under DDP). Each run must
give the reference's logged loss at every step, its parameters after every optimizer step and its evaluation loss,
whatever the split: gradient accumulation, 2 DDP ranks (through accelerate, and through plain torch DDP with a
`DistributedSampler`), torch's own DataParallel on emulated devices, `BalancedDataParallel`. The canonical loop on
`outputs.loss` is the control that must differ. The slow test runs examples/custom_loop.py for real: one process,
`accelerate launch` and `torchrun` with 2 CPU processes each.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from hf_parallel import BalancedDataParallel, ExactLoop
from hf_parallel.testing import simulate_data_parallel, spawn_cpu_ranks
from tests.helpers.compare import assert_losses_close
from tests.helpers.heads import llama, lm_rows
from tests.helpers.paths import NO_GPUS, ROOT, repo_env
from tests.helpers.processes import run_together
from tests.helpers.reference import flat_params, sgd_reference, steps_of
from tests.helpers.tiny import TinyRegressor, classification_rows, tiny_bert_classifier

KINDS = ("cls", "lm")  # a tiny BERT sequence classifier; a tiny Llama causal LM with uneven valid tokens
MODEL_CLASS = {"cls": "BertForSequenceClassification", "lm": "LlamaForCausalLM"}
EPOCHS = 2
TRAIN_ROWS = 10
GLOBAL_BATCH = 8  # 10 rows: steps of 8 and 2 real rows per epoch
EVAL_ROWS = 7
EVAL_BATCH = 2  # 7 rows on 2 ranks: the last batch holds a repeat
LR = {"cls": 0.5, "lm": 1.0}  # plain SGD, large enough that a wrong gradient shows in the weights
TOLERANCE = 1e-5  # relative, on losses and on parameters (relative to the update)
VOCAB = 64
# Valid tokens per training row (the rest of the row is padding labelled -100): 1 gives no target after the shift.
LM_LENGTHS = (12, 2, 9, 1, 12, 3, 7, 2, 11, 4)

# name: (framework, per-device batch, gradient accumulation, stock loss); each exact one equals the reference with
# its global batch (per-device batch x accumulation x processes).
ONE_PROCESS = {
    "single 8": ("accelerate", 8, 1, False),
    "accelerate GA 2 x 4": ("accelerate", 4, 2, False),
    "torch GA 2 x 4": ("torch", 4, 2, False),
    # Steps of 6 rows: the epoch's last step has 2 micro-batches (3 + 1 rows), and the dataloader has ended when the
    # step pulls them, before the first runs (accelerate's own count would sync at the first).
    "accelerate GA 2 x 3": ("accelerate", 3, 2, False),
}
TWO_RANKS = {
    "accelerate 2 x 4": ("accelerate", 4, 1, False),
    "torch DDP 2 x 4": ("torch", 4, 1, False),
    "torch DDP 2 x GA 2 x 2": ("torch", 2, 2, False),
    # One step of 12 rows per epoch: 10 real and 2 repeats, in the second micro-batch of rank 1, pulled with the end.
    "accelerate 2 x GA 2 x 3": ("accelerate", 3, 2, False),
    "stock accelerate 2 x 4": ("accelerate", 4, 1, True),
}
STOCK_ONE_PROCESS = ("accelerate", 4, 2, True)


# ---- Models and rows ----


def build(kind: str) -> nn.Module:
    if kind == "cls":
        return tiny_bert_classifier(seed=0)
    return llama(0, vocab_size=VOCAB)  # the matrix's tiny Llama (tests/helpers/heads.py), with this file's vocabulary


def train_rows(kind: str) -> list[dict]:
    if kind == "cls":
        return list(classification_rows(TRAIN_ROWS, seed=1).rows)
    return lm_rows(len(LM_LENGTHS), 1, lengths=LM_LENGTHS, vocab=VOCAB)


def eval_rows(kind: str) -> list[dict]:
    if kind == "cls":
        return list(classification_rows(EVAL_ROWS, seed=2).rows)
    return lm_rows(7, 2, lengths=(5, 12, 1, 3, 10, 2, 8), vocab=VOCAB)


@functools.cache
def reference(kind: str, global_batch: int = GLOBAL_BATCH) -> dict:
    """
    One process, no hf_parallel: each step's real rows (`global_batch` rows, the epoch's last step fewer) in one
    forward, SGD by hand.
    """
    steps = steps_of(train_rows(kind), global_batch, EPOCHS)
    return sgd_reference(build(kind), steps, LR[kind], eval_rows(kind))


# ---- The loops under test ----


def run_loop(kind: str, framework: str, per_device: int, accumulation: int, stock: bool = False, wrap=None) -> dict:
    """
    Train `kind` for `EPOCHS` epochs with a hand-written loop, then evaluate: with accelerate (`framework ==
    "accelerate"`: `accelerator.accumulate`, `accelerator.backward`) or plain torch (DDP with a `DistributedSampler`
    when a process group is up, `no_sync` on all but a step's last micro-batch; `wrap` wraps the model otherwise).
    `stock` trains on `outputs.loss` instead of `step.loss`. Returns the logged losses and the parameters after every
    optimizer step, the evaluation loss and what the loop ran on.
    """
    model = build(kind)
    init = flat_params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR[kind])
    if framework == "accelerate":
        result = _accelerate_loop(kind, model, optimizer, per_device, accumulation, stock)
    else:
        result = _torch_loop(kind, model, optimizer, per_device, accumulation, wrap)
    return {"init": init, **result}


def _accelerate_loop(kind, model, optimizer, per_device, accumulation, stock) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    train = DataLoader(train_rows(kind), batch_size=per_device)
    evaluation = DataLoader(eval_rows(kind), batch_size=EVAL_BATCH)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    exact = ExactLoop(accelerator)
    losses, params = [], []
    for _ in range(EPOCHS):
        if stock:  # accelerate's canonical loop
            micro = []
            for batch in train:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                micro.append(accelerator.reduce(loss.detach(), reduction="mean"))
                if accelerator.sync_gradients:
                    losses.append(torch.stack(micro).mean().item())
                    params.append(flat_params(accelerator.unwrap_model(model)))
                    micro = []
            continue
        for step in exact.steps(train):
            for batch in step:
                with accelerator.accumulate(model):
                    accelerator.backward(step.loss(model, batch))
                    optimizer.step()
                    optimizer.zero_grad()
            losses.append(step.logged_loss())
            params.append(flat_params(accelerator.unwrap_model(model)))
    eval_loss = None if stock else exact.evaluate(model, evaluation)
    topology = {"world_size": accelerator.num_processes, "wrapper": type(model).__name__}
    return {"losses": losses, "params": params, "eval_loss": eval_loss, **topology}


def _torch_loop(kind, model, optimizer, per_device, accumulation, wrap) -> dict:
    distributed = dist.is_initialized()
    wrapped = DistributedDataParallel(model) if distributed else (wrap(model) if wrap is not None else model)
    rows, evaluation_rows = train_rows(kind), eval_rows(kind)
    sampler = DistributedSampler(rows, shuffle=False) if distributed else None
    eval_sampler = DistributedSampler(evaluation_rows, shuffle=False) if distributed else None
    train = DataLoader(rows, batch_size=per_device, sampler=sampler)
    evaluation = DataLoader(evaluation_rows, batch_size=EVAL_BATCH, sampler=eval_sampler)
    exact = ExactLoop()
    losses, params = [], []
    for epoch in range(EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for step in exact.steps(train, accumulation_steps=accumulation):
            for index, batch in enumerate(step):
                last = index == len(step) - 1
                with wrapped.no_sync() if distributed and not last else contextlib.nullcontext():
                    step.loss(wrapped, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(step.logged_loss())
            params.append(flat_params(model))
    world_size = dist.get_world_size() if distributed else 1
    return {
        "losses": losses,
        "params": params,
        "eval_loss": exact.evaluate(wrapped, evaluation),
        "world_size": world_size,
        "wrapper": type(wrapped).__name__,
    }


def _update_error(params: torch.Tensor, ref: dict, step: int) -> float:
    """How far `params` are from the reference's after `step`, relative to the reference's update so far."""
    return float((params - ref["params"][step]).norm() / (ref["params"][step] - ref["init"]).norm())


def assert_equals_reference(result: dict, ref: dict, name: str) -> None:
    assert len(result["losses"]) == len(ref["losses"]), name
    assert_losses_close(result["losses"], ref["losses"], name, rel=TOLERANCE)
    for step in range(len(ref["losses"])):
        error = _update_error(result["params"][step], ref, step)
        assert error <= TOLERANCE, f"{name}: parameters after step {step} off by {error:.2e} of the update"
    assert result["eval_loss"] == pytest.approx(ref["eval_loss"], rel=TOLERANCE), f"{name}: eval loss"


@contextlib.contextmanager
def isolated_accelerate():
    """accelerate keeps its state in process-wide singletons, and sets launcher variables: reset both after."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
        GradientState._reset_state()


# ---- One process: gradient accumulation, accelerate and plain torch ----


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_accumulation_equals_one_device(kind):
    for name, (framework, per_device, accumulation, stock) in ONE_PROCESS.items():
        with isolated_accelerate():
            result = run_loop(kind, framework, per_device, accumulation, stock)
        assert result["world_size"] == 1 and result["wrapper"] == MODEL_CLASS[kind], name
        assert_equals_reference(result, reference(kind, per_device * accumulation), f"{kind} {name}")


# ---- Two DDP ranks: accelerate (even_batches) and plain torch DDP (DistributedSampler), one spawn for all ----


def _ddp_worker(out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    results = {}
    for kind in KINDS:
        for name, (framework, per_device, accumulation, stock) in TWO_RANKS.items():
            results[kind, name] = run_loop(kind, framework, per_device, accumulation, stock)
            dist.barrier()
    torch.save(results, Path(out_dir) / f"rank{dist.get_rank()}.pt")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> list[dict]:
    """Every `TWO_RANKS` run of both models on 2 spawned CPU ranks: each rank's results."""
    out_dir = tmp_path_factory.mktemp("two_ranks")
    spawn_cpu_ranks(_ddp_worker, args=(str(out_dir),), num_processes=2, timeout=240)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


def _assert_two_ranks(runs: list[dict], key: tuple[str, str]) -> dict:
    """The topology (2 ranks, the model in DDP) first; then that both ranks logged and hold the same."""
    zero, one = runs[0][key], runs[1][key]
    for rank, result in enumerate((zero, one)):
        assert result["world_size"] == 2, (key, rank)
        assert result["wrapper"] == "DistributedDataParallel", (key, rank)
    assert zero["losses"] == pytest.approx(one["losses"], rel=1e-7), f"{key}: the ranks logged different losses"
    if zero["eval_loss"] is not None:
        assert zero["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-7), key
    return zero


def _assert_ranks_hold_the_same(runs: list[dict], key: tuple[str, str]) -> None:
    for step, (zero, one) in enumerate(zip(runs[0][key]["params"], runs[1][key]["params"], strict=True)):
        assert torch.equal(zero, one), f"{key}: the ranks' parameters differ after step {step}"


@pytest.mark.full  # a 2-rank spawn (~8-11 s): .ci/run runs the full step
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [name for name, run in TWO_RANKS.items() if not run[3]])
def test_two_ddp_ranks_equal_one_device(kind, name, two_rank_runs):
    _, per_device, accumulation, _ = TWO_RANKS[name]
    result = _assert_two_ranks(two_rank_runs, (kind, name))
    assert_equals_reference(result, reference(kind, 2 * per_device * accumulation), f"{kind} {name}")
    _assert_ranks_hold_the_same(two_rank_runs, (kind, name))


# ---- The control: the canonical loop on outputs.loss ----


def _relative_update_difference(params: torch.Tensor, ref: dict) -> float:
    return float((params - ref["params"][-1]).norm() / (ref["params"][-1] - ref["init"]).norm())


@pytest.mark.full  # a 2-rank spawn (~8-11 s): .ci/run runs the full step
@pytest.mark.parametrize("kind", KINDS)
def test_stock_loop_differs(kind, two_rank_runs):
    ref = reference(kind)
    with isolated_accelerate():
        accumulated = run_loop(kind, *STOCK_ONE_PROCESS)
    assert accumulated["world_size"] == 1
    ddp = _assert_two_ranks(two_rank_runs, (kind, "stock accelerate 2 x 4"))
    errors = {}
    for name, result in (("GA 2 x 4", accumulated), ("2 DDP ranks x 4", ddp)):
        errors[name] = _relative_update_difference(result["params"][-1], ref)
        losses = [abs(loss / expected - 1) for loss, expected in zip(result["losses"], ref["losses"], strict=True)]
        print(f"stock {kind} {name}: update off by {errors[name]:.3f}, logged losses by up to {max(losses):.4f}")
        assert errors[name] > 0.05, f"stock {kind} {name}: update off by only {errors[name]:.3f}"
        if kind == "lm":  # uneven valid tokens: the mean of per-micro-batch (per-rank) means is not the step's loss
            assert max(losses) > 1e-3, f"stock {kind} {name} logged the exact losses"
    _assert_ranks_hold_the_same(two_rank_runs, (kind, "stock accelerate 2 x 4"))


# ---- DataParallel: torch's own, on emulated devices ----


def _balanced(model: nn.Module) -> BalancedDataParallel:
    return BalancedDataParallel(model, gpu0_bsz=1)


DATA_PARALLEL = {
    # name: (wrapper, per-device batch, accumulation, a split it must have made)
    "nn.DataParallel 8 rows on 3": (nn.DataParallel, 8, 1, [3, 3, 2]),
    "BalancedDataParallel gpu0_bsz=1, GA 2 x 4": (
        lambda model: BalancedDataParallel(model, gpu0_bsz=1),
        4,
        2,
        [1, 2, 1],
    ),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(DATA_PARALLEL))
def test_data_parallel_equals_one_device(kind, name):
    wrap, per_device, accumulation, split = DATA_PARALLEL[name]
    with simulate_data_parallel(3) as emulation:
        result = run_loop(kind, "torch", per_device, accumulation, wrap=wrap)
    assert result["wrapper"] == ("DataParallel" if wrap is nn.DataParallel else "BalancedDataParallel")
    assert split in emulation.chunk_sizes, emulation.chunk_sizes[:4]
    assert len(set(emulation.replica_devices)) == 3
    assert_equals_reference(result, reference(kind), f"{kind} {name}")


# ---- Bad use ----


def _lm_step(accumulation: int = 2):
    loader = DataLoader(train_rows("lm")[:8], batch_size=4)
    return next(iter(ExactLoop().steps(loader, accumulation_steps=accumulation)))


def test_a_batch_not_of_the_step_is_refused_naming_the_fix():
    model, step = build("lm"), _lm_step()
    batch = next(iter(step))
    moved = {key: value.clone() for key, value in batch.items()}  # what batch.to(device) gives: other tensors
    with pytest.raises(ValueError, match=r"not one of this step's micro-batches.*pass device= to ExactLoop.steps"):
        step.loss(model, moved)


def test_a_micro_batch_loss_computed_twice_is_refused():
    model, step = build("lm"), _lm_step()
    batch = next(iter(step))
    step.loss(model, batch)
    with pytest.raises(ValueError, match="the loss of micro-batch 0 of this step was computed already"):
        step.loss(model, batch)


def test_logged_loss_before_every_micro_batch_is_refused():
    model, step = build("lm"), _lm_step()
    step.loss(model, next(iter(step)))
    with pytest.raises(ValueError, match=r"micro-batches \[1\] of this step have no loss yet"):
        step.logged_loss()


def test_accumulation_steps_out_of_range_is_refused_at_the_call():
    loader = DataLoader(train_rows("lm"), batch_size=4)
    with pytest.raises(ValueError, match="accumulation_steps must be a whole number >= 1, got 0"):
        ExactLoop().steps(loader, accumulation_steps=0)  # not at the first step: steps() is lazy otherwise


def test_accumulation_steps_other_than_the_accelerators_is_refused():
    from accelerate import Accelerator

    with isolated_accelerate():
        exact = ExactLoop(Accelerator(cpu=True, gradient_accumulation_steps=1))
        loader = DataLoader(train_rows("lm"), batch_size=4)
        # accumulate() would step the optimizer after every micro-batch of a 2-batch step.
        with pytest.raises(ValueError, match="accumulation_steps=2 differs from the accelerator's gradient_accum"):
            exact.steps(loader, accumulation_steps=2)


# ---- Models hf_parallel cannot make exact: one warning, the stock loss ----


def _regression_rows() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(4, generator=g), "labels": torch.randn(3, generator=g)} for _ in range(8)]


FALLBACKS = {
    # name: (model, rows, the warning's reason, wrapped in nn.DataParallel on 2 emulated devices)
    "dict-returning nn.Module": (TinyRegressor, _regression_rows, "TinyRegressor has no `config`", False),
    "dict-returning nn.Module in DataParallel": (TinyRegressor, _regression_rows, "has no `config`", True),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_a_model_that_cannot_be_exact_warns_once_and_trains_on_its_own_loss(name, hf_parallel_log):
    make, rows, reason, data_parallel = FALLBACKS[name]
    torch.manual_seed(0)
    model = make()
    loader = DataLoader(rows(), batch_size=4)
    exact = ExactLoop()
    with simulate_data_parallel(2) if data_parallel else contextlib.nullcontext():
        wrapped = nn.DataParallel(model) if data_parallel else model
        for step in exact.steps(loader, accumulation_steps=2):
            means = []
            for batch in step:
                loss = step.loss(wrapped, batch)
                own = model(**batch)["loss"]  # the model's own mean on the micro-batch, in one piece
                means.append(own.item())
                # Stock: each micro-batch's mean over the micro-batches (DataParallel: the mean of the replicas'
                # means, here [2, 2] rows of a mean over every element: the micro-batch's mean).
                assert loss.item() == pytest.approx(own.item() / 2, rel=1e-5), name
                loss.backward()
            assert step.logged_loss() == pytest.approx(sum(means) / 2, rel=1e-5), name
        eval_loss = exact.evaluate(wrapped, loader)
    assert eval_loss == pytest.approx(sum(means) / 2, rel=1e-5), name
    warnings = [record.getMessage() for record in hf_parallel_log.records]
    assert len(warnings) == 1, warnings
    assert reason in warnings[0]


# ---- A fused loss that never builds the logits (Liger's fused linear cross-entropy, stood in on the CPU) ----


def test_fused_loss_is_exact_without_logits():
    fused = pytest.importorskip(
        "tests.helpers.fused", reason="tests/helpers/fused.py (the fused-loss stand-in) is not there"
    )
    ref = reference("lm")
    model = build("lm")
    record = fused.fuse_loss(model, chunk_size=7)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR["lm"])
    exact = ExactLoop()
    losses, params = [], []
    for _ in range(EPOCHS):
        for step in exact.steps(DataLoader(train_rows("lm"), batch_size=4), accumulation_steps=2):
            for batch in step:
                step.loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(step.logged_loss())
            params.append(flat_params(model))
    assert record.logits_calls == 0, record.calls  # training never built the [rows, positions, vocab] logits
    # Micro-batches of 4, 4 and 2 rows per epoch, and the check's two forwards before the first step (given N and 2N:
    # a fused loss has no logits to compare).
    assert record.fused_calls == 3 * EPOCHS + 2
    result = {"losses": losses, "params": params}
    result["eval_loss"] = exact.evaluate(model, DataLoader(eval_rows("lm"), batch_size=EVAL_BATCH))
    assert_equals_reference(result, ref, "fused GA 2 x 4")


def test_evaluating_a_moe_model_gives_the_whole_set_s_loss_with_its_router_term():
    """A MoE model's evaluation: cross-entropy and router term over the whole set, as its own loss on all the rows at
    once (the loop's row adder took no router statistics: `ValueError: not enough values to unpack`)."""
    from tests.helpers.moe import CASES

    case = CASES["mixtral_moe"]
    model, rows = case.build(0), case.rows(6, 1)
    whole = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    with torch.no_grad():
        expected = model.eval()(**whole).loss.item()
        per_batch = [model(**batch).loss.item() for batch in DataLoader(rows, batch_size=4)]
    model.train()
    got = ExactLoop().evaluate(model, DataLoader(rows, batch_size=4))
    assert got == pytest.approx(expected, rel=1e-5)
    assert model.training  # put back in the mode it was in
    stock = sum(per_batch) / len(per_batch)  # a mean of the batches' means: the control, off
    assert stock != pytest.approx(expected, rel=1e-3)


# ---- examples/custom_loop.py, run for real ----

EXAMPLE = ROOT / "examples" / "custom_loop.py"
CPU_CONFIG = ROOT / "hf_parallel" / "configs" / "cpu_ddp.yaml"
STEP_LINE = re.compile(r"^step (\d+): loss ([-\d.e]+)$", re.MULTILINE)
EVAL_LINE = re.compile(r"^eval loss ([-\d.e]+)$", re.MULTILINE)


def _printed(output: str) -> tuple[list[float], float]:
    losses = [float(value) for _, value in STEP_LINE.findall(output)]
    evals = EVAL_LINE.findall(output)
    assert losses and len(evals) == 1, output[-3000:]
    return losses, float(evals[0])


@pytest.mark.full  # 20 s: CI runs it in its own step (.ci/run), beside the default suite
def test_example_runs_exact_under_every_launcher(tmp_path):
    """One process (batch 8) == `accelerate launch` 2 x 4 == `torchrun` 2 x GA 2 x 2; `--stock` (GA 2 x 4) differs."""
    env = repo_env(OMP_NUM_THREADS="1", **NO_GPUS)
    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(variable, None)
    python = [sys.executable, str(EXAMPLE), "--use_cpu"]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    commands = {
        "one process": [*python, "--per_device_batch_size", "8"],
        "accelerate launch": [*accelerate, str(EXAMPLE), "--use_cpu", "--per_device_batch_size", "4"],
        "torchrun": [*torchrun, *python[1:], "--per_device_batch_size", "2", "--gradient_accumulation_steps", "2"],
        "stock GA 2 x 4": [*python, "--per_device_batch_size", "4", "--gradient_accumulation_steps", "2", "--stock"],
    }
    results, seconds = run_together(list(commands.values()), tmp_path, env)
    outputs = dict(zip(commands, (result.output for result in results), strict=True))
    print(f"4 runs of examples/custom_loop.py together: {seconds:.1f} s")
    for name, output in outputs.items():
        processes = 2 if name in ("accelerate launch", "torchrun") else 1
        assert f"processes: {processes}, global batch: 8" in output, f"{name}:\n{output[-3000:]}"
        assert output.count("eval loss") == 1, f"{name}: one process prints\n{output[-3000:]}"
    losses, eval_loss = _printed(outputs["one process"])
    for name in ("accelerate launch", "torchrun"):
        launched, launched_eval = _printed(outputs[name])
        assert launched == pytest.approx(losses, abs=1e-5), name
        assert launched_eval == pytest.approx(eval_loss, abs=1e-5), name
    stock, stock_eval = _printed(outputs["stock GA 2 x 4"])
    print(f"exact: {losses}, eval {eval_loss}\nstock: {stock}, eval {stock_eval}")
    assert len(stock) == len(losses)
    assert max(abs(a - b) for a, b in zip(stock, losses, strict=True)) > 1e-3
    assert abs(stock_eval - eval_loss) > 1e-3
