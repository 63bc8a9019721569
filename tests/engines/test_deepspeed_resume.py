"""
DeepSpeed ZeRO runs that survive (`hf_parallel.engines.reshard`, `hf_parallel.saving`): a SIGKILL inside a checkpoint
save, a resume on another number of processes (2 ranks x 4 rows -> 1 process x 4 rows x GA 2, and 1 -> 2), and a
checkpoint of one engine resumed under the other (refused by name). Every run trains the crash worker's BERT
classifier (`tests/distributed/crash_worker.py`) for 6 SGD steps with momentum 0.9 (a lost optimizer state shows) of a
global batch of 8, a checkpoint every 2 steps, on CPU ranks (gloo; accelerate shown the CPU as its accelerator), and
ends where the uninterrupted run of the same ZeRO stage on 2 ranks ends.

Controls: stock `transformers.Trainer` resumes the torn checkpoint the kill left (`FileNotFoundError` on its
`trainer_state.json`) and refuses the other world size (DeepSpeed's `ZeRORuntimeException`).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.harness import record_hf_parallel_log
from tests.helpers.resumes import error_of, largest_difference, save_on_main

pytest.importorskip("deepspeed", reason='deepspeed is not installed: pip install -e ".[deepspeed]"')

# `full`: six spawns of DeepSpeed ranks (~2 minutes); .ci/run runs it in its own step.
pytestmark = [pytest.mark.slow, pytest.mark.full]

STAGES = (1, 2, 3)
KILLED_STAGES = (2, 3)
DEADLINE_S = 300
TOLERANCE = 1e-6


def _train(out: str, stage: int, stock: bool = False, per_device: int = 4, accumulation: int = 1, **options):
    """One run of the crash worker's trainer under ZeRO `stage`; its whole parameters (every rank must call it)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from tests.distributed.crash_worker import make_trainer
    from tests.engines.test_deepspeed import _parameters, zero_config

    unset_hf_deepspeed_config()  # a fresh engine config per run, as in a fresh process
    resume, kill_in_save = options.pop("resume", None), options.pop("kill_in_save", None)
    trainer = make_trainer(
        out,
        stock,
        per_device,
        accumulation,
        use_cpu=False,  # cpu_as_accelerator: accelerate's CPU path would drop the DeepSpeed config
        deepspeed=zero_config(stage),
        save_total_limit=None,
        optim_args="momentum=0.9",
        learning_rate=0.1,
        **options,
    )
    trainer.kill_in_save = kill_in_save
    trainer.train(resume_from_checkpoint=resume)
    return _parameters(trainer.accelerator.unwrap_model(trainer.model))


def _uninterrupted(root: str) -> None:
    """On 2 ranks: every stage's uninterrupted run, its checkpoints kept (the other world size resumes them)."""
    torch.set_num_threads(1)
    save_on_main({stage: _train(f"{root}/ZeRO-{stage}", stage) for stage in STAGES}, f"{root}/uninterrupted.pt")


def _killed(root: str, stage: int, stock: bool) -> None:
    """On 2 ranks: killed (SIGKILL, every rank) while writing checkpoint-4, before its RNG and trainer state."""
    torch.set_num_threads(1)
    _train(f"{root}/killed ZeRO-{stage}{' stock' if stock else ''}", stage, stock, kill_in_save=4)


def _one_process(root: str) -> None:
    """In one process: each stage's 2-rank checkpoint-2 resumed as 4 rows x GA 2 (and stock's refusal), the two
    engines' checkpoints crossed, and a ZeRO-3 checkpoint of 1 process for 2 ranks to resume."""
    from tests.distributed.crash_worker import make_trainer

    # First, before any DeepSpeed run: once one ran, the process's accelerate state keeps its engine.
    results = {}
    zero = f"{root}/ZeRO-2/checkpoint-2"
    results["DeepSpeed without it"] = error_of(
        lambda: make_trainer(f"{root}/no engine", per_device=4, accumulation=2, use_cpu=False).train(
            resume_from_checkpoint=zero
        )
    )
    plain = f"{root}/plain"
    make_trainer(plain, per_device=4, accumulation=2, max_steps=2, save_total_limit=None, use_cpu=False).train()
    results["plain under DeepSpeed"] = error_of(_train, plain, 2, accumulation=2, resume=f"{plain}/checkpoint-2")
    for stage in STAGES:
        run = f"{root}/2 to 1 ZeRO-{stage}"
        shutil.copytree(f"{root}/ZeRO-{stage}/checkpoint-2", f"{run}/checkpoint-2")
        with record_hf_parallel_log() as log:
            results[stage] = _train(run, stage, accumulation=2, resume=f"{run}/checkpoint-2")
        results[f"{stage} log"] = log.text
        results[f"{stage} stock"] = error_of(
            _train, run, stage, stock=True, accumulation=2, resume=f"{run}/checkpoint-2"
        )
    _train(f"{root}/1 to 2 ZeRO-3", 3, accumulation=2, max_steps=2)
    save_on_main(results, f"{root}/one process.pt")


