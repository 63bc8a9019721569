"""
Runs that survive: a kill in the middle of a checkpoint save leaves the last complete checkpoint to resume from (stock
leaves a torn one it then fails on), a torn checkpoint is passed over or refused by name, rotation waits for the new
checkpoint, `CleanCheckpointCallback` never leaves a checkpoint without weights, and a resume on another number of
processes with the same global batch ends where the uninterrupted run ends (another global batch is warned; a rank
without its own random state gets a defined one).

The kills are real SIGKILLs of a child process (`tests/distributed/crash_worker.py`) in the middle of writing
checkpoint-4: its weights and optimizer state are on disk, its RNG state and `trainer_state.json` are not yet. The
reference is the same run, uninterrupted, in one process: 6 plain SGD steps of 8 rows, three epochs of 16 rows.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy
import pytest
import torch
from transformers import set_seed

import hf_parallel.saving.staging as staging_module
from hf_parallel.callbacks import _rewrite_weights
from hf_parallel.saving.checkpoints import checkpoint_weight_files, stored_keys
from hf_parallel.saving.resume import checkpoint_problems, rank_seed
from hf_parallel.saving.staging import RUN_FILE, STAGING_DIR
from hf_parallel.testing import spawn_cpu_ranks
from tests.distributed.crash_worker import CASE, make_trainer, run
from tests.helpers.harness import record_hf_parallel_log
from tests.helpers.heads import CASES
from tests.helpers.paths import NO_GPUS, ROOT, repo_env
from tests.helpers.resumes import largest_difference

KILLED = -9  # the child's return code after SIGKILL


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict:
    """One process each, hf_parallel's Trainer and stock's (side by side), killed while writing checkpoint-4."""
    logs = tmp_path_factory.mktemp("killed_logs")
    runs, procs = {}, {}
    for name, flags in (("exact", []), ("stock", ["--stock"])):
        runs[name] = tmp_path_factory.mktemp(f"killed_{name}")
        command = [sys.executable, "-m", "tests.distributed.crash_worker", str(runs[name]), "--kill-in-save", "4"]
        with open(logs / f"{name}.log", "w") as log:  # a file, not a pipe: a full pipe would block the worker
            procs[name] = subprocess.Popen(
                [*command, *flags], cwd=ROOT, env=repo_env(**NO_GPUS), stdout=log, stderr=log
            )
    for name, proc in procs.items():
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            proc.kill()
        assert code == KILLED, (name, code, (logs / f"{name}.log").read_text()[-6000:])
    return runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run(str(tmp_path_factory.mktemp("uninterrupted")))


def _copy(source, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(source, target)
    return target


@pytest.mark.slow
@pytest.mark.full  # real kills of child processes (~6 s): .ci/run runs the full step
def test_a_kill_mid_save_leaves_the_last_complete_checkpoint(killed, reference, tmp_path):
    out = _copy(killed["exact"], tmp_path)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert checkpoint_problems(str(out / "checkpoint-2")) == []
    staged = out / STAGING_DIR / "checkpoint-4"
    assert checkpoint_weight_files(staged) and not (staged / "trainer_state.json").exists()  # killed mid-save
    with record_hf_parallel_log() as log:
        resumed = run(str(out), resume=True)
    assert "resuming from" in log.text and str(out / "checkpoint-2") in log.text and str(staged) in log.text
    assert largest_difference(resumed, reference) < 1e-6
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]  # rotated, the torn save cleared
    assert not (out / STAGING_DIR).exists()


@pytest.mark.slow
@pytest.mark.full  # real kills of child processes (~6 s): .ci/run runs the full step
def test_stock_killed_mid_save_cannot_resume(killed, tmp_path):
    out = _copy(killed["stock"], tmp_path)
    # The control: stock writes in place, so its torn checkpoint-4 is the newest, and resuming picks it and fails.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert checkpoint_problems(str(out / "checkpoint-4")) == [
        "trainer_state.json (written last: the save was interrupted)"
    ]
    trainer = make_trainer(str(out), stock=True)
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        trainer.train(resume_from_checkpoint=True)


@pytest.mark.slow
@pytest.mark.full  # real kills of child processes (~6 s): .ci/run runs the full step
def test_a_torn_checkpoint_is_passed_over_or_refused_by_name(killed, reference, tmp_path):
    out = _copy(killed["stock"], tmp_path)
    torn = out / "checkpoint-4"
    trainer = make_trainer(str(out))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match="lacks trainer_state.json") as refused:
        trainer.train(resume_from_checkpoint=str(torn))
    assert str(out / "checkpoint-2") in str(refused.value)  # the one to pass instead
    assert trainer.state.global_step == 0 and largest_difference(dict(trainer.model.named_parameters()), before) == 0
    with record_hf_parallel_log() as log:
        resumed = run(str(out), resume=True)
    assert f"{torn} lacks trainer_state.json" in log.text
    assert largest_difference(resumed, reference) < 1e-6


def test_rotation_runs_once_the_new_checkpoint_is_complete(tmp_path, monkeypatch):
    seen = []
    rotate = staging_module.rotate_checkpoints

    def watching(output_dir, save_total_limit, best_model_checkpoint, use_mtime):
        newest = max(os.listdir(output_dir), key=lambda n: int(n.split("-")[1]) if n.startswith("checkpoint-") else -1)
        seen.append((newest, checkpoint_problems(os.path.join(output_dir, newest))))
        rotate(output_dir, save_total_limit, best_model_checkpoint, use_mtime)

    monkeypatch.setattr(staging_module, "rotate_checkpoints", watching)
    make_trainer(str(tmp_path), max_steps=3, save_steps=1).train()
    assert seen == [(f"checkpoint-{step}", []) for step in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]
    assert (tmp_path / "checkpoint-3" / RUN_FILE).is_file()


def test_clean_checkpoint_rewrite_never_leaves_a_checkpoint_without_weights(tmp_path, monkeypatch):
    model = CASES[CASE].build(0)
    torch.nn.DataParallel(model).module.save_pretrained(tmp_path)  # stands in for the prefixed weights
    (old,) = checkpoint_weight_files(tmp_path)
    keys = stored_keys(old)

    def crash(self, folder, **kwargs):
        with open(os.path.join(folder, "model.safetensors"), "wb") as file:
            file.write(b"half a file")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(type(model), "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        _rewrite_weights(str(tmp_path), model)
    assert stored_keys(old) == keys  # the old weights are whole
    monkeypatch.undo()
    _rewrite_weights(str(tmp_path), model)
    assert checkpoint_weight_files(tmp_path) == [old] and stored_keys(old) == keys
    assert not (tmp_path / ".hf_parallel-rewrite").exists()


def test_a_rank_without_its_random_state_gets_a_defined_one(tmp_path):
    trainer = make_trainer(str(tmp_path / "run"))
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    torch.save({"python": None}, checkpoint / "rng_state_0.pth")  # written by 2 processes: none for 1 process
    trainer.state.global_step = 2
    with record_hf_parallel_log() as log:
        trainer._load_rng_state(str(checkpoint))
    drawn = torch.rand(4)
    set_seed(rank_seed(trainer.args.seed, 0, 1, 2))
    assert torch.equal(drawn, torch.rand(4))
    assert "holds no random state for process 0" in log.text and f"seeded with {rank_seed(0, 0, 1, 2)}" in log.text
    # With its own file, stock's load: the state saved.
    torch.manual_seed(123)
    state = {"python": random.getstate(), "numpy": numpy.random.get_state()}
    state["cpu"] = torch.random.get_rng_state()
    torch.save(state, checkpoint / "rng_state.pth")
    expected = torch.rand(4)
    trainer._load_rng_state(str(checkpoint))
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.slow
@pytest.mark.full  # real kills of child processes (~6 s): .ci/run runs the full step
def test_another_global_batch_is_warned(killed, tmp_path):
    out = _copy(killed["exact"], tmp_path)
    checkpoint = str(out / "checkpoint-2")
    with record_hf_parallel_log() as log:
        make_trainer(str(out), per_device=4, max_steps=3, save_strategy="no").train(resume_from_checkpoint=checkpoint)
    assert "written with a global batch of 8 rows" in log.text and "with a global batch of 4 rows" in log.text
    with record_hf_parallel_log() as log:
        trainer = make_trainer(str(out), per_device=4, accumulation=2, max_steps=3, save_strategy="no")
        trainer.train(resume_from_checkpoint=checkpoint)
    assert "global batch" not in log.text  # 4 rows x GA 2: the same 8


def _topology_worker(out_dir: str) -> None:
    """On 2 ranks: resume a 1-process checkpoint as 2 x 4 and as 2 x 2 x GA 2 (and stock as 2 x 4), and write a
    2-rank checkpoint for the test to resume in one process."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on two cores (a spawned process: the test's own keeps its threads)
    single = os.path.join(out_dir, "single")
    results = {}
    for name, stock, per_device, accumulation in (
        ("2 x 4", False, 4, 1),
        ("2 x 2 x GA 2", False, 2, 2),
        ("stock 2 x 4", True, 4, 1),
    ):
        run_dir = os.path.join(out_dir, name)
        if dist.get_rank() == 0:
            shutil.copytree(single, run_dir)
        dist.barrier()
        with record_hf_parallel_log() as log:
            params = run(run_dir, stock, per_device, accumulation, resume=True)
        results[name] = {"params": params, "log": log.text}
    make_trainer(os.path.join(out_dir, "two ranks"), per_device=4, max_steps=2).train()
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


