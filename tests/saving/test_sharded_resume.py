"""
Models sharded at load time (`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`) checkpointed
whole (`hf_parallel.saving.sharded`): their optimizer state is written (stock refuses to) and every resume ends where
the uninterrupted run ends: on the same layout, after a SIGKILL inside a save, on another layout (tensor parallelism),
in one plain process, and from a plain process's checkpoint onto the sharded layout.

Each run trains a tiny Llama token classifier for 6 SGD steps with momentum 0.9 (a lost optimizer state shows) of a
global batch of 8 (2 ranks x 4 rows, or 4 rows x GA 2 where the ranks share a batch or there is one process), a
checkpoint every 2 steps, on CPU ranks (gloo; `cpu_as_accelerator`, under which accelerate takes the parallelism
config the Trainer builds, as on GPUs).

Controls, stock `transformers.Trainer`: it refuses to checkpoint the optimizer state at all; its model-only checkpoint
cannot be resumed on the same ranks (`mixed torch.Tensor and DTensor`); resumed in one process it silently starts
the optimizer afresh and ends far from the uninterrupted run.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
import transformers

from hf_parallel.testing import spawn_cpu_ranks
from tests.distributed.crash_worker import CrashingStockTrainer, CrashingTrainer
from tests.helpers.harness import SGD_STEP, record_hf_parallel_log, training_args
from tests.helpers.resumes import error_of, largest_difference, save_on_main
from tests.helpers.tiny import ListDataset

pytestmark = [pytest.mark.slow, pytest.mark.full]  # five spawns of CPU ranks, ~2 minutes: .ci/run's own step

ROWS = 16
FSDP2 = {"fsdp_size": 2}
TP2 = {"tp_size": 2}
DEADLINE_S = 300
TOLERANCE = 1e-5


def _rows() -> list[dict]:
    from tests.test_tensor_parallel import rows

    return rows("tokens", ROWS, 1)


def _train(root: str, out: str, layout: dict | None, stock: bool = False, **options) -> dict:
    """One run from the saved initial model (`root/initial`), sharded by `layout` (None: one plain process); its
    whole parameters (every rank must call this)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # each Trainer builds its own accelerator; the process group stays
    resume, kill_in_save = options.pop("resume", None), options.pop("kill_in_save", None)
    loading = {} if layout is None else {"distributed_config": transformers.DistributedConfig(**layout)}
    model = transformers.LlamaForTokenClassification.from_pretrained(f"{root}/initial", **loading)
    arguments = {**SGD_STEP, "max_steps": 6, "save_strategy": "steps", "save_steps": 2, "learning_rate": 0.1}
    arguments.update(optim_args="momentum=0.9", use_cpu=False, per_device_train_batch_size=4, **options)
    trainer_cls, args_cls = (
        (CrashingStockTrainer, transformers.TrainingArguments) if stock else (CrashingTrainer, None)
    )
    args = training_args(out, **({"args_cls": args_cls} if args_cls else {}), **arguments)
    trainer = trainer_cls(model=model, args=args, train_dataset=ListDataset(_rows()))
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    trainer.kill_in_save = kill_in_save
    trainer.train(resume_from_checkpoint=resume)
    full = {n: getattr(p, "full_tensor", p.detach)() for n, p in trainer.model.named_parameters()}
    return {n: p.detach().cpu().clone() for n, p in full.items()}


def _copy_checkpoint(root: str, source: str, run: str) -> str:
    """`source`'s checkpoint-2 copied into a fresh run folder `run` (by rank 0); its path."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.copytree(f"{root}/{source}/checkpoint-2", f"{root}/{run}/checkpoint-2")
    if dist.is_initialized():
        dist.barrier()
    return f"{root}/{run}/checkpoint-2"


def _on_two_ranks(root: str) -> None:
    """The uninterrupted run, stock's two refusals, and resumes of its checkpoint-2 on fsdp=2 and on tp=2."""
    torch.set_num_threads(1)
    results = {"uninterrupted": _train(root, f"{root}/fsdp", FSDP2, save_total_limit=None)}
    results["stock with optimizer state"] = error_of(_train, root, f"{root}/stock refused", FSDP2, stock=True)
    _train(root, f"{root}/stock", FSDP2, stock=True, save_only_model=True, save_total_limit=None)  # model-only
    checkpoint = _copy_checkpoint(root, "stock", "stock same layout")
    results["stock model only"] = error_of(
        _train, root, f"{root}/stock same layout", FSDP2, stock=True, save_only_model=True, resume=checkpoint
    )
    with record_hf_parallel_log() as log:
        results["fsdp"] = _train(
            root, f"{root}/same layout", FSDP2, resume=_copy_checkpoint(root, "fsdp", "same layout")
        )
    results["fsdp log"] = log.text
    checkpoint = _copy_checkpoint(root, "fsdp", "tp")
    results["tp"] = _train(root, f"{root}/tp", TP2, gradient_accumulation_steps=2, resume=checkpoint)
    save_on_main(results, f"{root}/two ranks.pt")


