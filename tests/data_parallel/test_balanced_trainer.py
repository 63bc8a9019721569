"""gpu0_bsz / gpu0_weight in hf_parallel.Trainer, through the DataParallel emulation. The memory callbacks that
advise on them: test_callbacks.py."""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers.training_args import ParallelMode

import hf_parallel
from hf_parallel import Trainer
from hf_parallel.testing import simulate_data_parallel, spawn_cpu_ranks
from tests.helpers import harness
from tests.helpers.compare import assert_losses_close
from tests.helpers.harness import Topology, record_hf_parallel_log, run_case, training_args
from tests.helpers.heads import CLASSIFIER
from tests.helpers.tiny import classification_rows

# Each case: devices, training rows, per-device batch, options, and the chunk sizes of the last training step.
BALANCED_CASES = {
    "gpu0_bsz=1 on 3, 6 rows [1,3,2]": (3, 6, 2, {"gpu0_bsz": 1}, [1, 3, 2]),
    "gpu0_bsz=0 on 3, GPU 0 skipped [3,3]": (3, 6, 2, {"gpu0_bsz": 0}, [3, 3]),
    "gpu0_weight=0.5 on 2, [2,4]": (2, 6, 3, {"gpu0_weight": 0.5}, [2, 4]),
    "short last batch of 1 row [0,1,0]": (3, 7, 2, {"gpu0_bsz": 1}, [1]),
    "gradient accumulation 2": (3, 12, 2, {"gpu0_bsz": 1, "gradient_accumulation_steps": 2}, [1, 3, 2]),
}


@pytest.fixture
def emulations(monkeypatch):
    """Every `Emulation` that `run_case`'s `simulate_data_parallel` blocks yield during the test, in order."""
    recorded = []
    emulate = harness.simulate_data_parallel

    @contextlib.contextmanager
    def recording(n_devices):
        with emulate(n_devices) as emulation:
            recorded.append(emulation)
            yield emulation

    monkeypatch.setattr(harness, "simulate_data_parallel", recording)
    return recorded


class StepSplits(transformers.TrainerCallback):
    """The splits the emulation recorded in each optimizer step: forward inputs, and gradients going back."""

    def __init__(self, emulations):
        self.emulations = emulations
        self.steps = []
        self._recorded = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._recorded = len(self.emulations[-1].chunk_sizes)

    def on_step_end(self, args, state, control, **kwargs):
        sizes = self.emulations[-1].chunk_sizes
        self.steps.append(sizes[self._recorded :])
        self._recorded = len(sizes)


@pytest.mark.parametrize("case", list(BALANCED_CASES))
def test_balanced_training_is_exact(case, emulations):
    n_devices, rows, per_device, options, last_split = BALANCED_CASES[case]
    options = dict(options)
    accumulation = options.pop("gradient_accumulation_steps", 1)
    gpu0_bsz = options.pop("gpu0_bsz", None)
    steps = math.ceil(rows / (per_device * n_devices * accumulation))
    topology = Topology(case, per_device, accumulation, dp_devices=n_devices, gpu0_bsz=gpu0_bsz)
    common = dict(train_rows=rows, eval_rows=5, evaluate_first=False, max_steps=steps)
    splits = StepSplits(emulations)
    result = run_case(CLASSIFIER, topology, **common, callbacks=(splits,), **options)
    trainer = result.trainer
    assert trainer.args.n_gpu == n_devices
    assert trainer.args.parallel_mode == ParallelMode.NOT_DISTRIBUTED
    # The balanced wrapper, over the emulation's virtual devices.
    assert type(trainer.model_wrapped) is hf_parallel.BalancedDataParallel
    assert trainer.model_wrapped.device_ids == list(range(n_devices))
    assert trainer.model_wrapped.module is trainer.model  # evaluate() did not wrap twice
    assert len(splits.steps) == steps
    # Every tensor split in the last step (the inputs, and in backward the gradients) took the balanced split.
    assert splits.steps[-1] and all(split == last_split for split in splits.steps[-1]), splits.steps[-1]
    one_device = Topology("one device", per_device * n_devices, accumulation)
    single = run_case(CLASSIFIER, one_device, **common, per_device_eval_batch_size=2 * n_devices)
    assert len(result.losses) == len(single.losses) == steps
    assert_losses_close(result.losses, single.losses, case)
    assert result.eval_loss == pytest.approx(single.eval_loss, rel=1e-5)
    params, params_1 = result.params, single.params
    for name in params_1:
        torch.testing.assert_close(params[name], params_1[name], rtol=1e-5, atol=1e-6, msg=name)
    initial = dict(CLASSIFIER.build(0).named_parameters())
    assert any(not torch.equal(params_1[n], initial[n]) for n in params_1)  # it trained


