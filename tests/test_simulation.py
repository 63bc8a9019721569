"""The CPU simulation of nn.DataParallel (hf_parallel.testing) against torch's own scatter/gather and stock Trainer."""

import dataclasses
from collections import namedtuple

import pytest
import torch
import transformers
from torch.nn.parallel import scatter_gather
from transformers.modeling_outputs import SequenceClassifierOutput

from hf_parallel.data_parallel import torch_chunk_sizes
from hf_parallel.testing import (
    SimulatedDataParallel,
    simulate_data_parallel,
    simulated_gather,
    simulated_scatter,
    simulated_scatter_kwargs,
    simulated_training_args,
)
from tests.harness import Topology, run_case
from tests.heads import CLASSIFIER

Pair = namedtuple("Pair", ["first", "second"])


class _CpuScatter:
    """Stands in for torch's Scatter autograd function on CPU: `comm.scatter` without chunk sizes is `tensor.chunk`
    (`torch.nn.parallel.comm.scatter`), so torch's own structure walking in `torch.nn.parallel.scatter_gather` can run
    here."""

    @staticmethod
    def apply(target_gpus, chunk_sizes, dim, tensor):
        assert chunk_sizes is None
        return tensor.chunk(len(target_gpus), dim)


class _CpuGather:
    @staticmethod
    def apply(target_device, dim, *tensors):
        return torch.cat([t.view(1) if t.dim() == 0 else t for t in tensors], dim)


def _same(a, b):
    """Structural equality with tensors compared by value (and tuples/lists by type)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


NON_TENSOR_INPUTS = [
    (1, "text", None, True),
    ({"k": [None, 2], "flag": False}, (), [], {}),
    (Pair(first=None, second=[1, (2, 3)]),),
    ({},),
]


@pytest.mark.parametrize("inputs", NON_TENSOR_INPUTS)
@pytest.mark.parametrize("n_devices", [1, 2, 4])
def test_scatter_of_non_tensors_matches_torch(inputs, n_devices):
    # No tensor inside: torch's scatter runs on CPU as it is.
    expected = scatter_gather.scatter(inputs, list(range(n_devices)))
    assert _same(simulated_scatter(inputs, n_devices), expected)


TENSOR_CASES = {
    # name: (positional inputs, keyword inputs, devices)
    "6 rows on 4 devices chunk [2,2,2]": ((torch.arange(6.0).view(6, 1),), {}, 4),
    "5 rows on 4 devices chunk [2,2,1]": ((), {"x": torch.arange(5.0), "flag": True, "none": None}, 4),
    "1 row on 3 devices": ((torch.ones(1, 2),), {"mask": torch.ones(1, 2)}, 3),
    "kwargs only": ((), {"input_ids": torch.arange(8).view(4, 2), "labels": torch.arange(4)}, 2),
    "zip drops rows of the longer tensor": ((), {"x": torch.arange(6.0), "y": torch.arange(2.0)}, 4),
    "[n_gpu, 1] num_items with 3 rows on 2": ((), {"x": torch.arange(3.0), "num_items_in_batch": torch.ones(2, 1)}, 2),
    "more positional chunks than kwargs": ((torch.arange(4.0),), {"flag": True}, 4),
    "positional fewer chunks than kwargs": ((torch.arange(2.0),), {"x": torch.arange(4.0)}, 4),
    "nested dict, list, namedtuple": (
        ({"a": [torch.arange(4.0), None], "p": Pair(torch.arange(4.0), "s")},),
        {"t": (torch.zeros(4, 3), 7)},
        2,
    ),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_scatter_kwargs_matches_torch_structure_code(case, monkeypatch):
    inputs, kwargs, n_devices = TENSOR_CASES[case]
    monkeypatch.setattr(scatter_gather, "Scatter", _CpuScatter)
    expected = scatter_gather.scatter_kwargs(inputs, kwargs, list(range(n_devices)), 0)
    assert _same(simulated_scatter_kwargs(inputs, kwargs, n_devices), expected)


def test_scatter_kwargs_zip_truncation_is_reproduced():
    # torch zips without strict: 6 rows give 3 chunks, the 2-row tensor 2 chunks, so only 2 replicas run and
    # rows 4 and 5 of x are silently dropped. The simulation must show the same loss of rows.
    _, kwargs = simulated_scatter_kwargs((), {"x": torch.arange(6.0), "y": torch.arange(2.0)}, 4)
    assert [k["x"].tolist() for k in kwargs] == [[0.0, 1.0], [2.0, 3.0]]


def test_chunk_sizes_follow_tensor_chunk():
    for rows in range(0, 21):
        for n_devices in range(1, 6):
            expected = [c.shape[0] for c in torch.arange(rows).chunk(n_devices)]
            assert [c.shape[0] for c in simulated_scatter(torch.arange(rows), n_devices)] == expected
            assert torch_chunk_sizes(rows, n_devices) == expected, (rows, n_devices)
    assert torch_chunk_sizes(6, 4) == [2, 2, 2]
    assert torch_chunk_sizes(5, 4) == [2, 2, 1]


GATHER_CASES = {
    "tensors": [torch.ones(2, 3), torch.zeros(1, 3)],
    "0-dim to vector": [torch.tensor(1.5), torch.tensor(2.5), torch.tensor(3.5)],
    "dict": [
        {"loss": torch.tensor(1.0), "logits": torch.ones(2, 2)},
        {"loss": torch.tensor(2.0), "logits": torch.zeros(1, 2)},
    ],
    "ModelOutput": [
        SequenceClassifierOutput(loss=torch.tensor(1.0), logits=torch.ones(2, 2)),
        SequenceClassifierOutput(loss=torch.tensor(3.0), logits=torch.zeros(1, 2)),
    ],
    "tuple with None": [(torch.ones(2), None), (torch.zeros(1), None)],
    "namedtuple": [Pair(torch.ones(2), [torch.ones(1)]), Pair(torch.zeros(3), [torch.zeros(2)])],
}


@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_gather_matches_torch_structure_code(case, monkeypatch):
    outputs = GATHER_CASES[case]
    monkeypatch.setattr(scatter_gather, "Gather", _CpuGather)
    expected = scatter_gather.gather(outputs, "cpu")
    got = simulated_gather(outputs)
    assert _same(got, expected)
    if case == "ModelOutput":
        assert isinstance(got, SequenceClassifierOutput)
        assert got.loss.tolist() == [1.0, 3.0]  # the per-device loss vector
        assert got.logits.shape == (3, 2)
    if case == "0-dim to vector":
        assert got.tolist() == [1.5, 2.5, 3.5]


def test_gather_of_mismatched_dicts_raises_like_torch():
    with pytest.raises(ValueError, match="same number of keys"):
        simulated_gather([{"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)}])


class _Linear(torch.nn.Module):
    """Returns a 0-dim mean loss, the per-sample loss being (w.x - y)^2, so per-chunk gradients are easy to check."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
        self.calls = []

    def forward(self, x, y, scale=None):
        self.calls.append(x.shape[0])
        loss = ((x @ self.w - y) ** 2).mean()
        return {"loss": loss * (1 if scale is None else scale), "pred": x @ self.w}


