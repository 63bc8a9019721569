"""BalancedDataParallel (on CPU inside the DataParallel emulation, torch's own DataParallel code on virtual devices;
real on GPUs) and balanced_wrapper, the Trainer's decision of when to use it."""

import math

import pytest
import torch
from accelerate import Accelerator
from torch import nn
from transformers import BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

import hf_parallel
from hf_parallel import BalancedDataParallel, ExactDataParallel, balanced_chunk_sizes, unwrap_model
from hf_parallel.data_parallel import balanced_wrapper
from hf_parallel.testing import simulate_data_parallel
from tests.helpers.harness import training_args
from tests.helpers.tiny import tiny, tiny_bert_classifier

# ---- BalancedDataParallel on CPU, inside the emulation (only the device copies are CPU stand-ins) ----


class Probe(nn.Module):
    """Records what each replica receives; returns a 0-dim loss (sum of squares) and per-row outputs."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0]))
        self.seen = []  # replicas share it (torch's replicas copy the module's __dict__)

    def forward(self, x=None, y=None, *extra, scale=None, flag=None, note=None, meta=None, **more):
        self.seen.append(
            {
                "rows": None if x is None else x.shape[0],
                "first": None if x is None or not len(x) else x.flatten()[0].item(),
                "y": y,
                "extra": extra,
                "scale": scale,
                "flag": flag,
                "note": note,
                "meta": meta,
                "more": more,
            }
        )
        pred = x @ self.w
        loss = (pred**2).sum() * (1.0 if scale is None else scale)
        return {"loss": loss, "pred": pred}


def in_batch_order(seen):
    """
    The replicas' records in the order of their rows in the batch. The replicas run in threads, so they record in
    any order; the inputs of these tests increase down the batch, so a chunk's first value places it.
    """
    return sorted(seen, key=lambda s: -math.inf if s["first"] is None else s["first"])


def rows_seen(model):
    return [s["rows"] for s in in_batch_order(model.seen)]


def test_keyword_only_call_with_none_bool_and_objects():
    model = Probe()
    x = torch.arange(12.0).view(6, 2)
    with simulate_data_parallel(3) as emulation:
        dp = BalancedDataParallel(model, gpu0_bsz=1)
        out = dp(x=x, y=None, flag=True, note="text", scale=torch.tensor(2.0))
    assert type(dp) is BalancedDataParallel and dp.device_ids == [0, 1, 2]
    assert emulation.chunk_sizes == [[1, 3, 2]]  # x only: the 0-dim tensor is copied, not split
    assert sorted(emulation.replica_devices) == [0, 1, 2]
    assert rows_seen(model) == [1, 3, 2]
    assert all(s["y"] is None and s["flag"] is True and s["note"] == "text" for s in model.seen)
    assert all(torch.equal(s["scale"], torch.tensor(2.0)) for s in model.seen)  # 0-dim tensor copied
    assert torch.equal(out["pred"], x @ model.w.detach())  # gathered in order
    assert out["loss"].shape == (3,)  # the per-device loss vector, one entry per used device


def test_positional_call_and_gradients_sum_over_chunks():
    model = Probe()
    x = torch.linspace(-1.0, 1.3, 14).view(7, 2)
    with simulate_data_parallel(3) as emulation:
        out = BalancedDataParallel(model, gpu0_bsz=1)(x)
        out["loss"].sum().backward()
    assert emulation.chunk_sizes[0] == [1, 3, 3]
    assert rows_seen(model) == [1, 3, 3]
    reference = Probe()
    ((x @ reference.w) ** 2).sum().backward()
    torch.testing.assert_close(model.w.grad, reference.w.grad)


def test_nested_structures_are_split_consistently():
    model = Probe()
    x = torch.arange(8.0).view(4, 2)
    meta = {"ids": torch.arange(4), "names": ["a", "b"], "pair": (torch.arange(4) * 10, None)}
    with simulate_data_parallel(2) as emulation:
        BalancedDataParallel(model, gpu0_bsz=1)(x, meta=meta)
    assert emulation.chunk_sizes == [[1, 3], [1, 3], [1, 3]]  # x, meta["ids"], meta["pair"][0]
    seen = in_batch_order(model.seen)
    assert [s["meta"]["ids"].tolist() for s in seen] == [[0], [1, 2, 3]]
    assert [s["meta"]["pair"][0].tolist() for s in seen] == [[0], [10, 20, 30]]
    assert all(s["meta"]["names"] == ["a", "b"] and s["meta"]["pair"][1] is None for s in seen)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda dp, x: dp(x=x, num_items_in_batch=torch.ones(3, 1)), r"`num_items_in_batch` has 3 rows.*exact_loss"),
        (lambda dp, x: dp(x, torch.ones(5)), r"positional argument 1 has 5 rows along dim 0 but the batch has 6"),
        (lambda dp, x: dp(x=x, meta={"ids": torch.ones(2)}), r"`meta\['ids'\]` has 2 rows"),
        (lambda dp, x: dp(torch.ones(6, 2), x=torch.ones(2, 2)), r"`x` has 2 rows .* \(from positional argument 0\)"),
    ],
)
def test_tensor_with_another_size_raises_naming_it(call, message):
    model = Probe()
    with simulate_data_parallel(3) as emulation:
        with pytest.raises(ValueError, match=message):
            call(BalancedDataParallel(model, gpu0_bsz=1), torch.ones(6, 2))
    assert model.seen == []  # nothing ran: no rows dropped silently
    assert emulation.chunk_sizes == [] and emulation.replica_devices == []


def test_tensor_without_the_batch_dimension_raises():
    model = Probe()
    with simulate_data_parallel(2):
        dp = BalancedDataParallel(model, dim=1)
        with pytest.raises(ValueError, match=r"`mask` has 1 dimension\(s\), so no batch dimension dim=1"):
            dp(x=torch.ones(2, 4), mask=torch.ones(4))
    assert model.seen == []


def test_split_along_dim_1():
    class Columns(nn.Module):
        def forward(self, x):
            return x * 2

    x = torch.arange(12.0).view(2, 6)
    with simulate_data_parallel(3) as emulation:
        out = BalancedDataParallel(Columns(), dim=1, gpu0_bsz=0)(x)
    assert torch.equal(out, x * 2)
    assert emulation.chunk_sizes == [[3, 3]]
    assert sorted(emulation.replica_devices) == [1, 2]


def test_devices_without_rows_are_skipped():
    model = Probe()
    with simulate_data_parallel(3) as emulation:
        out = BalancedDataParallel(model, gpu0_bsz=0)(x=torch.arange(10.0).view(5, 2))
    assert emulation.chunk_sizes == [[3, 2]]
    assert sorted(emulation.replica_devices) == [1, 2]  # GPU 0 gets no rows, runs no replica
    assert rows_seen(model) == [3, 2]
    assert out["loss"].shape == (2,)
    model.seen.clear()
    with simulate_data_parallel(4) as emulation:
        BalancedDataParallel(model)(x=torch.arange(4.0).view(2, 2))  # fewer rows than devices: [0, 1, 1, 0]
    assert emulation.chunk_sizes == [[1, 1]]
    assert sorted(emulation.replica_devices) == [1, 2]
    assert rows_seen(model) == [1, 1]


def test_gpu0_without_rows_keeps_the_gradients_of_the_others():
    # GPU 0 holds the module but runs no replica: the parameters get exactly the other replicas' gradients.
    model = Probe()
    x = torch.linspace(-1.0, 1.3, 10).view(5, 2)
    with simulate_data_parallel(3) as emulation:
        BalancedDataParallel(model, gpu0_bsz=0)(x)["loss"].sum().backward()
    assert sorted(emulation.replica_devices) == [1, 2]
    reference = Probe()
    ((x @ reference.w) ** 2).sum().backward()
    torch.testing.assert_close(model.w.grad, reference.w.grad)


def test_empty_batch_runs_once_on_gpu0():
    model = Probe()
    with simulate_data_parallel(3) as emulation:
        out = BalancedDataParallel(model, gpu0_bsz=1)(x=torch.ones(0, 2))
    assert rows_seen(model) == [0]
    assert emulation.replica_devices == [0]
    assert out["pred"].shape == (0,)


def test_one_device_is_stock_behaviour():
    model = Probe()
    with simulate_data_parallel(1) as emulation:
        dp = BalancedDataParallel(model, gpu0_bsz=0)
        out = dp(x=torch.ones(4, 2), num_items_in_batch=torch.ones(1, 1))
    assert dp.device_ids == [0]
    assert rows_seen(model) == [4]  # the whole batch, gpu0_bsz ignored, nothing validated
    assert emulation.replica_devices == []  # nn.DataParallel on one device runs the module itself
    assert out["loss"].dim() == 0  # not gathered


def test_call_without_batched_tensor_runs_once_on_gpu0():
    class Objects(nn.Module):
        def __init__(self):
            super().__init__()
            self.notes = []

        def forward(self, note, scale=None):
            self.notes.append(note)
            return torch.tensor(float(len(note))) * scale

    model = Objects()
    with simulate_data_parallel(3) as emulation:
        out = BalancedDataParallel(model, gpu0_bsz=0)(note="four", scale=torch.tensor(2.0))
    # Nothing to split: one replica on GPU 0 (stock would copy the call to every device, and cannot scatter the
    # 0-dim tensor: "chunk expects at least a 1-dimensional tensor").
    assert model.notes == ["four"]
    assert emulation.replica_devices == [0]
    assert out.tolist() == [8.0]
    model.notes.clear()
    with simulate_data_parallel(2):
        assert BalancedDataParallel(model)("ab", torch.tensor(1.0)).tolist() == [2.0]
    assert model.notes == ["ab"]


def test_constructor_forms():
    model = Probe()
    with simulate_data_parallel(3):
        assert BalancedDataParallel(model, gpu0_bsz=2).gpu0_bsz == 2
        legacy = BalancedDataParallel(2, model, dim=0)  # the older form, gpu0_bsz first
        assert legacy.gpu0_bsz == 2 and legacy.module is model and legacy.dim == 0
        weighted = BalancedDataParallel(model, gpu0_weight=0.5)
        assert weighted.gpu0_weight == 0.5 and weighted.chunk_sizes(10) == [2, 4, 4]
        with pytest.raises(ValueError, match="at most one"):
            BalancedDataParallel(model, gpu0_bsz=1, gpu0_weight=0.5)
        with pytest.raises(ValueError, match="gpu0_bsz must be a whole number >= 0, got -2"):
            BalancedDataParallel(model, gpu0_bsz=-2)
    with simulate_data_parallel(2):
        assert BalancedDataParallel(3, module=model).gpu0_bsz == 3
        with pytest.raises(ValueError, match="gpu0_bsz given twice"):
            BalancedDataParallel(2, model, gpu0_bsz=3)
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        BalancedDataParallel("model", gpu0_bsz=1)


def test_real_class_on_a_machine_without_gpus_is_stock(no_gpus):
    model = Probe()
    dp = BalancedDataParallel(model, gpu0_bsz=1)
    assert dp.device_ids == []  # nn.DataParallel's own behaviour without accelerators: run the module as is
    out = dp(x=torch.ones(3, 2))
    assert rows_seen(model) == [3] and out["loss"].dim() == 0
    assert isinstance(dp, nn.DataParallel) and unwrap_model(dp) is model


def test_attributes_fall_through_to_the_wrapped_model(tmp_path):
    model = tiny_bert_classifier()
    with simulate_data_parallel(2):
        dp = BalancedDataParallel(model, gpu0_bsz=1)
    assert dp.device_ids == [0, 1]
    assert dp.config is model.config
    assert dp.num_labels == 2
    assert dp.module is model and dp.training is True and dp.gpu0_bsz == 1
    assert "module.bert.embeddings.word_embeddings.weight" in dict(dp.named_parameters())
    dp.save_pretrained(tmp_path)  # nn.DataParallel(model).save_pretrained raises AttributeError
    loaded = BertForSequenceClassification.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _ = dp.no_such_attribute
    with pytest.raises(AttributeError):
        _ = nn.DataParallel(model).save_pretrained


def test_generate_works_on_the_wrapper():
    torch.manual_seed(0)
    config = tiny(GPT2Config, vocab_size=40, n_positions=16, n_embd=8, use_cache=True)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.tensor([[1, 2, 3]])
    expected = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with simulate_data_parallel(2) as emulation:
        dp = BalancedDataParallel(model, gpu0_bsz=0)
        got = dp.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    assert emulation.replica_devices == []  # generate acts on the wrapped model, on one device


def test_public_names():
    assert hf_parallel.BalancedDataParallel is BalancedDataParallel
    assert hf_parallel.ExactDataParallel is ExactDataParallel
    assert hf_parallel.balanced_chunk_sizes is balanced_chunk_sizes
    assert {"BalancedDataParallel", "ExactDataParallel", "balanced_chunk_sizes"} <= set(hf_parallel.__all__)
    assert issubclass(BalancedDataParallel, ExactDataParallel) and issubclass(ExactDataParallel, nn.DataParallel)


# ---- balanced_wrapper: when the Trainer wraps in BalancedDataParallel ----


class LossKwargsProbe(Probe):
    """A model whose stock loss gets num_items_in_batch (what model_accepts_loss_kwargs reports for it)."""


def _loaded_in_8bit():
    model = Probe()
    model.is_loaded_in_8bit = True
    return model


# name: (devices, options, model, training, model_accepts_loss_kwargs, wrapped?, warning that must appear)
WRAP_CASES = {
    "options unset": (3, {}, Probe, True, False, False, None),
    "one device": (1, {"gpu0_bsz": 1}, Probe, True, False, False, "gpu0_bsz=1 is ignored"),
    "already wrapped": (3, {"gpu0_bsz": 1}, lambda: nn.DataParallel(Probe()), True, False, False, None),
    "8-bit model": (3, {"gpu0_bsz": 1}, _loaded_in_8bit, True, False, False, None),
    "balanced": (3, {"gpu0_weight": 0.5}, Probe, True, True, True, None),
    "stock loss, evaluation": (3, {"gpu0_bsz": 1, "exact_loss": False}, LossKwargsProbe, False, True, True, None),
    "stock loss, no loss kwargs": (
        3,
        {"gpu0_bsz": 1, "exact_loss": False},
        Probe,
        True,
        False,
        True,
        "averages the per-GPU mean losses",
    ),
}


@pytest.mark.parametrize("case", list(WRAP_CASES))
def test_balanced_wrapper_decisions(case, tmp_path, hf_parallel_log):
    n_devices, options, build, training, loss_kwargs, wraps, warning = WRAP_CASES[case]
    args = training_args(tmp_path, dp_devices=n_devices, per_device_train_batch_size=2, **options)
    with simulate_data_parallel(n_devices):
        model = build()
        wrapped = balanced_wrapper(model, args, Accelerator(cpu=True), training, loss_kwargs)
    if wraps:
        # Built inside the emulation, the balanced wrapper spans its virtual devices.
        assert type(wrapped) is BalancedDataParallel
        assert wrapped.module is model and wrapped.device_ids == list(range(n_devices))
        assert (wrapped.gpu0_bsz, wrapped.gpu0_weight) == (options.get("gpu0_bsz"), options.get("gpu0_weight"))
    else:
        assert wrapped is None
    if warning is not None:
        assert hf_parallel_log.text.count(warning) == 1, hf_parallel_log.text
    else:
        assert hf_parallel_log.text == ""


def test_balanced_wrapper_refuses_the_stock_loss_with_loss_kwargs(tmp_path):
    args = training_args(tmp_path, dp_devices=3, gpu0_bsz=1, exact_loss=False)
    with pytest.raises(ValueError, match=r"gpu0_bsz=1 with exact_loss=False: LossKwargsProbe accepts loss kwargs"):
        balanced_wrapper(LossKwargsProbe(), args, Accelerator(cpu=True), True, True)


def test_balanced_wrapper_outside_the_emulation_is_torch_without_gpus(tmp_path, no_gpus):
    args = training_args(tmp_path, dp_devices=3, gpu0_bsz=1)
    model = Probe()
    wrapped = balanced_wrapper(model, args, Accelerator(cpu=True))
    assert type(wrapped) is BalancedDataParallel and wrapped.module is model
    assert wrapped.device_ids == []  # torch's DataParallel finds no GPU: it runs the module as it is
    assert wrapped(x=torch.ones(3, 2))["loss"].dim() == 0


# ---- Against the model on one device: in the emulation, and on real GPUs (skipped without) ----


def _check_against_one_device(device, device_ids, gpu0_bsz):
    torch.manual_seed(0)
    model = tiny_bert_classifier().to(device)
    reference = tiny_bert_classifier().to(device)
    ids = torch.randint(5, 50, (7, 8), device=device)
    labels = torch.randint(0, 2, (7,), device=device)
    dp = BalancedDataParallel(model, device_ids=device_ids, gpu0_bsz=gpu0_bsz)
    out = dp(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=False, token_type_ids=None)
    expected = reference(input_ids=ids, attention_mask=torch.ones_like(ids))
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    assert out.logits.device == (torch.device("cuda", device_ids[0]) if device == "cuda" else torch.device("cpu"))
    loss = torch.nn.functional.cross_entropy(out.logits, labels, reduction="sum")
    loss.backward()
    torch.nn.functional.cross_entropy(expected.logits, labels, reduction="sum").backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        dp(input_ids=ids, num_items_in_batch=torch.ones(len(device_ids), 1, device=device))


# (device_ids, gpu0_bsz): two replicas on one device as on one GPU, GPU 0 with no rows, with fewer rows, 3 devices.
EMULATED = [([0, 0], 0), ([0, 0], 1), ([0, 0], 3), ([0, 1], 0), ([0, 1], 2), ([0, 1, 2], 1)]


@pytest.mark.parametrize("device_ids, gpu0_bsz", EMULATED)
def test_emulated_data_parallel_equals_one_device(device_ids, gpu0_bsz):
    with simulate_data_parallel(max(device_ids) + 1) as emulation:
        _check_against_one_device("cpu", device_ids, gpu0_bsz)
    split = [size for size in balanced_chunk_sizes(7, len(device_ids), gpu0_bsz) if size]
    assert emulation.chunk_sizes[0] == split  # input_ids, split as BalancedDataParallel decided
    assert len(emulation.replica_devices) == len(split)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu0_bsz", [0, 1, 3])
def test_real_data_parallel_path_on_one_gpu(gpu0_bsz):
    # Two replicas on one GPU run nn.DataParallel's real scatter / replicate / parallel_apply / gather.
    _check_against_one_device("cuda", [0, 0], gpu0_bsz)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("gpu0_bsz", [0, 2])
def test_real_data_parallel_on_two_gpus(gpu0_bsz):
    _check_against_one_device("cuda", [0, 1], gpu0_bsz)
