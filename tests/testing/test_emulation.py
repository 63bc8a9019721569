"""
The DataParallel emulation (hf_parallel.testing.emulation) checked against one device and against what torch's
DataParallel is known to do on GPUs, with plain torch modules only: a broken emulation must fail here, not pass or
fail hf_parallel's own tests by itself. Then the stock Trainer through it.
"""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from torch.nn.parallel import _functions, comm

from hf_parallel.testing import simulate_data_parallel, simulated_training_args
from tests.helpers.harness import RunResult, Topology, run_case
from tests.helpers.heads import CLASSIFIER

VOCAB, WIDTH = 11, 6


class _Probe(torch.nn.Module):
    """An embedding and an LM head (tied or not), and a layer no input uses; records what each call saw."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.unused = torch.nn.Linear(2, 2)
        self.calls: list[dict] = []

    def forward(self, ids, weights=None):
        self.calls.append(
            {
                "rows": ids.shape[0],
                "parameters": len(list(self.parameters())),
                "leaf": self.head.weight.is_leaf,
                "tied": self.head.weight is self.embed.weight,
                "thread": threading.current_thread(),  # the object: idents are reused
            }
        )
        logits = self.head(self.embed(ids))
        return logits if weights is None else logits * weights[:, None, None]


def _one_device_gradients(model, ids, weights=None):
    model.zero_grad(set_to_none=True)
    out = model(ids, weights)
    out.float().pow(2).sum().backward()
    return out.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize(("n_devices", "rows", "chunks"), [(2, 4, [2, 2]), (3, 7, [3, 3, 1]), (4, 5, [2, 2, 1])])
def test_torch_data_parallel_equals_one_device(tied, n_devices, rows, chunks):
    model = _Probe(tied)
    ids = torch.randint(0, VOCAB, (rows, 3))
    expected_out, expected = _one_device_gradients(model, ids)
    model.zero_grad(set_to_none=True)
    model.calls.clear()
    with simulate_data_parallel(n_devices) as emulation:
        dp = torch.nn.DataParallel(model)
        assert dp.device_ids == list(range(n_devices))
        out = dp(ids)
        out.pow(2).sum().backward()
    torch.testing.assert_close(out.detach(), expected_out)
    for name, param in model.named_parameters():
        if name.startswith("unused"):
            # Broadcast's backward materialises a zero gradient for every replica: zeros, where one device has None.
            assert expected[name] is None and torch.equal(param.grad, torch.zeros_like(param)), name
        else:
            torch.testing.assert_close(param.grad, expected[name], msg=name)
    # torch.chunk semantics: 5 rows on 4 devices run 3 replicas.
    assert emulation.chunk_sizes[0] == chunks and [c["rows"] for c in model.calls] == chunks
    assert emulation.replica_devices == list(range(len(chunks)))
    # torch's replicas: no parameters, non-leaf copies, a tie kept inside each replica, one thread per replica.
    assert {c["parameters"] for c in model.calls} == {0}
    assert {c["leaf"] for c in model.calls} == {False}
    assert {c["tied"] for c in model.calls} == {tied}
    threads = {c["thread"] for c in model.calls}
    assert len(threads) == len(chunks) and threading.main_thread() not in threads


def test_replicas_get_cuda_autocast_dtype_not_the_callers():
    # parallel_apply carries only the enabled flag into a replica thread: there CUDA autocast defaults to float16,
    # whatever dtype the caller asked for. The emulation must compute as GPUs do (CPU's own default is bfloat16).
    model = _Probe(tied=False)
    ids = torch.randint(0, VOCAB, (4, 3))
    with simulate_data_parallel(2) as emulation, torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.nn.DataParallel(model)(ids)
    assert out.dtype == torch.float16
    assert emulation.autocast_dtypes == [torch.float16, torch.float16]
    with simulate_data_parallel(2) as emulation:
        assert torch.nn.DataParallel(model)(ids).dtype == torch.float32
    assert emulation.autocast_dtypes == [None, None]


def test_a_replica_has_no_device_attribute_to_read():
    # What a transformers model's `self.device` does (`next(self.parameters())`) fails in torch's replicas, as on GPUs.
    class ReadsDevice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(x.to(next(self.parameters()).device))

    with simulate_data_parallel(2), pytest.raises(StopIteration, match="Caught StopIteration in replica 0"):
        torch.nn.DataParallel(ReadsDevice())(torch.ones(4, 2))


def test_scalar_outputs_become_the_per_device_vector_and_scatter_drops_rows_like_torch():
    class Mean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, y):
            return (self.w * x).mean() + 0 * y.sum()

    with simulate_data_parallel(4) as emulation:
        dp = torch.nn.DataParallel(Mean())
        with pytest.warns(UserWarning, match="all input tensors were scalars"):
            losses = dp(torch.arange(6.0), torch.arange(2.0))
    # x chunks into 3 pieces, y into 2: torch's zip keeps 2 replicas and silently drops rows 4 and 5 of x.
    assert losses.tolist() == [0.5, 2.5]
    assert emulation.chunk_sizes[:2] == [[2, 2, 2], [1, 1]]


def test_gradients_reduce_through_torchs_reduce_add_coalesced(monkeypatch):
    calls = []
    reduce = comm.reduce_add_coalesced
    monkeypatch.setattr(comm, "reduce_add_coalesced", lambda *a, **k: calls.append(len(a[0])) or reduce(*a, **k))
    with simulate_data_parallel(3):
        torch.nn.DataParallel(_Probe(tied=True))(torch.randint(0, VOCAB, (6, 2))).sum().backward()
    assert calls == [3]  # Broadcast's backward: one coalesced reduce over the three replicas


def test_the_block_restores_torch_and_does_not_nest():
    originals = (torch.nn.DataParallel.__init__, vars(_functions.Broadcast)["forward"], comm.reduce_add)
    with pytest.raises(RuntimeError, match="boom"), simulate_data_parallel(2):
        with pytest.raises(RuntimeError, match="do not nest"), simulate_data_parallel(2):
            pass
        raise RuntimeError("boom")
    assert (torch.nn.DataParallel.__init__, vars(_functions.Broadcast)["forward"], comm.reduce_add) == originals
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n_devices"), simulate_data_parallel(bad):
            pass


# The C++ copies the emulation stands in for: a CUDA build of torch has all three, a CPU build only some.
_COPIES = ("_broadcast_coalesced", "_scatter", "_gather")
_ABSENT = object()


def _copies() -> dict[str, object]:
    return {name: vars(torch._C).get(name, _ABSENT) for name in _COPIES}


@pytest.mark.parametrize("found", ["present", "absent"])
def test_the_block_restores_torch_s_copies_as_it_found_them(found, monkeypatch):
    # Both cases on either build: each copy set to a stand-in of its own (a CUDA build's), or removed (a CPU build's).
    for name in _COPIES:
        if found == "present":
            monkeypatch.setattr(torch._C, name, object(), raising=False)
        else:
            monkeypatch.delattr(torch._C, name, raising=False)
    before = _copies()
    with simulate_data_parallel(2):
        inside = _copies()
    after = _copies()
    assert all(inside[name] is not before[name] for name in _COPIES), "the block did not stand in for the copies"
    assert all(after[name] is before[name] for name in _COPIES), {n: (before[n], after[n]) for n in _COPIES}


def test_the_block_restores_this_build_s_copies():
    before = _copies()
    with pytest.raises(RuntimeError, match="boom"), simulate_data_parallel(2):
        raise RuntimeError("boom")
    assert all(_copies()[name] is before[name] for name in _COPIES)


def test_devices_outside_the_emulation_are_refused():
    with simulate_data_parallel(2), pytest.raises(RuntimeError, match="virtual devices 0..1"):
        torch.nn.DataParallel(_Probe(tied=False), device_ids=[0, 2])


def test_device_ids_may_repeat_a_device_as_on_one_gpu():
    model = _Probe(tied=False)
    with simulate_data_parallel(1):
        torch.nn.DataParallel(model, device_ids=[0, 0])(torch.randint(0, VOCAB, (3, 2)))
    assert [c["rows"] for c in model.calls] == [2, 1]


class _Records(torch.nn.Module):
    """Records, per replica (by its first value), whether its input shares the storage of `batch`."""

    def __init__(self, batch: torch.Tensor):
        super().__init__()
        self.batch, self.w = batch, torch.nn.Parameter(torch.ones(()))
        self.views: dict[float, bool] = {}

    def forward(self, x):
        self.views[float(x[0, 0])] = x.untyped_storage().data_ptr() == self.batch.untyped_storage().data_ptr()
        return x * self.w


def test_scatter_gives_views_of_the_batch_for_its_own_device():
    # torch::cuda::scatter copies only the pieces bound for another device than the batch's: with device_ids=[0, 0]
    # (two replicas on one GPU) each replica gets a view of the caller's batch (an in-place op in one changes it).
    batch = torch.arange(8.0).reshape(4, 2)
    model = _Records(batch)
    with simulate_data_parallel(1):
        torch.nn.DataParallel(model, device_ids=[0, 0])(batch)
    assert model.views == {0.0: True, 4.0: True}
    model = _Records(batch)
    with simulate_data_parallel(2):
        torch.nn.DataParallel(model)(batch)
    assert model.views == {0.0: True, 4.0: False}  # device 1's piece is a copy


def test_gather_casts_to_the_first_pieces_dtype_as_cuda_does():
    # torch::cuda::gather allocates one buffer like the first piece and copies every piece into it: a replica whose
    # output has another dtype is cast to the first's, where torch.cat would promote both (here to float32).
    class FirstInHalf(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x):
            y = self.linear(x)
            return y.half() if x.size(0) > 2 else y

    model = FirstInHalf()
    with simulate_data_parallel(2) as emulation:
        out = torch.nn.DataParallel(model)(torch.ones(5, 2))  # rows [3, 2]: float16, then float32
        out.float().sum().backward()  # the float16 gradient of the second piece is cast back by autograd
        gathered = comm.gather([torch.ones(2, 3, dtype=torch.bfloat16), torch.full((1, 3), 1.5).double()], 0, 0)
    assert out.dtype == torch.float16 and emulation.gathered_bytes[0] == 5 * 2 * 2
    torch.testing.assert_close(model.linear.weight.grad, torch.full((2, 2), 5.0))
    assert gathered.dtype == torch.bfloat16 and gathered[:, 0].tolist() == [1.0, 1.0, 1.5]
    with simulate_data_parallel(2), pytest.raises(RuntimeError, match="index 1 has invalid shape"):
        comm.gather([torch.ones(2, 3), torch.ones(1, 1)], 0, 0)  # copy_ alone would broadcast it


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


# ---- Stock transformers.Trainer through the emulation ----


def _stock_run(n_devices: int, rows: int, **overrides) -> RunResult:
    # One step over all the rows: a short last batch when rows is not a multiple of n_devices.
    topology = Topology(f"stock DP {n_devices}", per_device=-(-rows // n_devices), dp_devices=n_devices)
    return run_case(CLASSIFIER, topology, stock=True, train_rows=rows, eval_rows=0, **overrides)


def test_stock_trainer_even_split_matches_single_process():
    # Mean of equal-size chunk means = full-batch mean. Averaging over devices off, so stock does not multiply the
    # loss by n_gpu (its num_items_in_batch scaling, which a mean-loss head ignores).
    one = _stock_run(1, 4, average_tokens_across_devices=False)
    two = _stock_run(2, 4, average_tokens_across_devices=False)
    assert two.wrapped == "DataParallel"
    assert two.loss == pytest.approx(one.loss, rel=1e-5)
    for name in one.params:
        torch.testing.assert_close(two.params[name], one.params[name], rtol=1e-5, atol=1e-7, msg=name)
    initial = dict(CLASSIFIER.build(0).named_parameters())
    assert any(not torch.equal(one.params[n], initial[n]) for n in initial)  # it did train


def test_stock_trainer_uneven_split_has_the_known_error():
    # 3 rows on 2 devices split [2, 1]: stock averages the two chunk means and, with the default
    # average_tokens_across_devices=True on a model that takes loss kwargs, multiplies by n_gpu: about x2.0.
    loss_1 = _stock_run(1, 3).loss
    loss_2 = _stock_run(2, 3).loss
    assert loss_2 / loss_1 == pytest.approx(2.0, rel=0.1)  # x2.0 (2.058 with this seed)
