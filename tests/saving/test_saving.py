"""
hf_parallel.Trainer saves clean checkpoints and resumes from them in every set-up, a quantization-aware-training model
included; a training killed with SIGKILL resumes to the same weights. CleanCheckpointCallback, which does the same for
the stock Trainer: test_callbacks.py. The set-ups: tests/helpers/setups.py.
"""

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open
from torch import nn
from transformers import BertForSequenceClassification

from hf_parallel import (
    BalancedDataParallel,
    ExactDataParallel,
    Trainer,
    TrainingArguments,
    check_reload,
    load_state_dict,
    unwrap_model,
)
from hf_parallel.testing import simulate_data_parallel, spawn_cpu_ranks
from tests.distributed.save_train_worker import MAX_STEPS, make_trainer
from tests.helpers.harness import assert_same_weights, training_args, weights_of
from tests.helpers.paths import ROOT, repo_env
from tests.helpers.setups import SAVING, SETUPS, assert_clean_checkpoint, setup_case, stored_key_set
from tests.helpers.tiny import ListDataset, classification_rows, qat_model, tiny_bert_classifier

WORKER = ROOT / "tests" / "distributed" / "save_train_worker.py"

SLOW_CASES = {"compile", "user_compiled"}  # compilation takes seconds, even with the eager backend
# The wrapper hf_parallel.Trainer trains each DataParallel set-up in: ExactDataParallel where stock would use
# nn.DataParallel (a user's nn.DataParallel included: the Trainer unwraps it and wraps the model itself).
WRAPPERS = {
    "dp": ExactDataParallel,
    "balanced_dp": BalancedDataParallel,
    "user_dp": ExactDataParallel,
    "user_balanced_dp": BalancedDataParallel,
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in SETUPS])
def test_checkpoints_are_clean_and_resume(case, tmp_path):
    with setup_case(case, tmp_path / "run") as (trainer, model):
        trainer.train()
        if case in ("dp", "balanced_dp", "user_dp", "user_balanced_dp"):  # the topology the case is about
            assert trainer.args.n_gpu == SETUPS[case]["n_gpu"]
            assert type(trainer.model_wrapped) is WRAPPERS[case]
            assert trainer.model_wrapped.device_ids == list(range(SETUPS[case]["n_gpu"]))  # the emulated GPUs
            assert unwrap_model(trainer.model_wrapped) is model
        if case in ("balanced_dp", "user_balanced_dp"):
            assert trainer.model_wrapped.gpu0_bsz == 1 and trainer.args.gpu0_bsz == 1
        if case.startswith("user_"):
            assert trainer.model is not trainer.model_wrapped or case == "user_compiled"
        final = weights_of(trainer.model)
    assert_clean_checkpoint(tmp_path / "run" / "checkpoint-2", model, same_step=False)
    assert_clean_checkpoint(tmp_path / "run" / "checkpoint-4", model)
    trainer.save_model(tmp_path / "final")
    assert_clean_checkpoint(tmp_path / "final", model)

    # Resume into a model with other initial weights: a silently skipped load would end elsewhere.
    with setup_case(case, tmp_path / "resumed", seed=1) as (resumed, _):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
        assert_same_weights(weights_of(resumed.model), final)


def test_resume_from_a_prefixed_checkpoint(tmp_path):
    with setup_case("plain", tmp_path / "run") as (trainer, _):
        trainer.train()
        final = weights_of(trainer.model)
    clean = safetensors.torch.load_file(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    for prefix in ("module.", "_orig_mod.", "module._orig_mod."):
        # An older run (or another tool) wrote the weights of a wrapped model.
        checkpoint = tmp_path / f"old-{prefix}" / "checkpoint-2"
        shutil.copytree(tmp_path / "run" / "checkpoint-2", checkpoint)
        safetensors.torch.save_file({prefix + k: v for k, v in clean.items()}, checkpoint / "model.safetensors")
        with setup_case("plain", tmp_path / f"ours-{prefix}", seed=1) as (ours, _):
            ours.train(resume_from_checkpoint=str(checkpoint))
            assert_same_weights(weights_of(ours.model), final)

    # Control: stock resumes from the random initial weights with only a warning.
    with setup_case(
        "plain", tmp_path / "stock", seed=1, trainer_cls=transformers.Trainer, args_cls=transformers.TrainingArguments
    ) as (stock, _):
        stock.train(resume_from_checkpoint=str(checkpoint))
        stock_final = weights_of(stock.model)
    assert (stock_final["classifier.weight"] - final["classifier.weight"]).abs().max() > 1e-3


def test_resume_fails_loudly_on_another_model(tmp_path):
    with setup_case("plain", tmp_path / "run") as (trainer, _):
        trainer.train()
    trainer = Trainer(
        model=tiny_bert_classifier(num_labels=3),
        args=training_args(tmp_path / "other", **SAVING),
        train_dataset=classification_rows(24, num_labels=3),
    )
    with pytest.raises(ValueError, match=r"shapes differ .*classifier"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))