def test_the_loss_comparison_still_catches_a_wrong_normalisation(emulations):
    # The short last batch: a step of 6 rows, then one row whose loss is trained down to about 0.002, where float
    # rounding leaves about 5e-5 of it. The comparison is relative to the run's first loss, and still refuses stock's
    # x2 under gradient accumulation 2 (a balanced split has no stock loss to compare: exact_loss=False is refused
    # there), and a last step averaged over 3 devices (x1/3).
    n_devices, rows, per_device, _, _ = BALANCED_CASES["short last batch of 1 row [0,1,0]"]
    common = dict(train_rows=rows, eval_rows=5, evaluate_first=False, max_steps=2)
    stock = run_case(CLASSIFIER, Topology("GA 2", per_device * n_devices // 2, 2), **common, stock=True)
    single = run_case(CLASSIFIER, Topology("one device", per_device * n_devices), **common)
    assert single.losses[1] < 1e-2 * single.losses[0]  # the case the comparison is about
    with pytest.raises(AssertionError, match="step 0"):
        assert_losses_close(stock.losses, single.losses, "stock")
    with pytest.raises(AssertionError, match="step 1"):
        assert_losses_close([single.losses[0], single.losses[1] / n_devices], single.losses, "x1/3")
    assert_losses_close([single.losses[0], single.losses[1] + 1.2e-7], single.losses, "rounding")


def test_evaluation_batches_are_balanced_too(emulations):
    # Training batches of 6 on 3 devices with gpu0_bsz=1 are split [1, 3, 2]; the evaluation batch of 5 rows
    # (per_device_eval_batch_size 2 x 3, 5 rows in the set) is split [1, 2, 2].
    topology = Topology("DP 3, gpu0_bsz=1", per_device=2, dp_devices=3, gpu0_bsz=1)
    trainer = run_case(CLASSIFIER, topology, train_rows=6, eval_rows=0).trainer
    (training,) = emulations
    assert training.chunk_sizes and all(split == [1, 3, 2] for split in training.chunk_sizes), training.chunk_sizes
    seen = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    with simulate_data_parallel(3) as evaluation:
        trainer.evaluate(classification_rows(5, seed=2))
    assert evaluation.chunk_sizes and all(split == [1, 2, 2] for split in evaluation.chunk_sizes)
    assert sorted(evaluation.replica_devices) == [0, 1, 2]
    assert sorted(seen) == [1, 2, 2]  # the replicas run in threads, in any order


def test_stock_loss_with_loss_kwargs_model_is_refused(tmp_path):
    # Stock compute_loss hands BERT (which takes **kwargs) an [n_gpu, 1] num_items_in_batch a balanced split cannot
    # scatter: refuse before training, naming the fix.
    args = training_args(
        tmp_path, dp_devices=2, per_device_train_batch_size=2, max_steps=1, gpu0_bsz=1, exact_loss=False
    )
    with simulate_data_parallel(2):
        trainer = Trainer(model=CLASSIFIER.build(0), args=args, train_dataset=classification_rows(4))
        with pytest.raises(ValueError, match=r"gpu0_bsz=1 with exact_loss=False.*Set exact_loss=True"):
            trainer.train()


class Regressor(torch.nn.Module):
    """A model without loss kwargs (no **kwargs), so the stock loss runs under a balanced split."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 1)
        self.chunk_means = []  # (rows, mean loss) of each replica's chunk, in the order the threads ran

    def forward(self, x, labels=None):
        pred = self.linear(x).squeeze(-1)
        loss = ((pred - labels) ** 2).mean()
        self.chunk_means.append((len(x), loss.item()))
        return {"loss": loss, "pred": pred}


def test_stock_loss_under_balanced_split_is_the_mean_of_chunk_means_with_a_warning(tmp_path, hf_parallel_log):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, generator=g) * 3
    data = [{"x": x[i], "labels": y[i]} for i in range(6)]
    # The loss logged at step 1: the mean the stock loss gave before the update.
    options = dict(per_device_train_batch_size=2, max_steps=1, logging_steps=1, gpu0_bsz=1, exact_loss=False)
    args = training_args(tmp_path, dp_devices=3, **options)
    model = Regressor()
    with simulate_data_parallel(3) as emulation:
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    assert "averages the per-GPU mean losses" in hf_parallel_log.text
    assert type(trainer.model_wrapped) is hf_parallel.BalancedDataParallel
    assert emulation.chunk_sizes[:2] == [[1, 3, 2], [1, 3, 2]]  # x and labels
    logged = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert sorted(rows for rows, _ in model.chunk_means) == [1, 2, 3]
    means = [mean for _, mean in model.chunk_means]
    assert logged == pytest.approx(sum(means) / 3, rel=1e-5)  # stock: the mean of the 3 chunk means
    exact = sum(rows * mean for rows, mean in model.chunk_means) / 6
    assert abs(logged / exact - 1) > 0.05  # ... which is not the batch mean (x0.926 with this seed)


def test_ignored_on_one_device_with_one_warning(hf_parallel_log):
    topology = Topology("one device, gpu0_bsz=1", per_device=2, gpu0_bsz=1)
    result = run_case(CLASSIFIER, topology, train_rows=4, eval_rows=2, evaluate_first=False, max_steps=2)
    assert hf_parallel_log.text.count("gpu0_bsz=1 is ignored") == 1, hf_parallel_log.text
    assert "one device" in hf_parallel_log.text
    trainer = result.trainer
    assert trainer.model_wrapped is trainer.model  # not wrapped at all


def test_without_options_the_even_split_wrapper_is_used(emulations):
    # Where stock wraps in nn.DataParallel, hf_parallel.Trainer (exact loss) wraps in ExactDataParallel: torch's
    # split, not a balanced one.
    result = run_case(CLASSIFIER, Topology("DP 2", per_device=2, dp_devices=2), train_rows=4, eval_rows=0)
    assert result.wrapped == "ExactDataParallel"
    assert type(result.trainer.model_wrapped) is hf_parallel.ExactDataParallel
    (emulation,) = emulations
    assert emulation.chunk_sizes and all(split == [2, 2] for split in emulation.chunk_sizes)
    stock = run_case(CLASSIFIER, Topology("DP 2", per_device=2, dp_devices=2), stock=True, train_rows=4, eval_rows=0)
    assert stock.wrapped == "DataParallel"


def _ddp_worker(output_dir):
    args = training_args(output_dir, per_device_train_batch_size=2, max_steps=1, gpu0_bsz=1)
    with record_hf_parallel_log() as log:
        trainer = Trainer(model=CLASSIFIER.build(0), args=args, train_dataset=classification_rows(8))
        assert args.world_size == 2 and args.parallel_mode == ParallelMode.DISTRIBUTED
        trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    assert "gpu0_bsz=1 is ignored" in log.text and "DDP" in log.text
    for name, param in trainer.model.named_parameters():
        gathered = [torch.empty_like(param) for _ in range(2)]
        dist.all_gather(gathered, param.detach().contiguous())
        torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0, msg=name)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.full  # two spawned processes (~5 s): .ci/run runs it in its own step
def test_ignored_under_ddp(tmp_path):
    spawn_cpu_ranks(_ddp_worker, (str(tmp_path),), 2)