def test_forward_fewer_replicas_when_fewer_chunks_and_gradients_sum():
    torch.manual_seed(0)
    x, y = torch.randn(6, 2), torch.randn(6)
    model = _Linear()
    dp = SimulatedDataParallel(model, n_devices=4)
    out = dp(x, y=y, scale=None)
    assert model.calls == [2, 2, 2]  # 6 rows on 4 devices: 3 chunks, 3 replicas, as torch.chunk gives
    assert dp.last_chunk_sizes == [2, 2, 2]
    assert out["loss"].shape == (3,)  # one 0-dim loss per replica, gathered into a vector
    assert torch.equal(out["pred"], x @ model.w.detach())
    out["loss"].sum().backward()
    # DataParallel's Broadcast backward sums the replicas' gradients: grad = sum over chunks of d(chunk mean)/dw.
    w = model.w.detach().clone().requires_grad_(True)
    sum(((xc @ w - yc) ** 2).mean() for xc, yc in zip(x.split(2), y.split(2), strict=True)).backward()
    torch.testing.assert_close(model.w.grad, w.grad)


def test_one_device_runs_the_module_once_with_the_whole_batch():
    model = _Linear()
    out = SimulatedDataParallel(model, device_ids=[0])(torch.ones(5, 2), torch.ones(5))
    assert model.calls == [5]
    assert out["loss"].dim() == 0  # no gather with one device, as in torch


def test_device_ids_count_devices_even_when_repeated():
    model = _Linear()
    SimulatedDataParallel(model, device_ids=[0, 0])(torch.ones(3, 2), torch.ones(3))
    assert model.calls == [2, 1]


def test_constructor_needs_a_device_count():
    with pytest.raises(ValueError, match="number of virtual devices"):
        SimulatedDataParallel(_Linear())
    with pytest.raises(ValueError, match="at least one virtual device"):
        SimulatedDataParallel(_Linear(), device_ids=[])


def test_context_patches_and_restores_torch_data_parallel():
    real = torch.nn.DataParallel
    with simulate_data_parallel(3) as cls:
        assert torch.nn.DataParallel is cls is SimulatedDataParallel
        assert torch.nn.parallel.DataParallel is SimulatedDataParallel
        dp = torch.nn.DataParallel(_Linear())
        assert dp.device_ids == [0, 1, 2]
        assert isinstance(dp, real)  # accelerate's unwrap_model sees a DataParallel
        with simulate_data_parallel(2):
            assert torch.nn.DataParallel(_Linear()).device_ids == [0, 1]
        assert torch.nn.DataParallel(_Linear()).device_ids == [0, 1, 2]
    assert torch.nn.DataParallel is real and torch.nn.parallel.DataParallel is real
    with pytest.raises(RuntimeError), simulate_data_parallel(2):
        raise RuntimeError("boom")
    assert torch.nn.DataParallel is real
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n_devices"), simulate_data_parallel(bad):
            pass