@pytest.fixture(scope="module")
def topologies(tmp_path_factory) -> tuple:
    out = tmp_path_factory.mktemp("topologies")
    make_trainer(str(out / "single"), max_steps=2).train()  # checkpoint-2 of 1 process x 8 rows
    spawn_cpu_ranks(_topology_worker, args=(str(out),), num_processes=2, timeout=300)
    return out, torch.load(out / "results.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.full  # real kills of child processes (~6 s): .ci/run runs the full step
def test_resume_on_another_number_of_processes_continues_the_run_exactly(topologies, reference):
    out, results = topologies
    for name in ("2 x 4", "2 x 2 x GA 2"):
        assert largest_difference(results[name]["params"], reference) < 1e-6, name
        # The 1-process checkpoint has no random state for either rank: each gets the defined one, told.
        assert "holds no random state for process 0" in results[name]["log"], name
        assert "global batch" not in results[name]["log"], name
    # Stock's loss depends on the topology.
    assert largest_difference(results["stock 2 x 4"]["params"], reference) > 1e-3
    # And back: the 2-rank checkpoint (steps 1-2 in 2 x 4) resumed in one process, 4 rows x GA 2.
    with record_hf_parallel_log() as log:
        resumed = run(str(out / "two ranks"), per_device=4, accumulation=2, resume=True)
    assert largest_difference(resumed, reference) < 1e-6
    assert "holds no random state for process 0" in log.text


def test_save_on_each_node_on_a_shared_folder_is_warned(tmp_path):
    def node(process_index: int) -> SimpleNamespace:
        return SimpleNamespace(save_on_each_node=True, should_save=True, world_size=4, process_index=process_index)

    with record_hf_parallel_log() as log:
        alone = staging_module._mark_node(str(tmp_path / "local"), node(0))
        staging_module._warn_if_shared(str(tmp_path / "local"), node(0), alone)
    assert "save_on_each_node" not in log.text  # a folder only this node sees
    marks = [staging_module._mark_node(str(tmp_path / "shared"), node(rank)) for rank in (0, 2)]  # two nodes' mains
    with record_hf_parallel_log() as log:
        staging_module._warn_if_shared(str(tmp_path / "shared"), node(0), marks[0])
    assert "is shared by 2 nodes" in log.text and "save_on_each_node=False" in log.text
    without = SimpleNamespace(save_on_each_node=False, should_save=True, world_size=4, process_index=0)
    assert staging_module._mark_node(str(tmp_path / "default"), without) is None  # one writer: no marks


@pytest.mark.gpu
@pytest.mark.slow
def test_fsdp2_sharded_checkpoints_survive_a_kill_mid_save(tmp_path):
    """On a GPU (accelerate runs no FSDP on CPU): FSDP2 with sharded checkpoints, one process under torchrun."""

    def torchrun(out, *flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29561"]
        command += ["-m", "tests.distributed.crash_worker", str(out), "--fsdp", *flags]
        return subprocess.run(command, cwd=ROOT, env=repo_env(), capture_output=True, text=True, timeout=300)

    reference = tmp_path / "uninterrupted"
    done = torchrun(reference)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "run"
    killed = torchrun(out, "--kill-in-save", "4")
    assert killed.returncode != 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert any(p.name.startswith("pytorch_model_fsdp") for p in (out / "checkpoint-2").iterdir())  # sharded
    assert checkpoint_problems(str(out / "checkpoint-2")) == [] and (out / STAGING_DIR / "checkpoint-4").is_dir()
    resumed = torchrun(out, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr + resumed.stdout
    final = torch.load(out / "final.pt", weights_only=True)
    assert largest_difference(final, torch.load(reference / "final.pt", weights_only=True)) < 1e-6


def test_the_state_file_is_the_one_transformers_writes():
    from transformers.trainer import TRAINER_STATE_NAME

    assert staging_module.TRAINER_STATE == TRAINER_STATE_NAME
