"""
FSDP2 (`fully_shard`) on 2 CPU ranks (gloo), against one process on the whole step: the logged loss of every step,
the parameters after every step and the evaluation loss, over an epoch of 10 rows in steps of 8 (2 ranks x 2 rows x
GA 2) whose last step holds the 2 leftover rows.

accelerate gives no FSDP on CPU: `AcceleratorState` sets `DistributedType.FSDP` only in its branch for device-backed
multi-process types (MULTI_GPU, MULTI_NPU, MULTI_XPU, ...), and `PartialState` makes a CPU run MULTI_CPU, for which
the FSDP plugin is dropped without a word (accelerate 1.16, `state.py`). So `fsdp=True` with `use_cpu` trains with DDP
(tests/test_fsdp_deepspeed.py checks that, and hf_parallel warns). Two real FSDP2 paths run here instead:

1. `ExactLoop` in a plain torch loop: the tiny Llama sharded by `fully_shard` per decoder layer and at the root, a
   `DistributedSampler`, gradient accumulation with the reduce-scatter deferred to the last micro-batch
   (`set_requires_gradient_sync`). Control: the canonical loop on `outputs.loss / GA`.
2. `hf_parallel.Trainer` on a model that transformers shards at load time
   (`from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))`, in 5.19 and later): the Trainer's own FSDP2
   path, which leaves the model out of accelerate's wrap and defers the reduce-scatter over GA itself. FSDP2 averages
   the gradient over ranks, which the exact loss undoes (S / C x 2) as under DDP. Control: stock
   `transformers.Trainer`, which trains the rows accelerate repeats to fill the epoch's last step.

accelerate's own FSDP2 path (`fsdp=True`: `fsdp2_prepare_model`, its `no_sync`) runs on GPUs only:
tests/test_fsdp_deepspeed.py, marked `multi_gpu`.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlamaForCausalLM

from hf_parallel import ExactLoop, Trainer, TrainingArguments
from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.compare import assert_losses_close
from tests.helpers.harness import SGD_STEP, Capture, record_hf_parallel_log, training_args
from tests.helpers.heads import llama, lm_rows
from tests.helpers.reference import sgd_reference, steps_of
from tests.helpers.tiny import ListDataset

TRAIN_ROWS = 10  # steps of 8 rows, then the 2 leftover rows
STEP_ROWS = 8  # 2 ranks x 2 rows x GA 2
PER_DEVICE, ACCUMULATION = 2, 2
EVAL_ROWS = 7  # 2 ranks: the last evaluation batch is padded with a repeat
LR = 1.0  # plain SGD, large enough that a wrong gradient shows in the weights
TOLERANCE = 1e-5  # relative, on losses and on parameters (relative to the update)
LAYERS = 2  # one FSDP2 unit per decoder layer, and the root's


def build() -> LlamaForCausalLM:
    return llama(0, num_hidden_layers=LAYERS)


def train_rows() -> list[dict]:
    """
    The matrix's causal LM rows (tests/helpers/heads.py) reordered: valid tokens 5, 2, 1, 1, 8, 3, 8, 2, 8, 3. Each
    rank's micro-batches hold very uneven numbers of targets; the leftover rows (8, 9) hold 7 and 2, and the rows
    accelerate repeats to fill the Trainer's last step (0, 1) hold 5.
    """
    rows = lm_rows(TRAIN_ROWS, 1)
    return [rows[i] for i in (2, 3, 0, 1, 4, 5, 6, 9, 7, 8)]


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole (an FSDP2 shard is gathered from every rank: all ranks must call this)."""
    tensors = [getattr(p, "full_tensor", p.detach)().detach().flatten() for p in model.parameters()]
    return torch.cat(tensors).clone()


@functools.cache
def reference() -> dict:
    """One process, no hf_parallel: each step's rows in one forward, SGD by hand."""
    return sgd_reference(build(), steps_of(train_rows(), STEP_ROWS), LR, lm_rows(EVAL_ROWS, 2))


# ---- 1. ExactLoop over a model sharded by fully_shard ----


