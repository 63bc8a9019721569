"""
The callbacks. CleanCheckpointCallback: the stock `transformers.Trainer` given a wrapped model writes clean
checkpoints and resumes from them. PeakMemoryCallback and Gpu0BszAdvisorCallback: peak memory per GPU and the
gpu0_bsz that evens it out, measured through a stand-in for torch.cuda's statistics (no GPU here).
"""

import json
import os

import pytest
import safetensors.torch
import torch
import transformers
from torch import nn
from transformers import TrainerControl, TrainerState

from hf_parallel import CleanCheckpointCallback, Gpu0BszAdvisorCallback, PeakMemoryCallback, suggest_gpu0_bsz
from hf_parallel.exact import ExactLoss
from hf_parallel.exact.compare import ReplicaCheck, candidate_heads
from hf_parallel.saving.checkpoints import checkpoint_weight_files, stored_keys
from hf_parallel.testing import simulate_data_parallel
from tests.helpers.harness import Topology, assert_same_weights, run_case, training_args, weights_of
from tests.helpers.heads import CLASSIFIER
from tests.helpers.setups import assert_clean_checkpoint, setup_case
from tests.helpers.tiny import tiny_bert_classifier

NAN = float("nan")


@pytest.mark.parametrize("case", ["user_dp", "user_compiled"])
def test_callback_cleans_stock_checkpoints(case, tmp_path, hf_parallel_log):
    kw = dict(trainer_cls=transformers.Trainer, args_cls=transformers.TrainingArguments, remove_unused_columns=False)
    callback = CleanCheckpointCallback()
    with setup_case(case, tmp_path / "run", callbacks=[callback], **kw) as (stock, model):
        stock.train()
        final = weights_of(model)
    assert callback.rewritten == [str(tmp_path / "run" / f"checkpoint-{s}") for s in (2, 4)]
    assert_clean_checkpoint(tmp_path / "run" / "checkpoint-2", model, same_step=False)
    assert_clean_checkpoint(tmp_path / "run" / "checkpoint-4", model)

    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    if case == "user_dp":
        assert "cannot resume from them into the wrapper" in hf_parallel_log.text
        # The documented way: stock gets the bare model (and wraps it itself on several GPUs).
        with setup_case("dp", tmp_path / "bare", seed=1, callbacks=[CleanCheckpointCallback()], **kw) as (resumed, _):
            resumed.train(resume_from_checkpoint=checkpoint)
            assert_same_weights(weights_of(resumed.model), final)
        return
    # Stock resumes the compiled wrapper non-strictly, matching no clean key; the callback loads the checkpoint.
    with setup_case(case, tmp_path / "run", seed=1, callbacks=[CleanCheckpointCallback()], **kw) as (resumed, _):
        resumed.train(resume_from_checkpoint=checkpoint)
        assert_same_weights(weights_of(resumed.model), final)
    with setup_case(case, tmp_path / "run", seed=1, **kw) as (control, _):  # without the callback
        control.train(resume_from_checkpoint=checkpoint)
        control_final = weights_of(control.model)
    assert (control_final["classifier.weight"] - final["classifier.weight"]).abs().max() > 1e-3


def test_callback_leaves_clean_checkpoints_alone(tmp_path):
    callback = CleanCheckpointCallback()
    kw = dict(trainer_cls=transformers.Trainer, args_cls=transformers.TrainingArguments)
    with setup_case("plain", tmp_path, callbacks=[callback], **kw) as (stock, _):
        stock.train()
    assert callback.rewritten == []