def _killed(root: str) -> None:
    """On 2 ranks: killed (SIGKILL, every rank) while writing checkpoint-4, before its RNG and trainer state."""
    torch.set_num_threads(1)
    _train(root, f"{root}/killed", FSDP2, kill_in_save=4)


def _in_one_process(root: str) -> None:
    """The 2-rank checkpoint-2 resumed by one plain process (4 rows x GA 2), stock's too; a plain checkpoint made."""
    results = {}
    checkpoint = _copy_checkpoint(root, "fsdp", "one process")
    results["one process"] = _train(
        root, f"{root}/one process", None, gradient_accumulation_steps=2, resume=checkpoint
    )
    checkpoint = _copy_checkpoint(root, "stock", "stock one process")
    results["stock one process"] = _train(
        root, f"{root}/stock one process", None, stock=True, gradient_accumulation_steps=2, resume=checkpoint
    )
    _train(root, f"{root}/plain", None, gradient_accumulation_steps=2, max_steps=2)
    save_on_main(results, f"{root}/one process.pt")


def _after(root: str) -> None:
    """On 2 ranks: the killed run resumed, and the plain process's checkpoint-2 resumed on fsdp=2."""
    torch.set_num_threads(1)
    results = {}
    with record_hf_parallel_log() as log:
        results["killed"] = _train(root, f"{root}/killed", FSDP2, resume=True)
    results["killed log"] = log.text
    results["1 to 2"] = _train(root, f"{root}/plain", FSDP2, resume=f"{root}/plain/checkpoint-2")
    save_on_main(results, f"{root}/after.pt")


def run_all(root: str) -> dict:
    """Every run of this module under `root` (also `benchmarks.resume`'s): the results by name."""
    from tests.test_tensor_parallel import build

    build("tokens").save_pretrained(f"{root}/initial")
    spawn_cpu_ranks(_on_two_ranks, (root,), 2, timeout=DEADLINE_S, cpu_as_accelerator=True)
    try:
        spawn_cpu_ranks(_killed, (root,), 2, timeout=DEADLINE_S, cpu_as_accelerator=True)
        killed = "not killed"
    except Exception as error:  # the SIGKILL
        killed = str(error)
    left = sorted(os.listdir(f"{root}/killed"))
    spawn_cpu_ranks(_in_one_process, (root,), 1, timeout=DEADLINE_S, cpu_as_accelerator=True)
    spawn_cpu_ranks(_after, (root,), 2, timeout=DEADLINE_S, cpu_as_accelerator=True)
    results = {"kill": killed, "left": left, "root": root}
    for name in ("two ranks", "one process", "after"):
        results.update(torch.load(f"{root}/{name}.pt", weights_only=False))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return run_all(str(tmp_path_factory.mktemp("sharded_resume")))


def test_the_optimizer_state_is_checkpointed(runs):
    folder = os.path.join(runs["root"], "fsdp", "checkpoint-2")
    assert {"model.safetensors", "optimizer_sharded", "scheduler.pt", "trainer_state.json"} <= set(os.listdir(folder))
    stock = runs["stock with optimizer state"]
    assert "Resuming is not supported for models sharded at load time" in stock, stock


@pytest.mark.parametrize("name", ["fsdp", "tp", "one process", "1 to 2"])
def test_a_resume_on_any_layout_ends_where_the_uninterrupted_run_ends(runs, name):
    assert largest_difference(runs[name], runs["uninterrupted"]) < TOLERANCE


def test_stock_cannot_resume_a_sharded_model(runs):
    assert "mixed torch.Tensor and DTensor" in runs["stock model only"], runs["stock model only"]
    # In one process it resumes the weights and silently starts the optimizer afresh: momentum lost.
    assert largest_difference(runs["stock one process"], runs["uninterrupted"]) > 100 * TOLERANCE


def test_a_kill_mid_save_resumes_from_the_last_complete_checkpoint(runs):
    assert "SIGKILL" in runs["kill"], runs["kill"]
    assert [name for name in runs["left"] if name.startswith("checkpoint")] == ["checkpoint-2"]
    assert "resuming from" in runs["killed log"] and "checkpoint-2" in runs["killed log"]
    assert largest_difference(runs["killed"], runs["uninterrupted"]) < TOLERANCE