def _sharded_llama() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run_loop(stock: bool) -> dict:
    """One epoch of the hand-written FSDP2 loop (`stock`: on `outputs.loss / GA`), then ExactLoop's evaluation."""
    model = _sharded_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = train_rows()
    train = DataLoader(rows, batch_size=PER_DEVICE, sampler=DistributedSampler(rows, shuffle=False))
    evaluation_rows = lm_rows(EVAL_ROWS, 2)
    evaluation = DataLoader(evaluation_rows, batch_size=2, sampler=DistributedSampler(evaluation_rows, shuffle=False))
    exact = ExactLoop()
    losses, params = [], []
    for step in exact.steps(train, accumulation_steps=ACCUMULATION):
        micro = []
        for index, batch in enumerate(step):
            # FSDP2's no_sync: reduce-scatter once, after the step's last micro-batch.
            model.set_requires_gradient_sync(index == len(step) - 1)
            loss = model(**batch).loss / len(step) if stock else step.loss(model, batch)
            loss.backward()
            micro.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        if stock:  # the canonical loop's logged loss: the mean over ranks of the micro-batches' mean
            logged = torch.stack(micro).sum()
            dist.all_reduce(logged)
            losses.append(logged.item() / dist.get_world_size())
        else:
            losses.append(step.logged_loss())
        params.append(_flat(model))
    eval_loss = None if stock else exact.evaluate(model, evaluation)
    return {"losses": losses, "params": params, "eval_loss": eval_loss, "wrapper": type(model).__name__}


# ---- 2. hf_parallel.Trainer on a model sharded at load time by transformers ----


