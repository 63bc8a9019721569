"""The launch guards, in this process: a launch that did not form a group, CUDA_VISIBLE_DEVICES changed after CUDA
initialised (simulated, except in the GPU test), DataParallel over several GPUs. Tests of the machine without GPUs
hide the GPUs (`no_gpus`), so they pass on any machine. The real mis-launch is in test_launch.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.training_args import ParallelMode

from hf_parallel import Trainer, TrainingArguments
from hf_parallel.commands.env import trainer_mode
from hf_parallel.launch import environment as launch_env
from hf_parallel.launch import guards
from tests.helpers.harness import training_args
from tests.helpers.paths import repo_env
from tests.helpers.tiny import ListDataset, classification_rows, tiny_bert_classifier

# ---- launcher_world_size ----


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, 1),
        ({"WORLD_SIZE": "4"}, 4),
        ({"WORLD_SIZE": " 2 "}, 2),
        ({"WORLD_SIZE": ""}, 1),
        ({"OMPI_COMM_WORLD_SIZE": "3"}, 3),
        ({"PMI_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "8"}, 2),
        ({"WORLD_SIZE": "1", "PMI_SIZE": "8"}, 1),
    ],
)
def test_launcher_world_size_reads_the_first_variable_set(environ, expected):
    assert guards.launcher_world_size(environ) == expected


def test_guards_reads_the_launcher_through_launch_env():
    # One place reads launcher variables; the names stay importable from guards for code that used them there.
    assert guards.launcher_world_size is launch_env.launcher_world_size
    assert guards.WORLD_SIZE_VARIABLES is launch_env.WORLD_SIZE_VARIABLES


@pytest.mark.parametrize(("value", "message"), [("two", "not a whole number"), ("0", "must be >= 1")])
def test_launcher_world_size_rejects_bad_values_naming_them(value, message):
    with pytest.raises(ValueError, match=message) as info:
        guards.launcher_world_size({"WORLD_SIZE": value})
    assert "WORLD_SIZE" in str(info.value) and value in str(info.value)


# ---- guard 1: a launch that did not form a process group ----


def test_world_size_guard_stops_a_launch_that_did_not_form_a_group(no_launcher, no_gpus, tmp_path):
    # WORLD_SIZE=2 without a group: what a launcher gives each process when accelerate finds no device backend.
    no_launcher.setenv("WORLD_SIZE", "2")
    # Control: stock transformers takes it and would train alone in each process.
    stock_args = training_args(tmp_path, args_cls=transformers.TrainingArguments, use_cpu=False)
    assert stock_args.world_size == 1
    stock = transformers.Trainer(model=tiny_bert_classifier(), args=stock_args, train_dataset=classification_rows(8))
    assert stock.args.world_size == 1

    with pytest.raises(RuntimeError) as info:
        Trainer(
            model=tiny_bert_classifier(),
            args=training_args(tmp_path, use_cpu=False),
            train_dataset=classification_rows(8),
        )
    message = str(info.value)
    assert "A launcher started 2 processes (WORLD_SIZE=2)" in message
    assert "world_size=1, parallel_mode=not_parallel" in message
    # No GPU and use_cpu not set: the message gives that fix.
    assert "--use_cpu" in message and "ACCELERATE_USE_CPU=1" in message


def test_world_size_guard_names_the_mpi_variable(no_launcher, no_gpus, tmp_path):
    no_launcher.setenv("OMPI_COMM_WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match=r"started 4 processes \(OMPI_COMM_WORLD_SIZE=4\)"):
        guards.check_world_size(training_args(tmp_path, use_cpu=False))


def test_world_size_guard_is_silent_without_a_launcher_or_with_one_process(
    no_launcher, no_gpus, tmp_path, hf_parallel_log
):
    # Without GPUs: with several, use_cpu=False makes a DataParallel run, and the Trainer gives its hint.
    args = training_args(tmp_path, use_cpu=False)
    guards.check_world_size(args)
    no_launcher.setenv("WORLD_SIZE", "1")
    guards.check_world_size(args)
    trainer = Trainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_rows(8))
    assert trainer.args.world_size == 1
    assert hf_parallel_log.records == []


def test_world_size_guard_on_a_gpu_machine_names_the_launcher_fix(monkeypatch, no_launcher):
    # `mpirun -np 2` on a GPU machine: accelerate looks for LOCAL_RANK, which MPI does not set, so it forms no group.
    # A device backend exists here, so the fix is the launcher, not --use_cpu.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    no_launcher.setenv("OMPI_COMM_WORLD_SIZE", "2")
    # Stand-in arguments: real ones would set up a GPU device, which the machine running the test may not have.
    args = SimpleNamespace(world_size=1, parallel_mode=ParallelMode.NOT_PARALLEL, use_cpu=False)
    with pytest.raises(RuntimeError) as info:
        guards.check_world_size(args)
    message = str(info.value)
    assert "A launcher started 2 processes (OMPI_COMM_WORLD_SIZE=2)" in message
    assert "Launch with `accelerate launch` (or `torchrun`)" in message and "hf-parallel env" in message
    assert "--use_cpu" not in message


def test_env_report_predicts_the_guard(no_launcher, no_gpus, tmp_path):
    # `hf-parallel env` must say "error" exactly where the guard raises.
    no_launcher.setenv("WORLD_SIZE", "2")
    mode, _, why = trainer_mode(
        num_gpus=torch.cuda.device_count(), world_size=2, use_cpu=False, per_device_batch=8, grad_accum=1
    )
    assert mode == "error" and "--use_cpu" in why
    with pytest.raises(RuntimeError):
        guards.check_world_size(training_args(tmp_path, use_cpu=False))


# ---- guard 2: CUDA_VISIBLE_DEVICES changed after CUDA was initialised ----


@pytest.fixture
def cuda_initialised_with(monkeypatch):
    """Pretend CUDA initialised while CUDA_VISIBLE_DEVICES had the given value (on any machine)."""

    def pretend(value):
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(guards, "_visible_devices_at_cuda_init", value)

    return pretend


@pytest.fixture
def cuda_not_initialised(monkeypatch):
    """CUDA not initialised yet in this process, even where an earlier test did initialise it (a GPU test, or
    arguments that set up a GPU device)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