def test_load_best_model_at_end_with_user_wrapped_model(tmp_path):
    with setup_case(
        "user_dp",
        tmp_path,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,  # the worse eval_loss is the "best": a step whose weights differ from the last
        eval_dataset=classification_rows(4, seed=3),
    ) as (trainer, model):
        trainer.train()
        best = trainer.state.best_model_checkpoint
    assert best is not None
    stored = safetensors.torch.load_file(os.path.join(best, "model.safetensors"))
    assert_same_weights(weights_of(model), stored, atol=0)


def test_stock_trainer_fails_on_a_user_wrapped_model(tmp_path):
    """The two failures hf_parallel.Trainer fixes: no columns left, then a `module.` checkpoint."""
    kw = dict(trainer_cls=transformers.Trainer, args_cls=transformers.TrainingArguments)
    with setup_case("user_dp", tmp_path / "a", **kw) as (stock, _):
        with pytest.raises(ValueError, match="The batch received was empty"):
            stock.train()
    with setup_case("user_dp", tmp_path / "b", remove_unused_columns=False, **kw) as (stock, _):
        stock.train()
    keys = stored_key_set(tmp_path / "b" / "checkpoint-2")
    assert all(k.startswith("module.") for k in keys)
    _, info = BertForSequenceClassification.from_pretrained(tmp_path / "b" / "checkpoint-2", output_loading_info=True)
    assert "classifier.weight" in info["missing_keys"]  # from_pretrained "loads" it: every weight random


# ---- A model whose own load_state_dict resizes buffers: torch.ao quantization-aware training ----


def _qat_trainer(trainer_cls, args_cls, output_dir, seed):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
    rows = ListDataset([{"x": x[i], "labels": y[i]} for i in range(16)])
    # qat_model's per-channel observers start with a placeholder shape: (1,) scales, (0,) minima and maxima.
    args = training_args(output_dir, args_cls=args_cls, **SAVING)
    return trainer_cls(model=qat_model(seed), args=args, train_dataset=rows)


@pytest.mark.parametrize("trainer_cls", [Trainer, transformers.Trainer], ids=["ours", "stock"])
def test_resume_a_quantization_aware_model(trainer_cls, tmp_path):
    """hf_parallel.Trainer resumes where stock does: the model's own load_state_dict resizes the observers."""
    args_cls = TrainingArguments if trainer_cls is Trainer else transformers.TrainingArguments
    run = _qat_trainer(trainer_cls, args_cls, tmp_path / "run", seed=0)
    run.train()
    final = weights_of(run.model)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        assert f.get_slice("fc.weight_fake_quant.scale").get_shape() == [3]

    resumed = _qat_trainer(trainer_cls, args_cls, tmp_path / "resumed", seed=1)  # other initial weights
    assert resumed.model.fc.weight_fake_quant.scale.shape == (1,)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert resumed.model.fc.weight_fake_quant.scale.shape == (3,)
    assert_same_weights(weights_of(resumed.model), final)


# ---- The process is killed mid-epoch ----


@pytest.mark.slow
@pytest.mark.full  # real kills of child processes (~6 s): .ci/run runs the full step
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(tmp_path):
    killed = tmp_path / "killed"
    log = tmp_path / "worker.log"  # a file, not a pipe: a full pipe would block the worker before it is killed
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(killed), "5"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=repo_env(HF_HUB_OFFLINE="1"),
        )
    try:
        deadline = time.monotonic() + 120
        while not (killed / "ready").exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the worker never reached step 5"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-3"]  # killed between two saves

    resumed = make_trainer(str(killed), seed=1)  # other initial weights: only the checkpoint can make them equal
    resumed.train(resume_from_checkpoint=True)  # the last checkpoint in output_dir
    assert resumed.state.global_step == MAX_STEPS

    uninterrupted = make_trainer(str(tmp_path / "uninterrupted"))
    uninterrupted.train()
    assert_same_weights(weights_of(resumed.model), weights_of(uninterrupted.model), atol=1e-6)
    # Control: a run that restarts from scratch (no resume) ends elsewhere.
    restarted = make_trainer(str(tmp_path / "restarted"), seed=1)
    restarted.train()
    assert (
        weights_of(restarted.model)["classifier.weight"] - weights_of(uninterrupted.model)["classifier.weight"]
    ).abs().max() > 1e-3