def test_the_testing_package_exports_exactly_its_public_names():
    # The tests import every name the package had as one module (hf_parallel.testing) from the package itself.
    import hf_parallel.testing as testing

    public = {name for name, value in vars(testing).items() if not name.startswith("_") and callable(value)}
    assert public == set(testing.__all__)


def test_simulated_training_args(tmp_path):
    args = simulated_training_args(
        3, transformers.TrainingArguments, output_dir=str(tmp_path), per_device_train_batch_size=2, report_to="none"
    )
    assert args.n_gpu == 3
    assert args.train_batch_size == 6  # per_device_train_batch_size x n_gpu
    assert args.parallel_mode == transformers.training_args.ParallelMode.NOT_DISTRIBUTED
    _ = args.device  # the cached set-up does not run again and reset n_gpu
    assert args.n_gpu == 3
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="n_devices"):
            simulated_training_args(bad, output_dir=str(tmp_path))


# ---- Stock transformers.Trainer under simulated DataParallel ----


def _record_chunks(module, args, kwargs, output):
    module.seen_chunks.append((kwargs["labels"].detach(), output.logits.detach()))


def _recording_classifier(seed: int):
    model = CLASSIFIER.build(seed)
    model.seen_chunks = []
    model.register_forward_hook(_record_chunks, with_kwargs=True)
    return model


# The classifier, recording the labels and logits of every chunk a replica ran.
RECORDING = dataclasses.replace(CLASSIFIER, name="recording classifier", build=_recording_classifier)


def _stock_run(n_devices: int, rows: int, **overrides) -> dict:
    # One step over all the rows: a short last batch when rows is not a multiple of n_devices.
    topology = Topology(f"stock DP {n_devices}", per_device=-(-rows // n_devices), dp_devices=n_devices)
    result = run_case(RECORDING, topology, stock=True, train_rows=rows, eval_rows=0, **overrides)
    if n_devices > 1:
        assert isinstance(result["trainer"].model_wrapped, SimulatedDataParallel)
    return result


def test_stock_trainer_even_split_matches_single_process():
    # Mean of equal-size chunk means = full-batch mean. Averaging over devices off, so stock does not multiply the
    # loss by n_gpu (its num_items_in_batch scaling, which a mean-loss head ignores).
    one = _stock_run(1, 4, average_tokens_across_devices=False)
    two = _stock_run(2, 4, average_tokens_across_devices=False)
    trainer = two["trainer"]
    assert trainer.args.n_gpu == 2 and trainer.args.train_batch_size == 4
    assert trainer.model_wrapped.last_chunk_sizes == [2, 2]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for name in one["params"]:
        torch.testing.assert_close(two["params"][name], one["params"][name], rtol=1e-5, atol=1e-7, msg=name)
    initial = dict(CLASSIFIER.build(0).named_parameters())
    assert any(not torch.equal(one["params"][n], initial[n]) for n in initial)  # it did train


def test_stock_trainer_uneven_split_has_the_known_error():
    # 3 rows on 2 devices split [2, 1]. Stock averages the two chunk means and, with the default
    # average_tokens_across_devices=True on a model that takes loss kwargs, multiplies by n_gpu: m1 + m2 instead of
    # (2 m1 + m2) / 3, about x2.0.
    loss_1 = _stock_run(1, 3)["loss"]
    two = _stock_run(2, 3)
    trainer, loss_2 = two["trainer"], two["loss"]
    assert trainer.model_wrapped.last_chunk_sizes == [2, 1]
    # The per-chunk mean losses, from what each replica actually received (the sampler shuffles the rows).
    chunk_means = [
        torch.nn.functional.cross_entropy(logits, labels).item() for labels, logits in trainer.model.seen_chunks
    ]
    assert len(chunk_means) == 2
    m1, m2 = chunk_means
    assert loss_1 == pytest.approx((2 * m1 + m2) / 3, rel=1e-5)  # the exact mean over the 3 rows
    assert loss_2 == pytest.approx(2 * (m1 + m2) / 2, rel=1e-5)  # n_gpu x the mean of the two chunk means
    print(f"stock / exact logged loss, 3 rows split [2, 1] on 2 simulated devices: {loss_2 / loss_1:.3f}")
    assert loss_2 / loss_1 == pytest.approx(2.0, rel=0.1)  # x2.0 (2.058 with this seed)