def test_callback_replaces_every_file_of_a_sharded_prefixed_checkpoint(tmp_path, no_gpus):
    # no_gpus: the nn.DataParallel below stays on the CPU; with one GPU it would move the model to it.
    model = tiny_bert_classifier()
    checkpoint = tmp_path / "checkpoint-3"
    model.save_pretrained(checkpoint, max_shard_size="4KB")
    # The checkpoint a stock Trainer holding nn.DataParallel(model) would write: every key under `module.`.
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = safetensors.torch.load_file(checkpoint / shard)
        safetensors.torch.save_file({"module." + k: v for k, v in tensors.items()}, checkpoint / shard)
    index["weight_map"] = {"module." + k: v for k, v in index["weight_map"].items()}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    shards = [p for p in checkpoint_weight_files(checkpoint, shards=True) if not p.endswith(".json")]
    assert len(shards) > 1

    callback = CleanCheckpointCallback()
    args = training_args(tmp_path, args_cls=transformers.TrainingArguments)
    callback.on_save(args, TrainerState(global_step=3), TrainerControl(), model=nn.DataParallel(model))
    assert callback.rewritten == [str(checkpoint)]
    assert checkpoint_weight_files(checkpoint, shards=True) == [str(checkpoint / "model.safetensors")]
    assert not any(os.path.exists(p) for p in shards)  # no stale shard of the prefixed weights is left behind
    assert sorted(stored_keys(checkpoint / "model.safetensors")) == sorted(model.state_dict())
    assert_clean_checkpoint(checkpoint, model)


# ---- PeakMemoryCallback and Gpu0BszAdvisorCallback ----


def test_callbacks_do_nothing_on_cpu(no_gpus):
    # Emulated DataParallel reports n_gpu=2: on a machine with GPUs the callbacks would measure real ones.
    advisor = Gpu0BszAdvisorCallback(after_steps=1)
    topology = Topology("DP 2", per_device=2, dp_devices=2)
    callbacks = (PeakMemoryCallback(), advisor)
    trainer = run_case(CLASSIFIER, topology, train_rows=8, eval_rows=0, max_steps=2, callbacks=callbacks).trainer
    assert not any(key.startswith("peak_memory") for h in trainer.state.log_history for key in h)
    assert advisor.suggestion is None and advisor.measured == {}
    assert trainer.exact.checks_settled  # a classifier's one candidate head: decided at the first step
    assert advisor.exact is trainer.exact  # handed over by train(): the advisor waits for the check


class FakeCuda:
    """Stands in for torch.cuda's memory statistics, for the callbacks' plumbing on a machine without GPUs."""

    def __init__(self, monkeypatch, peaks):
        self.peaks = dict(enumerate(peaks))
        self.resets = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.peaks))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: self.peaks[d])
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.resets.append)


def _steps(callback, args, last: int, model=None, first: int = 1) -> None:
    """The callback's on_step_end for optimizer steps `first`..`last`."""
    state = TrainerState()
    for step in range(first, last + 1):
        state.global_step = step
        callback.on_step_end(args, state, None, model=model)


def test_peak_memory_logged_per_device_and_reset(monkeypatch, tmp_path):
    fake = FakeCuda(monkeypatch, [3 * 2**30, 2**30])
    args = training_args(tmp_path, dp_devices=2)
    state = TrainerState()
    state.log_history.append({"loss": 1.0, "step": 1})
    logs = {"loss": 1.0}
    PeakMemoryCallback().on_log(args, state, None, logs=logs)
    assert logs == {"loss": 1.0, "peak_memory_gpu0_mib": 3072.0, "peak_memory_gpu1_mib": 1024.0}
    assert state.log_history[-1]["peak_memory_gpu1_mib"] == 1024.0
    assert fake.resets == [0, 1]
    logs = {}
    PeakMemoryCallback(reset=False).on_log(args, state, None, logs=logs)
    assert fake.resets == [0, 1] and logs["peak_memory_gpu0_mib"] == 3072.0


