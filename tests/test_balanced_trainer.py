"""gpu0_bsz / gpu0_weight in hf_parallel.Trainer (through the DataParallel simulation) and the memory callbacks."""

import inspect
import math

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers import BertForSequenceClassification, TrainerState
from transformers.testing_utils import CaptureLogger
from transformers.training_args import ParallelMode

import hf_parallel
from hf_parallel import (
    Gpu0BszAdvisorCallback,
    PeakMemoryCallback,
    Trainer,
    TrainingArguments,
    suggest_gpu0_bsz,
)
from hf_parallel.testing import CpuTransport, simulate_data_parallel, simulated_training_args
from tests.tiny import classification_rows, tiny_bert_config


def _model():
    # A large initializer range so per-row losses differ (near-uniform logits would hide a wrong average).
    torch.manual_seed(0)
    return BertForSequenceClassification(tiny_bert_config(num_labels=2, initializer_range=0.5))


def _arguments(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        learning_rate=0.1,
        optim="sgd",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    base.update(kw)
    return base


def _run(tmp_path, n_devices, rows, eval_rows=0, callbacks=(), **kw):
    """Train (and evaluate) tiny BERT with hf_parallel.Trainer on one process, or under simulated DataParallel."""
    model = _model()
    data = classification_rows(rows, seed=1)
    eval_data = classification_rows(eval_rows, seed=2) if eval_rows else None
    if n_devices == 1:
        args = TrainingArguments(use_cpu=True, **_arguments(tmp_path, **kw))
        trainer = Trainer(
            model=model, args=args, train_dataset=data, eval_dataset=eval_data, callbacks=list(callbacks)
        )
        trainer.train()
        metrics = trainer.evaluate() if eval_rows else {}
    else:
        args = simulated_training_args(n_devices, **_arguments(tmp_path, **kw))
        with simulate_data_parallel(n_devices):
            trainer = Trainer(
                model=model, args=args, train_dataset=data, eval_dataset=eval_data, callbacks=list(callbacks)
            )
            trainer.train()
            metrics = trainer.evaluate() if eval_rows else {}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return trainer, losses, metrics, params


# Each case: devices, training rows, per-device batch, options, and the chunk sizes of the last training step.
BALANCED_CASES = {
    "gpu0_bsz=1 on 3, 6 rows [1,3,2]": (3, 6, 2, {"gpu0_bsz": 1}, [1, 3, 2]),
    "gpu0_bsz=0 on 3, GPU 0 skipped [3,3]": (3, 6, 2, {"gpu0_bsz": 0}, [3, 3]),
    "gpu0_weight=0.5 on 2, [2,4]": (2, 6, 3, {"gpu0_weight": 0.5}, [2, 4]),
    "short last batch of 1 row [0,1,0]": (3, 7, 2, {"gpu0_bsz": 1}, [1]),
    "gradient accumulation 2": (3, 12, 2, {"gpu0_bsz": 1, "gradient_accumulation_steps": 2}, [1, 3, 2]),
}


@pytest.mark.parametrize("case", list(BALANCED_CASES))
def test_balanced_training_is_exact(case, tmp_path):
    n_devices, rows, per_device, options, last_chunks = BALANCED_CASES[case]
    accumulation = options.get("gradient_accumulation_steps", 1)
    steps = math.ceil(rows / (per_device * n_devices * accumulation))
    common = dict(max_steps=steps, per_device_eval_batch_size=2)
    trainer, losses, metrics, params = _run(
        tmp_path, n_devices, rows, eval_rows=5, per_device_train_batch_size=per_device, **options, **common
    )
    assert trainer.args.n_gpu == n_devices
    assert trainer.args.parallel_mode == ParallelMode.NOT_DISTRIBUTED
    # The balanced wrapper, over the CPU transport of the simulated torch.nn.DataParallel.
    assert isinstance(trainer.model_wrapped, hf_parallel.BalancedDataParallel)
    assert isinstance(trainer.model_wrapped.transport, CpuTransport)
    assert trainer.model_wrapped.module is trainer.model  # evaluate() did not wrap twice
    single_options = {k: v for k, v in options.items() if k == "gradient_accumulation_steps"}
    _, losses_1, metrics_1, params_1 = _run(
        tmp_path,
        1,
        rows,
        eval_rows=5,
        per_device_train_batch_size=per_device * n_devices,
        **single_options,
        max_steps=steps,
        per_device_eval_batch_size=2 * n_devices,
    )
    assert len(losses) == len(losses_1) == steps
    for step, (ours, single) in enumerate(zip(losses, losses_1, strict=True)):
        assert ours == pytest.approx(single, rel=1e-5), f"logged loss of step {step}"
    assert metrics["eval_loss"] == pytest.approx(metrics_1["eval_loss"], rel=1e-5)
    for name in params_1:
        torch.testing.assert_close(params[name], params_1[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(params_1[n], _model().state_dict()[n]) for n in params_1)  # it trained


def test_evaluation_batches_are_balanced_too(tmp_path):
    # Training batches of 6 on 3 devices with gpu0_bsz=1 are split [1, 3, 2]; the evaluation batch of 5 rows
    # (per_device_eval_batch_size 2 x 3, 5 rows in the set) is split [1, 2, 2].
    trainer, *_ = _run(tmp_path, 3, 6, per_device_train_batch_size=2, gpu0_bsz=1, max_steps=1)
    assert trainer.model_wrapped.transport.last_chunk_sizes == [1, 3, 2]
    seen = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    with simulate_data_parallel(3):
        trainer.evaluate(classification_rows(5, seed=2))
    assert seen == [1, 2, 2]


def test_stock_loss_with_loss_kwargs_model_is_refused(tmp_path):
    # Stock compute_loss hands BERT (which takes **kwargs) an [n_gpu, 1] num_items_in_batch a balanced split cannot
    # scatter: refuse before training, naming the fix.
    args = simulated_training_args(
        2, **_arguments(tmp_path, per_device_train_batch_size=2, max_steps=1, gpu0_bsz=1, exact_loss=False)
    )
    with simulate_data_parallel(2):
        trainer = Trainer(model=_model(), args=args, train_dataset=classification_rows(4))
        with pytest.raises(ValueError, match=r"gpu0_bsz=1 with exact_loss=False.*Set exact_loss=True"):
            trainer.train()


class Regressor(torch.nn.Module):
    """A model without loss kwargs (no **kwargs), so the stock loss runs under a balanced split."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 1)
        self.chunk_means = []

    def forward(self, x, labels=None):
        pred = self.linear(x).squeeze(-1)
        loss = ((pred - labels) ** 2).mean()
        self.chunk_means.append(loss.item())
        return {"loss": loss, "pred": pred}


def test_stock_loss_under_balanced_split_is_the_mean_of_chunk_means_with_a_warning(tmp_path):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, generator=g) * 3
    data = [{"x": x[i], "labels": y[i]} for i in range(6)]
    args = simulated_training_args(
        3, **_arguments(tmp_path, per_device_train_batch_size=2, max_steps=1, gpu0_bsz=1, exact_loss=False)
    )
    logger = transformers.utils.logging.get_logger("hf_parallel")
    transformers.utils.logging.set_verbosity_warning()
    if hasattr(logger.warning_once, "cache_clear"):
        logger.warning_once.cache_clear()
    model = Regressor()
    with simulate_data_parallel(3), CaptureLogger(logger) as captured:
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    assert "averages the per-GPU mean losses" in captured.out
    assert trainer.model_wrapped.transport.last_chunk_sizes == [1, 3, 2]
    logged = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert len(model.chunk_means) == 3
    assert logged == pytest.approx(sum(model.chunk_means) / 3, rel=1e-5)  # stock: the mean of the 3 chunk means
    exact = (model.chunk_means[0] * 1 + model.chunk_means[1] * 3 + model.chunk_means[2] * 2) / 6
    assert abs(logged / exact - 1) > 0.05  # ... which is not the batch mean (x0.926 with this seed)


def test_ignored_on_one_device_with_one_warning(tmp_path):
    logger = transformers.utils.logging.get_logger("hf_parallel")
    transformers.utils.logging.set_verbosity_warning()
    if hasattr(logger.warning_once, "cache_clear"):
        logger.warning_once.cache_clear()  # warning_once is cached per message for the whole process
    with CaptureLogger(logger) as captured:
        trainer, *_ = _run(tmp_path, 1, 4, eval_rows=2, per_device_train_batch_size=2, gpu0_bsz=1, max_steps=2)
    assert captured.out.count("gpu0_bsz=1 is ignored") == 1, captured.out
    assert "one device" in captured.out
    assert trainer.model_wrapped is trainer.model  # not wrapped at all


def test_wrap_model_keeps_the_upstream_signature():
    upstream = inspect.signature(transformers.Trainer._wrap_model)
    ours = inspect.signature(Trainer._wrap_model)
    assert list(upstream.parameters) == ["self", "model", "training", "dataloader"], "transformers changed it"
    assert list(ours.parameters) == list(upstream.parameters)
    for param in upstream.parameters.values():
        assert ours.parameters[param.name].default == param.default, param.name


def test_without_options_the_stock_wrapper_is_used(tmp_path):
    trainer, *_ = _run(tmp_path, 2, 4, per_device_train_batch_size=2, max_steps=1)
    assert type(trainer.model_wrapped).__name__ == "SimulatedDataParallel"


def _ddp_worker(output_dir):
    args = TrainingArguments(
        use_cpu=True, **_arguments(output_dir, per_device_train_batch_size=2, max_steps=1, gpu0_bsz=1)
    )
    logger = transformers.utils.logging.get_logger("hf_parallel")
    with CaptureLogger(logger) as captured:
        trainer = Trainer(model=_model(), args=args, train_dataset=classification_rows(8))
        assert args.world_size == 2 and args.parallel_mode == ParallelMode.DISTRIBUTED
        trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    assert "gpu0_bsz=1 is ignored" in captured.out and "DDP" in captured.out
    for name, param in trainer.model.named_parameters():
        gathered = [torch.empty_like(param) for _ in range(2)]
        dist.all_gather(gathered, param.detach().contiguous())
        torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0, msg=name)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes, each importing transformers: ~40 s on the 2-core CI machine
def test_ignored_under_ddp(tmp_path):
    from hf_parallel.testing import spawn_cpu_ranks as spawn_ranks

    transformers.utils.logging.set_verbosity_warning()
    logger = transformers.utils.logging.get_logger("hf_parallel")
    if hasattr(logger.warning_once, "cache_clear"):
        logger.warning_once.cache_clear()
    spawn_ranks(_ddp_worker, (str(tmp_path),), 2)


# ---- Memory callbacks and the advisor ----


def test_callbacks_do_nothing_on_cpu(tmp_path):
    advisor = Gpu0BszAdvisorCallback(after_steps=1)
    trainer, *_ = _run(
        tmp_path, 2, 8, per_device_train_batch_size=2, max_steps=2, callbacks=[PeakMemoryCallback(), advisor]
    )
    assert not any(key.startswith("peak_memory") for h in trainer.state.log_history for key in h)
    assert advisor.suggestion is None and advisor.measured == {}


class FakeCuda:
    """Stands in for torch.cuda's memory statistics, for the callbacks' plumbing on a machine without GPUs."""

    def __init__(self, monkeypatch, peaks):
        self.peaks = dict(enumerate(peaks))
        self.resets = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: self.peaks[d])
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.resets.append)


def test_peak_memory_logged_per_device_and_reset(monkeypatch, tmp_path):
    fake = FakeCuda(monkeypatch, [3 * 2**30, 2**30])
    args = simulated_training_args(2, output_dir=str(tmp_path))
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


def test_advisor_callback_suggests_once(monkeypatch, tmp_path):
    model = _model()
    static = sum(p.numel() * p.element_size() for p in [*model.parameters(), *model.buffers()])
    # Rows [8, 8]: GPU 0 peaks 2 MiB + 8 rows x 64 KiB above GPU 1, i.e. 32 rows' worth: move 16 rows.
    per_row = 64 * 2**10
    fake = FakeCuda(monkeypatch, [static + 8 * per_row + 2 * 2**20, static + 8 * per_row])
    args = simulated_training_args(2, output_dir=str(tmp_path), per_device_train_batch_size=8)
    advisor = Gpu0BszAdvisorCallback(after_steps=2)
    state = TrainerState()
    state.global_step = 1
    advisor.on_step_end(args, state, None, model=model)
    assert advisor.measured is None  # not yet
    state.global_step = 2
    advisor.on_step_end(args, state, None, model=model)
    assert advisor.measured["rows"] == [8, 8]
    assert advisor.suggestion == suggest_gpu0_bsz(list(map(float, fake.peaks.values())), [8, 8], float(static))
    assert advisor.suggestion == 0  # 2 MiB / 64 KiB = 32 rows: even GPU 0 with none is still the heavier
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
    args = simulated_training_args(3, output_dir=str(tmp_path), per_device_train_batch_size=4, gpu0_bsz=2)
    advisor = Gpu0BszAdvisorCallback(after_steps=1)
    state = TrainerState()
    state.global_step = 1
    advisor.on_step_end(args, state, None, model=None)
    assert advisor.measured["rows"] == [2, 5, 5]
    # Equal peaks under the split in use: it already evens memory out, so the advice is the gpu0_bsz in use.
    assert advisor.suggestion == suggest_gpu0_bsz([10.0, 10.0, 10.0], [2, 5, 5]) == 2


def test_public_names():
    for name in ("PeakMemoryCallback", "Gpu0BszAdvisorCallback", "suggest_gpu0_bsz"):
        assert name in hf_parallel.__all__ and hasattr(hf_parallel, name)