def test_visible_devices_changed_after_cuda_init_warns(monkeypatch, cuda_initialised_with, hf_parallel_log):
    cuda_initialised_with("0,1")
    # Set after init_process_group / CUDA use, as scripts that pick GPUs late do.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    guards.check_visible_devices()
    (record,) = hf_parallel_log.records
    assert record.levelno == logging.WARNING
    assert "CUDA read '0,1', it is now '2,3'" in record.getMessage()
    assert "has no effect" in record.getMessage()


def test_visible_devices_set_after_cuda_init_from_unset_warns(monkeypatch, cuda_initialised_with, hf_parallel_log):
    cuda_initialised_with(None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    guards.check_visible_devices()
    assert "CUDA read None, it is now '0,1,2,3'" in hf_parallel_log.records[0].getMessage()


def test_visible_devices_unchanged_is_silent(monkeypatch, cuda_initialised_with, hf_parallel_log):
    cuda_initialised_with("2,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    guards.check_visible_devices()
    assert hf_parallel_log.records == []


def test_visible_devices_changed_before_cuda_init_is_silent(monkeypatch, cuda_not_initialised, hf_parallel_log):
    # CUDA not initialised yet: it will read the new value, so the change works.
    monkeypatch.setattr(guards, "_visible_devices_at_cuda_init", "0,1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    guards.check_visible_devices()
    assert hf_parallel_log.records == []


# Imports the guards with CUDA_VISIBLE_DEVICES=1, changes it, and checks as if CUDA had initialised unrecorded.
IMPORT_VALUE_PROBE = """
import os
import torch
from hf_parallel.launch import guards
os.environ["CUDA_VISIBLE_DEVICES"] = "0"
torch.cuda.is_initialized = lambda: True
guards.check_visible_devices()
"""


def test_visible_devices_falls_back_to_the_value_at_import(tmp_path):
    # In a fresh interpreter, so that the value at import is the one given here.
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_VALUE_PROBE],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=repo_env(CUDA_VISIBLE_DEVICES="1"),
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "CUDA read '1', it is now '0'" in result.stderr


def test_the_value_is_recorded_when_cuda_initialises(monkeypatch, cuda_not_initialised, hf_parallel_log):
    # guards registered a call (when it was imported, before any test could initialise CUDA) that torch runs inside
    # torch.cuda._lazy_init; run it as torch would.
    queued = [call for call, _ in torch.cuda._queued_calls if call is guards._record_visible_devices_at_cuda_init]
    assert len(queued) == 1
    monkeypatch.setattr(guards, "_visible_devices_at_cuda_init", "not recorded")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    queued[0]()
    assert guards._visible_devices_at_cuda_init == "5,6"
    # A later change is then caught.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    guards.check_visible_devices()
    assert "CUDA read '5,6', it is now '0'" in hf_parallel_log.records[0].getMessage()


# ---- guard 3: DataParallel over several GPUs ----


def test_data_parallel_hint_names_the_launch_command(no_launcher, tmp_path, hf_parallel_log):
    args = training_args(tmp_path, dp_devices=2)
    assert args.n_gpu == 2 and args.parallel_mode.value == "not_distributed"
    Trainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_rows(8))
    hints = [r.getMessage() for r in hf_parallel_log.records if "DataParallel" in r.getMessage()]
    assert len(hints) == 1
    assert "\n" not in hints[0]
    assert "nn.DataParallel over 2 GPUs" in hints[0]
    assert "accelerate launch --num_processes 2" in hints[0]


def test_no_data_parallel_hint_on_one_device(no_launcher, tmp_path, hf_parallel_log):
    args = training_args(tmp_path)
    assert args.n_gpu == 0
    guards.check_data_parallel(args)
    assert hf_parallel_log.records == []


@pytest.mark.gpu
def test_visible_devices_guard_on_a_real_gpu(monkeypatch, hf_parallel_log):
    # Not run on CPU machines. CUDA reads CUDA_VISIBLE_DEVICES when it initialises; the value is recorded then.
    before = torch.cuda.device_count()
    torch.zeros(1, device="cuda")
    assert torch.cuda.is_initialized()
    assert guards._visible_devices_at_cuda_init == os.environ.get("CUDA_VISIBLE_DEVICES")
    guards.check_visible_devices()
    assert hf_parallel_log.records == []
    # Change it afterwards, as scripts that pick GPUs late do. It has no effect (same devices), and the guard says so.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0" if before > 1 else "")
    assert torch.cuda.device_count() == before
    guards.check_visible_devices()
    assert "has no effect" in hf_parallel_log.records[0].getMessage()


# ---- Empty data: a clear error before the loop, where stock runs 0 steps or reports no loss ----


def _empty_data_trainer(trainer_cls, args_cls, tmp_path, train_rows: int, eval_rows: int):
    args = training_args(tmp_path, args_cls=args_cls, max_steps=2)
    return trainer_cls(
        model=tiny_bert_classifier(),
        args=args,
        train_dataset=classification_rows(train_rows) if train_rows else ListDataset([]),
        eval_dataset={"dev": classification_rows(eval_rows) if eval_rows else ListDataset([])},
    )


def test_empty_training_data_is_a_clear_error_in_stock_words_first(tmp_path):
    with pytest.raises(ValueError, match=r"train_dataset is empty \(a ListDataset of length 0\)") as ours:
        _empty_data_trainer(Trainer, TrainingArguments, tmp_path, 0, 4).train()
    stock_trainer = _empty_data_trainer(transformers.Trainer, transformers.TrainingArguments, tmp_path / "stock", 0, 4)
    with pytest.raises(ValueError) as stock:
        stock_trainer.train()
    assert str(stock.value) == "num_samples should be a positive integer value, but got num_samples=0"
    assert str(ours.value).startswith(str(stock.value))


def test_empty_evaluation_data_is_a_clear_error(tmp_path):
    trainer = _empty_data_trainer(Trainer, TrainingArguments, tmp_path, 4, 0)
    with pytest.raises(ValueError, match=r"eval_dataset\['dev'\] is empty"):
        trainer.evaluate()
    with pytest.raises(ValueError, match=r"test_dataset is empty"):
        trainer.predict(ListDataset([]))


def test_stock_says_nothing_useful_on_empty_data(tmp_path):
    # The control: stock evaluates an empty set into metrics without a loss.
    trainer = _empty_data_trainer(transformers.Trainer, transformers.TrainingArguments, tmp_path, 4, 0)
    metrics = trainer.evaluate()
    assert "eval_dev_loss" not in metrics


class _LoaderWithoutDataset:
    """A dataloader of several dataloaders with a length and no `.dataset`, which transformers supports."""

    def __init__(self, loaders):
        self.loaders = loaders

    def __len__(self):
        return sum(len(loader) for loader in self.loaders)

    def __iter__(self):
        for loader in self.loaders:
            yield from loader


@pytest.mark.parametrize("trainer_base", [Trainer, transformers.Trainer], ids=["hf_parallel", "stock"])
def test_a_dataloader_without_dataset_trains_and_evaluates(trainer_base, tmp_path):
    # Stock reads `dataloader.dataset` with getattr: a loader without it trains and evaluates.
    class LoaderTrainer(trainer_base):
        def get_train_dataloader(self):
            return _LoaderWithoutDataset([super().get_train_dataloader()])

        def get_eval_dataloader(self, eval_dataset=None):
            return _LoaderWithoutDataset([super().get_eval_dataloader(eval_dataset)])

    args_cls = TrainingArguments if trainer_base is Trainer else transformers.TrainingArguments
    trainer = LoaderTrainer(
        model=tiny_bert_classifier(),
        args=training_args(tmp_path, args_cls=args_cls, max_steps=2, per_device_train_batch_size=2),
        train_dataset=classification_rows(4),
        eval_dataset=classification_rows(3),
    )
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0


# ---- fsdp / DeepSpeed asked for, DDP or one process running (the FSDP case runs for real in test_fsdp2.py) ----


def _sharding_args(**overrides) -> SimpleNamespace:
    return SimpleNamespace(**{"fsdp": False, "fsdp_config": None, "deepspeed": None, "use_cpu": False, **overrides})


@pytest.mark.parametrize(
    ("args", "distributed_type", "expected"),
    [
        (_sharding_args(deepspeed={"zero_optimization": {"stage": 2}}, use_cpu=True), "NO", "runs a single process"),
        (_sharding_args(deepspeed="ds.json", use_cpu=True), "MULTI_CPU", "runs DDP over 2 CPU processes (gloo)"),
        (_sharding_args(fsdp=True, fsdp_config={"version": 2}), "MULTI_GPU", "runs MULTI_GPU with 2 processes"),
    ],
)
def test_a_sharding_downgrade_names_what_was_asked_and_what_runs(args, distributed_type, expected):
    reason = guards.sharding_downgrade(args, distributed_type, 2)
    asked = "fsdp (FSDP version 2)" if args.fsdp else "deepspeed (a ZeRO config)"
    assert reason.startswith(f"{asked} was asked for, but accelerate {expected}: "), reason
    assert ("not on the CPU" in reason) == (distributed_type in ("NO", "MULTI_CPU")), reason


@pytest.mark.parametrize(
    ("args", "distributed_type"),
    [
        (_sharding_args(), "MULTI_CPU"),
        (_sharding_args(fsdp=True, fsdp_config={"version": 2}), "FSDP"),
        (_sharding_args(deepspeed="ds.json"), "DEEPSPEED"),
        (_sharding_args(fsdp=True, fsdp_config={"xla": True}), "XLA"),  # FSDP on TPUs is torch_xla's, not accelerate's
    ],
)
def test_no_sharding_downgrade_when_it_runs_or_was_not_asked(args, distributed_type):
    assert guards.sharding_downgrade(args, distributed_type, 2) is None


def test_a_rank_without_a_gpu_is_told_before_the_device_set_up(no_launcher, monkeypatch, tmp_path):
    import torch

    from hf_parallel import TrainingArguments

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    no_launcher.setenv("LOCAL_RANK", "1")
    no_launcher.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError, match=r"local rank 1, but it sees 1 GPU.*--num_processes 1.*--use_cpu"):
        TrainingArguments(output_dir=str(tmp_path), report_to="none")
    # On the CPU, or as rank 0, nothing to say (the device set-up itself is not run here).
    from hf_parallel.launch.guards import check_rank_has_a_gpu

    check_rank_has_a_gpu(type("Args", (), {"use_cpu": True})())
    no_launcher.setenv("LOCAL_RANK", "0")
    check_rank_has_a_gpu(type("Args", (), {"use_cpu": False})())


def test_a_model_in_pipeline_stages_is_refused_before_training(tmp_path):
    """A model `from_pretrained(..., distributed_config=DistributedConfig(pp_size=2))` carries that config: the Trainer
    refuses it when built, in one line naming pipeline parallelism and what to load instead (stock's Trainer stops
    inside its first step's preparation, with gloo's "Connection reset by peer" on CPU ranks). The pipeline split
    itself needs two launched ranks and is not made here: the config the model carries is what the guard reads."""
    model = tiny_bert_classifier()
    model.config.distributed_config = transformers.DistributedConfig(pp_size=2)
    with pytest.raises(
        ValueError, match=r"pipeline stages .*pp_size=2.* does not support pipeline parallelism"
    ) as error:
        Trainer(model=model, args=training_args(tmp_path), train_dataset=classification_rows(4))
    assert "tp_size=..., fsdp_size=..." in str(error.value) and "\n" not in str(error.value)
    model.config.distributed_config = transformers.DistributedConfig(pp_size=1)
    Trainer(model=model, args=training_args(tmp_path), train_dataset=classification_rows(4))  # no stages: no refusal