def test_peak_memory_and_advisor_read_the_devices_of_the_wrapper(monkeypatch, tmp_path):
    # The stock Trainer handed nn.DataParallel(model, device_ids=[1, 2]) on 3 GPUs holds that wrapper (callbacks get
    # it as `model`): its replicas run on GPUs 1 and 2 only, and the per-step batch of 3 x 4 rows is split in two.
    with simulate_data_parallel(3):
        wrapper = nn.DataParallel(nn.Linear(2, 2), device_ids=[1, 2])
    fake = FakeCuda(monkeypatch, [5 * 2**20, 2**20, 2**20])
    args = training_args(tmp_path, dp_devices=3, per_device_train_batch_size=4)
    logs = {}
    PeakMemoryCallback().on_log(args, TrainerState(), None, logs=logs, model=wrapper)
    assert logs == {"peak_memory_gpu1_mib": 1.0, "peak_memory_gpu2_mib": 1.0}
    assert fake.resets == [1, 2]
    advisor = Gpu0BszAdvisorCallback(after_steps=1)
    _steps(advisor, args, 2, model=wrapper)
    assert advisor.measured["rows"] == [6, 6] and advisor.measured["peaks"] == [2**20, 2**20]


def test_two_replicas_on_one_gpu_read_one_device(monkeypatch, tmp_path):
    # n_gpu=2 over device_ids [0, 0] (torch's DataParallel on one GPU): one device to read, not a device 1 (on a GPU
    # machine reading it fails with "invalid device ordinal"), and nothing to balance.
    FakeCuda(monkeypatch, [3 * 2**20])
    args = training_args(tmp_path, dp_devices=2)
    logs = {}
    PeakMemoryCallback().on_log(args, TrainerState(), None, logs=logs)
    assert logs == {"peak_memory_gpu0_mib": 3.0}
    advisor = Gpu0BszAdvisorCallback(after_steps=1)
    _steps(advisor, args, 2)
    assert advisor.measured == {} and advisor.suggestion is None


def _check(fit: float, loss: float) -> ReplicaCheck:
    """A checked forward's verdicts: its one candidate fits as `fit` (NaN: not compared), the losses being `loss`."""
    unknown = torch.full((1, 1), NAN)
    return ReplicaCheck(
        fits=torch.tensor([[fit]]), losses=torch.tensor([[loss, loss]]).double(), honours=unknown, decoder=unknown
    )


def test_advisor_measures_after_the_exact_loss_check_settles(monkeypatch, tmp_path):
    # The check's forward keeps the labels (several logits-sized buffers per replica in backward): the advisor waits
    # for trainer.exact's check to settle, resets the peaks then, and measures the steps after it.
    model = CLASSIFIER.build(0)
    exact = ExactLoss(label_names=["labels"])
    head = exact.head(model, {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.tensor([0, 1])})
    candidates = candidate_heads(head)
    undecided, decided = _check(NAN, NAN), _check(1.0, 0.7)
    fake = FakeCuda(monkeypatch, [3 * 2**20, 2**20])
    args = training_args(tmp_path, dp_devices=2, per_device_train_batch_size=4)
    advisor = Gpu0BszAdvisorCallback(after_steps=1, exact=exact)
    exact.settle(candidates, model, undecided)  # step 1: no comparison possible, checked again at step 2
    assert not exact.checks_settled
    _steps(advisor, args, 1, model=model)
    assert advisor.measured is None and fake.resets == []  # step 2 carries the check: not measured
    exact.settle(candidates, model, decided)  # step 2: decided
    assert exact.checks_settled
    _steps(advisor, args, 2, model=model, first=2)
    assert advisor.measured is None and fake.resets == [0, 1]  # the peaks of steps 1 and 2 are dropped
    _steps(advisor, args, 3, model=model, first=3)
    assert advisor.measured["steps"] == (3, 3) and advisor.measured["peaks"] == [3 * 2**20, 2**20]
    assert advisor.suggestion is not None