def _resumed_on_two(root: str) -> None:
    """On 2 ranks: the killed runs resumed (stock's fails), and the 1-process ZeRO-3 checkpoint resumed as 2 x 4."""
    torch.set_num_threads(1)
    results = {}
    for stage in KILLED_STAGES:
        with record_hf_parallel_log() as log:
            results[stage] = _train(f"{root}/killed ZeRO-{stage}", stage, resume=True)
        results[f"{stage} log"] = log.text
        results[f"{stage} stock"] = error_of(_train, f"{root}/killed ZeRO-{stage} stock", stage, True, resume=True)
    results["1 to 2"] = _train(f"{root}/1 to 2 ZeRO-3", 3, resume=True)
    save_on_main(results, f"{root}/two ranks.pt")


def run_all(root: str) -> dict:
    """Every run of this module under `root` (also `benchmarks.resume`'s): the results by name."""
    spawn_cpu_ranks(_uninterrupted, (root,), 2, timeout=DEADLINE_S, cpu_as_accelerator=True)
    killed = {}
    for stage in KILLED_STAGES:
        for stock in (False, True):
            try:
                spawn_cpu_ranks(_killed, (root, stage, stock), 2, timeout=DEADLINE_S, cpu_as_accelerator=True)
            except Exception as error:  # the SIGKILL
                killed[stage, stock] = str(error)
            killed[stage, stock, "left"] = sorted(os.listdir(f"{root}/killed ZeRO-{stage}{' stock' if stock else ''}"))
    spawn_cpu_ranks(_one_process, (root,), 1, timeout=DEADLINE_S, cpu_as_accelerator=True)
    spawn_cpu_ranks(_resumed_on_two, (root,), 2, timeout=DEADLINE_S, cpu_as_accelerator=True)
    return {
        "root": root,
        "killed": killed,
        "uninterrupted": torch.load(f"{root}/uninterrupted.pt", weights_only=False),
        "one": torch.load(f"{root}/one process.pt", weights_only=False),
        "two": torch.load(f"{root}/two ranks.pt", weights_only=False),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return run_all(str(tmp_path_factory.mktemp("deepspeed_resume")))


@pytest.mark.parametrize("stage", KILLED_STAGES, ids=lambda stage: f"ZeRO-{stage}")
def test_a_kill_mid_save_resumes_from_the_last_complete_checkpoint(runs, stage):
    for stock in (False, True):
        assert "SIGKILL" in runs["killed"][stage, stock], runs["killed"][stage, stock]
    # hf_parallel's run left checkpoint-2 and the interrupted save in its staging folder; stock's a torn checkpoint-4.
    assert [name for name in runs["killed"][stage, False, "left"] if name.startswith("checkpoint")] == ["checkpoint-2"]
    assert "checkpoint-4" in runs["killed"][stage, True, "left"]
    assert "resuming from" in runs["two"][f"{stage} log"] and "checkpoint-2" in runs["two"][f"{stage} log"]
    assert largest_difference(runs["two"][stage], runs["uninterrupted"][stage]) < TOLERANCE
    # Stock picks the torn checkpoint-4 it left behind.
    assert runs["two"][f"{stage} stock"].startswith("FileNotFoundError"), runs["two"][f"{stage} stock"]
    assert "checkpoint-4" in runs["two"][f"{stage} stock"] and "trainer_state.json" in runs["two"][f"{stage} stock"]


@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"ZeRO-{stage}")
def test_two_ranks_resume_in_one_process_exactly(runs, stage):
    assert largest_difference(runs["one"][stage], runs["uninterrupted"][stage]) < TOLERANCE
    assert "written by DeepSpeed on 2 data-parallel ranks and is resumed on 1" in runs["one"][f"{stage} log"]
    stock = runs["one"][f"{stage} stock"]
    assert "ZeRORuntimeException" in stock and "DP world size of 2 but the current world size is 1" in stock, stock


def test_one_process_resumes_on_two_ranks_exactly(runs):
    assert largest_difference(runs["two"]["1 to 2"], runs["uninterrupted"][3]) < TOLERANCE


def test_a_checkpoint_of_the_other_engine_is_refused_by_name(runs):
    plain = runs["one"]["plain under DeepSpeed"]
    assert plain.startswith("ValueError: Can't find a valid checkpoint at ") and "written without DeepSpeed" in plain
    zero = runs["one"]["DeepSpeed without it"]
    assert zero.startswith("ValueError: ") and "written under DeepSpeed ZeRO" in zero and "global_step2" in zero