# ---- DDP: two ranks on CPU ----


def _ddp_worker(output_dir):
    from accelerate import PartialState
    from transformers.training_args import ParallelMode

    # A rank stuck in a collective would hang the test session: dump its stack and exit instead.
    faulthandler.dump_traceback_later(180, exit=True)
    # cpu=True: PartialState reads no ACCELERATE_USE_CPU, and on a GPU machine it would set each rank a CUDA device.
    state = PartialState(cpu=True)
    for wrap_by_user in (False, True):
        run = Path(output_dir) / ("user_ddp" if wrap_by_user else "ddp")
        args = training_args(run, **SAVING)
        assert args.world_size == 2 and args.parallel_mode == ParallelMode.DISTRIBUTED
        model = tiny_bert_classifier(seed=0)
        handed = nn.parallel.DistributedDataParallel(model) if wrap_by_user else model
        trainer = Trainer(model=handed, args=args, train_dataset=classification_rows(24, seed=1))
        assert trainer.model is model
        trainer.train()
        assert isinstance(trainer.model_wrapped, nn.parallel.DistributedDataParallel)
        assert unwrap_model(trainer.model_wrapped) is model
        final = weights_of(model)
        if state.is_main_process:
            assert_clean_checkpoint(run / "checkpoint-4", model)
        state.wait_for_everyone()

        resumed = Trainer(
            model=tiny_bert_classifier(seed=1 + state.process_index),  # differs across ranks, too
            args=training_args(run / "resumed", **SAVING),
            train_dataset=classification_rows(24, seed=1),
        )
        resumed.train(resume_from_checkpoint=str(run / "checkpoint-2"))
        assert_same_weights(weights_of(resumed.model), final)
        for name, param in resumed.model.named_parameters():  # equal across ranks
            gathered = [torch.empty_like(param) for _ in range(2)]
            dist.all_gather(gathered, param.detach().contiguous())
            torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0, msg=name)
    (Path(output_dir) / f"done-{state.process_index}").write_text("ok")
    faulthandler.cancel_dump_traceback_later()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_checkpoints_are_clean_and_resume(tmp_path):
    spawn_cpu_ranks(_ddp_worker, (str(tmp_path),), num_processes=2)
    assert (tmp_path / "done-0").exists() and (tmp_path / "done-1").exists()


def test_load_state_dict_is_the_public_loader(tmp_path, no_gpus):
    with setup_case("user_dp", tmp_path) as (trainer, model):
        trainer.train()
    # A real nn.DataParallel, on the CPU (no_gpus): with one GPU it would move the model to it.
    target = nn.DataParallel(tiny_bert_classifier(seed=5))
    load_state_dict(target, tmp_path / "checkpoint-4")
    assert_same_weights(weights_of(target), weights_of(model), atol=0)


def test_user_balanced_wrapper_settings(tmp_path):
    with simulate_data_parallel(3):
        args = training_args(tmp_path, dp_devices=3, **SAVING)
        wrapped = BalancedDataParallel(tiny_bert_classifier(), gpu0_bsz=1)
        trainer = Trainer(model=wrapped, args=args, train_dataset=classification_rows(8))
        assert trainer.model is wrapped.module
        assert trainer.args.gpu0_bsz == 1
        assert args.gpu0_bsz is None  # the caller's arguments are left as they were

        conflicting = training_args(tmp_path, dp_devices=3, **SAVING, gpu0_bsz=2)
        with pytest.raises(ValueError, match=r"wrapped in BalancedDataParallel\(gpu0_bsz=1\) but the .*=2"):
            Trainer(model=wrapped, args=conflicting, train_dataset=classification_rows(8))
        other = training_args(tmp_path, dp_devices=3, **SAVING, gpu0_weight=0.5)
        with pytest.raises(ValueError, match=r"\(gpu0_bsz=1\) but the TrainingArguments set gpu0_weight=0.5"):
            Trainer(model=wrapped, args=other, train_dataset=classification_rows(8))


def test_check_reload_compares_the_reloaded_logits(tmp_path):
    """check_reload: the saved classifier reloads with the same logits; a model changed after saving does not."""
    trainer = Trainer(
        model=tiny_bert_classifier(0),
        args=training_args(tmp_path, per_device_eval_batch_size=4),
        eval_dataset=classification_rows(4),
    )
    trainer.save_model(str(tmp_path / "saved"))
    assert check_reload(trainer, str(tmp_path / "saved")) == 0.0
    with torch.no_grad():
        trainer.model.classifier.bias.add_(1.0)
    with pytest.raises(AssertionError):
        check_reload(trainer, str(tmp_path / "saved"))