def test_advisor_callback_suggests_once(monkeypatch, tmp_path):
    model = CLASSIFIER.build(0)
    model.bert.embeddings.requires_grad_(False)
    # A replica holds its parameters and buffers, and a gradient for each trainable parameter during backward.
    params = [*model.parameters()]
    static = sum(t.numel() * t.element_size() for t in [*params, *model.buffers()])
    static += sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    # Rows [8, 8]: GPU 0 peaks 2 MiB + 8 rows x 64 KiB above GPU 1, i.e. 32 rows' worth: move 16 rows.
    per_row = 64 * 2**10
    fake = FakeCuda(monkeypatch, [static + 8 * per_row + 2 * 2**20, static + 8 * per_row])
    args = training_args(tmp_path, dp_devices=2, per_device_train_batch_size=8)
    advisor = Gpu0BszAdvisorCallback(after_steps=2)
    _steps(advisor, args, 1, model=model)
    assert advisor.measured is None and fake.resets == [0, 1]  # the first step's peak (optimizer state) is dropped
    _steps(advisor, args, 2, model=model, first=2)
    assert advisor.measured is None  # not yet
    _steps(advisor, args, 3, model=model, first=3)
    assert advisor.measured["steps"] == (2, 3) and advisor.measured["rows"] == [8, 8]
    assert advisor.measured["static"] == static
    assert advisor.suggestion == suggest_gpu0_bsz(list(map(float, fake.peaks.values())), [8, 8], float(static))
    assert advisor.suggestion == 0  # 2 MiB / 64 KiB = 32 rows: even GPU 0 with none is still the heavier
    state = TrainerState()
    logs = {}
    advisor.on_log(args, state, None, logs=logs)
    assert logs == {"gpu0_bsz_suggested": 0}
    logs = {}
    advisor.on_log(args, state, None, logs=logs)
    assert logs == {}  # logged once
    with pytest.raises(ValueError, match="after_steps"):
        Gpu0BszAdvisorCallback(after_steps=0)


def test_advisor_uses_the_balanced_split_in_use(monkeypatch, tmp_path):
    FakeCuda(monkeypatch, [10.0, 10.0, 10.0])
    args = training_args(tmp_path, dp_devices=3, per_device_train_batch_size=4, gpu0_bsz=2)
    advisor = Gpu0BszAdvisorCallback(after_steps=1)
    _steps(advisor, args, 2)
    assert advisor.measured["rows"] == [2, 5, 5]
    # Equal peaks under the split in use: it already evens memory out, so the advice is the gpu0_bsz in use.
    assert advisor.suggestion == suggest_gpu0_bsz([10.0, 10.0, 10.0], [2, 5, 5]) == 2


def test_advisor_says_when_no_gpu0_bsz_evens_the_load(monkeypatch, tmp_path, hf_parallel_log):
    gib = 2**30
    args = training_args(tmp_path, dp_devices=4, per_device_train_batch_size=8)
    # Rows [8, 8, 8, 8], no static part: a row costs 30/8 GiB, so GPU 0 with no rows would still peak at 80 - 30 =
    # 50 GiB, above the 30 + 30/8 x (32/3 - 8) = 40 GiB the others would reach with all 32 rows.
    FakeCuda(monkeypatch, [80 * gib, 30 * gib, 30 * gib, 30 * gib])
    advisor = Gpu0BszAdvisorCallback(after_steps=1)
    _steps(advisor, args, 2)
    assert advisor.suggestion == 0  # the closest value, still logged
    assert "even gpu0_bsz=0 leaves GPU 0 highest (about 50.00 GiB vs 40.00 GiB" in hf_parallel_log.text
    assert "use DDP" in hf_parallel_log.text and "should even it out" not in hf_parallel_log.text
    logs = {}
    advisor.on_log(args, TrainerState(), None, logs=logs)
    assert logs == {"gpu0_bsz_suggested": 0}
    # Control: a GPU 0 only 10 GiB higher can be evened out, and the message says so.
    FakeCuda(monkeypatch, [40 * gib, 30 * gib, 30 * gib, 30 * gib])
    advisor = Gpu0BszAdvisorCallback(after_steps=1)
    _steps(advisor, args, 2)
    assert advisor.suggestion == 6  # GPU 0 at 40 - 30/8 x 2 = 32.5 GiB, the others at 30 + 30/8 x 2/3 = 32.5 GiB
    assert f"gpu0_bsz={advisor.suggestion} should even it out (batches of 32 rows)" in hf_parallel_log.text