def native_fsdp2_available() -> bool:
    """transformers shards a model at load time with FSDP2 (`DistributedConfig(fsdp_size=...)`; 5.19 has it)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return "fsdp_size" in getattr(DistributedConfig, "__dataclass_fields__", {})


def run_trainer(checkpoint: str, stock: bool) -> dict:
    """One epoch of the Trainer (hf_parallel's, or stock) on the checkpoint sharded at load, then `evaluate()`."""
    from transformers.distributed import DistributedConfig

    model = LlamaForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(fsdp_size=2))
    trainer_cls, args_cls = (
        (transformers.Trainer, transformers.TrainingArguments) if stock else (Trainer, TrainingArguments)
    )
    capture = Capture()
    with tempfile.TemporaryDirectory() as tmp:
        arguments = {
            **SGD_STEP,
            "max_steps": -1,
            "num_train_epochs": 1,
            "train_sampling_strategy": "sequential",
            "learning_rate": LR,
            "per_device_train_batch_size": PER_DEVICE,
            "gradient_accumulation_steps": ACCUMULATION,
        }
        trainer = trainer_cls(
            model=model,
            args=training_args(tmp, args_cls=args_cls, **arguments),
            train_dataset=ListDataset(train_rows()),
            eval_dataset=ListDataset(lm_rows(EVAL_ROWS, 2)),
            callbacks=[capture],
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()
        # Sharded after training (an evaluation leaves the root's parameters gathered until the next forward).
        sharded = [type(p.data).__name__ for p in trainer.model_wrapped.parameters()]
        params = _flat(trainer.model_wrapped)
        eval_loss = trainer.evaluate()["eval_loss"]
    return {
        "losses": capture.losses,
        "params": [params],
        "eval_loss": eval_loss,
        "wrapper": type(trainer.model_wrapped).__name__,
        "world_size": trainer.args.world_size,
        "parallel_mode": trainer.args.parallel_mode.value,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "sharded_at_load": trainer.is_distributed_loading_by_transformers,
        "dtensors": sharded.count("DTensor") == len(sharded),
    }


# ---- 3. fsdp=True with use_cpu: accelerate runs DDP, and hf_parallel says so ----


def sharding_warnings(checkpoint_dir: str) -> dict:
    """The warnings of a Trainer built with `fsdp=True` (FSDP2) and `use_cpu` on the CPU ranks, ours and stock."""
    warnings = {}
    for name, (trainer_cls, args_cls) in {
        "ours": (Trainer, TrainingArguments),
        "stock": (transformers.Trainer, transformers.TrainingArguments),
    }.items():
        with record_hf_parallel_log() as log:
            args = training_args(checkpoint_dir, args_cls=args_cls, fsdp=True, fsdp_config={"version": 2})
            trainer = trainer_cls(model=build(), args=args, train_dataset=ListDataset(train_rows()))
        warnings[name] = {
            "messages": log.messages,
            "distributed_type": trainer.accelerator.distributed_type.value,
            "fsdp": trainer.is_fsdp_enabled,
        }
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()
    return warnings


# ---- The spawn: every run on the same 2 ranks ----


def _worker(out_dir: str, checkpoint: str | None) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    downgrade = sharding_warnings(out_dir)
    results = {"loop": run_loop(stock=False), "stock loop": run_loop(stock=True)}
    if checkpoint is not None:
        for name, stock in (("trainer", False), ("stock trainer", True)):
            results[name] = run_trainer(checkpoint, stock)
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state()  # each Trainer builds its own accelerator; the process group stays
    # Ranks that trained apart would gather different whole parameters: compare them here.
    for result in results.values():
        flat = torch.cat(result["params"])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        result["rank_spread"] = max((g - flat).abs().max().item() for g in gathered)
    results["downgrade"] = downgrade
    torch.save(results, Path(out_dir) / f"rank{dist.get_rank()}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run on 2 spawned CPU ranks: rank 0's results."""
    out_dir = tmp_path_factory.mktemp("fsdp2")
    checkpoint = None
    if native_fsdp2_available():
        checkpoint = str(out_dir / "llama")
        build().save_pretrained(checkpoint)
    spawn_cpu_ranks(_worker, args=(str(out_dir), checkpoint), num_processes=2, timeout=240)
    return torch.load(out_dir / "rank0.pt", weights_only=False)


def _update_error(params: torch.Tensor, ref: dict, step: int) -> float:
    """How far `params` are from the reference's after `step`, relative to the reference's update so far."""
    return float((params - ref["params"][step]).norm() / (ref["params"][step] - ref["init"]).norm())


def assert_equals_reference(result: dict, ref: dict, name: str, steps: list[int]) -> None:
    """`result` logged the reference's loss at every step, held its parameters after `steps`, and evaluated alike."""
    assert result["rank_spread"] == 0.0, f"{name}: the ranks hold different parameters"
    assert len(result["losses"]) == len(ref["losses"]), name
    assert_losses_close(result["losses"], ref["losses"], name, rel=TOLERANCE)
    for params, step in zip(result["params"], steps, strict=True):
        error = _update_error(params, ref, step)
        assert error <= TOLERANCE, f"{name}: parameters after step {step} off by {error:.2e} of the update"
    assert result["eval_loss"] == pytest.approx(ref["eval_loss"], rel=TOLERANCE), f"{name}: eval loss"


def test_exact_loop_on_fully_shard_equals_one_device(runs):
    result = runs["loop"]
    assert result["wrapper"] == "FSDPLlamaForCausalLM", result["wrapper"]
    assert_equals_reference(result, reference(), "ExactLoop, FSDP2 2 x 2 x GA 2", steps=[0, 1])


def test_the_canonical_fsdp2_loop_differs(runs):
    ref, stock = reference(), runs["stock loop"]
    error = _update_error(stock["params"][-1], ref, len(ref["params"]) - 1)
    print(f"canonical FSDP2 loop: update off by {error:.3f}, logged losses {stock['losses']} vs {ref['losses']}")
    assert error > 0.05, f"the canonical loop's update is off by only {error:.3f}"
    # Uneven valid tokens: a mean of per-micro-batch, per-rank means is not the step's loss.
    assert max(abs(a / b - 1) for a, b in zip(stock["losses"], ref["losses"], strict=True)) > 1e-3


needs_native_fsdp2 = pytest.mark.skipif(
    not native_fsdp2_available(), reason=f"transformers {transformers.__version__} cannot shard a model at load time"
)


@needs_native_fsdp2
def test_trainer_on_a_model_sharded_at_load_equals_one_device(runs):
    result = runs["trainer"]
    # The topology: 2 ranks, the Trainer's FSDP2 path (accelerate stays MULTI_CPU and does not wrap the model).
    assert result["world_size"] == 2 and result["parallel_mode"] == "distributed", result
    assert result["distributed_type"] == "MULTI_CPU" and result["sharded_at_load"], result
    assert result["wrapper"] == "FSDPLlamaForCausalLM" and result["dtensors"], result
    assert_equals_reference(result, reference(), "hf_parallel.Trainer, FSDP2 2 x 2 x GA 2", steps=[1])


@needs_native_fsdp2
def test_stock_trainer_on_a_model_sharded_at_load_differs(runs):
    ref, stock = reference(), runs["stock trainer"]
    assert stock["wrapper"] == "FSDPLlamaForCausalLM" and stock["rank_spread"] == 0.0, stock
    error = _update_error(stock["params"][-1], ref, len(ref["params"]) - 1)
    print(f"stock Trainer, FSDP2: update off by {error:.3f}, logged losses {stock['losses']} vs {ref['losses']}")
    # The epoch's last step: stock trains the 2 leftover rows and the 2 rows accelerate repeats to fill it.
    assert abs(stock["losses"][-1] / ref["losses"][-1] - 1) > 1e-2
    assert error > 1e-3, f"stock's update is off by only {error:.2e}"


def test_fsdp_with_use_cpu_warns_that_ddp_runs(runs):
    ours, stock = runs["downgrade"]["ours"], runs["downgrade"]["stock"]
    for built in (ours, stock):  # what accelerate does with fsdp=True on the CPU: DDP, no FSDP plugin
        assert built["distributed_type"] == "MULTI_CPU" and not built["fsdp"], built
    downgrades = [message for message in ours["messages"] if "was asked for, but accelerate runs" in message]
    assert len(downgrades) == 1, ours["messages"]
    assert downgrades[0].startswith("fsdp (FSDP version 2) was asked for, but accelerate runs DDP over 2 CPU")
    assert "not on the CPU (use_cpu=True)" in downgrades[0]
    assert not stock["messages"], stock["messages"]  # stock says nothing
