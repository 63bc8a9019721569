"""balanced_chunk_sizes (property tests) and BalancedDataParallel (on CPU through the simulation; real on GPUs)."""

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

import hf_parallel
from hf_parallel import BalancedDataParallel, balanced_chunk_sizes, unwrap_model
from hf_parallel.testing import SimulatedBalancedDataParallel
from tests.tiny import tiny_bert_classifier

BATCH = st.integers(0, 300)
DEVICES = st.integers(1, 9)
GPU0_BSZ = st.none() | st.integers(0, 200)
GPU0_WEIGHT = st.floats(0, 1, allow_nan=False) | st.sampled_from([0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0])


def _gpu0_cap(batch_size, num_devices, gpu0_bsz, gpu0_weight):
    """The most rows GPU 0 may get, characterised without the library's formula: the largest g within the even share
    and gpu0_bsz with g / w <= (batch_size - g) / (n - 1), i.e. g * (w + n - 1) <= batch_size * w, in exact
    arithmetic on the decimal the weight is written as."""
    cap = batch_size // num_devices
    if gpu0_bsz is not None:
        cap = min(cap, gpu0_bsz)
    if gpu0_weight is not None:
        w = Fraction(repr(gpu0_weight))
        while cap > 0 and cap * (w + num_devices - 1) > batch_size * w:
            cap -= 1
    return cap


# ---- balanced_chunk_sizes ----


@settings(max_examples=1000, deadline=None)
@given(BATCH, DEVICES, GPU0_BSZ)
def test_sizes_sum_to_batch_none_negative_gpu0_bounded(batch_size, num_devices, gpu0_bsz):
    sizes = balanced_chunk_sizes(batch_size, num_devices, gpu0_bsz=gpu0_bsz)
    assert len(sizes) == num_devices
    assert sum(sizes) == batch_size
    assert min(sizes) >= 0
    if num_devices == 1:
        assert sizes == [batch_size]
        return
    assert sizes[0] <= batch_size // num_devices  # never above its even share
    if gpu0_bsz is not None:
        assert sizes[0] <= gpu0_bsz
    # ... and exactly the most it is allowed: GPU 0 is not starved below the rule.
    assert sizes[0] == _gpu0_cap(batch_size, num_devices, gpu0_bsz, None)


@settings(max_examples=1000, deadline=None)
@given(BATCH, st.integers(2, 9), GPU0_BSZ)
def test_other_devices_differ_by_at_most_one_and_never_below_gpu0(batch_size, num_devices, gpu0_bsz):
    sizes = balanced_chunk_sizes(batch_size, num_devices, gpu0_bsz=gpu0_bsz)
    others = sizes[1:]
    assert max(others) - min(others) <= 1
    assert others == sorted(others, reverse=True)  # the extra rows go to the lower indices
    assert min(others) >= sizes[0]  # GPU 0 never gets more than any other device


@settings(max_examples=1000, deadline=None)
@given(BATCH, DEVICES, GPU0_WEIGHT)
def test_weight_rule(batch_size, num_devices, gpu0_weight):
    sizes = balanced_chunk_sizes(batch_size, num_devices, gpu0_weight=gpu0_weight)
    assert len(sizes) == num_devices and sum(sizes) == batch_size and min(sizes) >= 0
    if num_devices == 1:
        assert sizes == [batch_size]
        return
    assert sizes[0] == _gpu0_cap(batch_size, num_devices, None, gpu0_weight)
    others = sizes[1:]
    assert max(others) - min(others) <= 1 and min(others) >= sizes[0]
    # GPU 0's share relative to another device's is at most the weight (up to the one-row rounding of the others).
    assert sizes[0] <= gpu0_weight * max(others) + 1e-9


@settings(max_examples=1000, deadline=None)
@given(BATCH, st.integers(2, 9), st.integers(0, 100), st.integers(0, 100))
def test_more_gpu0_bsz_never_gives_gpu0_fewer_rows(batch_size, num_devices, a, b):
    low, high = sorted((a, b))
    assert (
        balanced_chunk_sizes(batch_size, num_devices, gpu0_bsz=low)[0]
        <= balanced_chunk_sizes(batch_size, num_devices, gpu0_bsz=high)[0]
    )


@settings(max_examples=1000, deadline=None)
@given(BATCH, DEVICES)
def test_without_options_the_split_is_even(batch_size, num_devices):
    sizes = balanced_chunk_sizes(batch_size, num_devices)
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == batch_size
    assert sizes == balanced_chunk_sizes(batch_size, num_devices, gpu0_weight=1.0)
    assert sizes == balanced_chunk_sizes(batch_size, num_devices, gpu0_bsz=batch_size)
    assert balanced_chunk_sizes(batch_size, num_devices, gpu0_weight=0.0) == balanced_chunk_sizes(
        batch_size, num_devices, gpu0_bsz=0
    )


@pytest.mark.parametrize(
    "batch_size, num_devices, options, expected",
    [
        (52, 3, {"gpu0_bsz": 16}, [16, 18, 18]),  # the source document's examples
        (53, 3, {"gpu0_bsz": 16}, [16, 19, 18]),
        (10, 3, {"gpu0_bsz": 3}, [3, 4, 3]),  # the anchors give [4, 4, 2]: 4 rows on GPU 0, above gpu0_bsz
        (32, 2, {"gpu0_bsz": 14}, [14, 18]),  # the source document's 2-GPU example
        (7, 1, {"gpu0_bsz": 2}, [7]),  # one device takes everything (the anchors: ZeroDivisionError)
        (0, 3, {"gpu0_bsz": 2}, [0, 0, 0]),  # empty batch
        (2, 4, {}, [0, 1, 1, 0]),  # fewer rows than devices: GPU 0's even share is 0
        (3, 4, {"gpu0_bsz": 5}, [0, 1, 1, 1]),
        (9, 3, {"gpu0_bsz": 0}, [0, 5, 4]),
        (6, 4, {}, [1, 2, 2, 1]),  # torch.chunk would give [2, 2, 2] on 3 devices
        (10, 3, {"gpu0_weight": 0.5}, [2, 4, 4]),
        (23, 3, {"gpu0_weight": 0.3}, [3, 10, 10]),  # 23 * 0.3 / 2.3 = 3 exactly: not floored to 2
        (12, 3, {"gpu0_bsz": 100}, [4, 4, 4]),  # gpu0_bsz above the even share of a short batch: the even share
    ],
)
def test_examples(batch_size, num_devices, options, expected):
    assert balanced_chunk_sizes(batch_size, num_devices, **options) == expected


@pytest.mark.parametrize(
    "arguments, message",
    [
        ((10, 2, 1, 0.5), "at most one"),
        ((10, 2, -1, None), "gpu0_bsz must be >= 0"),
        ((10, 2, 1.5, None), "whole number of rows"),
        ((10, 2, True, None), "whole number of rows"),
        ((10, 2, None, float("nan")), r"finite number in \[0, 1\]"),
        ((10, 2, None, float("inf")), r"finite number in \[0, 1\]"),
        ((10, 2, None, 1.5), r"finite number in \[0, 1\]"),
        ((10, 2, None, -0.1), r"finite number in \[0, 1\]"),
        ((10, 2, None, "0.5"), "must be a number"),
        ((-1, 2, None, None), "batch_size must be a whole number >= 0"),
        ((10, 0, None, None), "num_devices must be a whole number >= 1"),
        ((10.0, 2, None, None), "batch_size"),
    ],
)
def test_bad_arguments_raise_naming_the_value(arguments, message):
    with pytest.raises(ValueError, match=message):
        balanced_chunk_sizes(*arguments)


# ---- BalancedDataParallel on CPU, through the simulation (only the device transfer is simulated) ----


class Probe(nn.Module):
    """Records what each replica receives; returns a 0-dim loss (sum of squares) and per-row outputs."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0]))
        self.seen = []

    def forward(self, x=None, y=None, *extra, scale=None, flag=None, note=None, meta=None, **more):
        self.seen.append(
            {
                "rows": None if x is None else x.shape[0],
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


def _sim(model, n_devices=3, **options):
    return SimulatedBalancedDataParallel(model, n_devices=n_devices, **options)


def test_keyword_only_call_with_none_bool_and_objects():
    model = Probe()
    x = torch.arange(12.0).view(6, 2)
    out = _sim(model, gpu0_bsz=1)(x=x, y=None, flag=True, note="text", scale=torch.tensor(2.0))
    assert [s["rows"] for s in model.seen] == [1, 3, 2]
    assert all(s["y"] is None and s["flag"] is True and s["note"] == "text" for s in model.seen)
    assert all(torch.equal(s["scale"], torch.tensor(2.0)) for s in model.seen)  # 0-dim tensor copied
    assert torch.equal(out["pred"], x @ model.w.detach())  # gathered in order
    assert out["loss"].shape == (3,)  # the per-device loss vector, one entry per used device


def test_positional_call_and_gradients_sum_over_chunks():
    model = Probe()
    x = torch.randn(7, 2, generator=torch.Generator().manual_seed(0))
    out = _sim(model, gpu0_bsz=1)(x)
    assert [s["rows"] for s in model.seen] == [1, 3, 3]
    out["loss"].sum().backward()
    reference = Probe()
    ((x @ reference.w) ** 2).sum().backward()
    torch.testing.assert_close(model.w.grad, reference.w.grad)


def test_nested_structures_are_split_consistently():
    model = Probe()
    x = torch.arange(8.0).view(4, 2)
    meta = {"ids": torch.arange(4), "names": ["a", "b"], "pair": (torch.arange(4) * 10, None)}
    _sim(model, n_devices=2, gpu0_bsz=1)(x, meta=meta)
    assert [s["meta"]["ids"].tolist() for s in model.seen] == [[0], [1, 2, 3]]
    assert [s["meta"]["pair"][0].tolist() for s in model.seen] == [[0], [10, 20, 30]]
    assert all(s["meta"]["names"] == ["a", "b"] and s["meta"]["pair"][1] is None for s in model.seen)


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
    with pytest.raises(ValueError, match=message):
        call(_sim(model, gpu0_bsz=1), torch.ones(6, 2))
    assert model.seen == []  # nothing ran: no rows dropped silently


def test_tensor_without_the_batch_dimension_raises():
    model = Probe()
    dp = SimulatedBalancedDataParallel(model, n_devices=2, dim=1)
    with pytest.raises(ValueError, match=r"`mask` has 1 dimension\(s\), so no batch dimension dim=1"):
        dp(x=torch.ones(2, 4), mask=torch.ones(4))


def test_split_along_dim_1():
    class Columns(nn.Module):
        def forward(self, x):
            return x * 2

    dp = SimulatedBalancedDataParallel(Columns(), n_devices=3, dim=1, gpu0_bsz=0)
    x = torch.arange(12.0).view(2, 6)
    assert torch.equal(dp(x), x * 2)
    assert dp.last_chunk_sizes == [3, 3]


def test_devices_without_rows_are_skipped():
    model = Probe()
    dp = _sim(model, n_devices=3, gpu0_bsz=0)
    out = dp(x=torch.ones(5, 2))
    assert [s["rows"] for s in model.seen] == [3, 2]  # GPU 0 gets no rows, runs no replica
    assert out["loss"].shape == (2,)
    model.seen.clear()
    out = _sim(model, n_devices=4)(x=torch.ones(2, 2))  # fewer rows than devices: [0, 1, 1, 0]
    assert [s["rows"] for s in model.seen] == [1, 1]


def test_empty_batch_runs_once_on_gpu0():
    model = Probe()
    out = _sim(model, gpu0_bsz=1)(x=torch.ones(0, 2))
    assert [s["rows"] for s in model.seen] == [0]
    assert out["pred"].shape == (0,)


def test_one_device_is_stock_behaviour():
    model = Probe()
    out = _sim(model, n_devices=1, gpu0_bsz=0)(x=torch.ones(4, 2), num_items_in_batch=torch.ones(1, 1))
    assert [s["rows"] for s in model.seen] == [4]  # the whole batch, gpu0_bsz ignored, nothing validated
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
    out = SimulatedBalancedDataParallel(model, n_devices=3, gpu0_bsz=0)(note="four", scale=torch.tensor(2.0))
    # Nothing to split: one replica on GPU 0 (stock would copy the call to every device, and cannot scatter the
    # 0-dim tensor: "chunk expects at least a 1-dimensional tensor").
    assert model.notes == ["four"]
    assert out.tolist() == [8.0]
    model.notes.clear()
    assert SimulatedBalancedDataParallel(model, n_devices=2)("ab", torch.tensor(1.0)).tolist() == [2.0]


def test_constructor_forms():
    model = Probe()
    assert _sim(model, gpu0_bsz=2).gpu0_bsz == 2
    legacy = SimulatedBalancedDataParallel(2, model, dim=0, n_devices=3)  # the source document's form
    assert legacy.gpu0_bsz == 2 and legacy.module is model and legacy.dim == 0
    assert SimulatedBalancedDataParallel(3, module=model, n_devices=2).gpu0_bsz == 3
    weighted = _sim(model, gpu0_weight=0.5)
    assert weighted.gpu0_weight == 0.5 and weighted.chunk_sizes(10) == [2, 4, 4]
    with pytest.raises(ValueError, match="gpu0_bsz given twice"):
        SimulatedBalancedDataParallel(2, model, gpu0_bsz=3, n_devices=2)
    with pytest.raises(ValueError, match="at most one"):
        _sim(model, gpu0_bsz=1, gpu0_weight=0.5)
    with pytest.raises(ValueError, match="gpu0_bsz must be >= 0"):
        _sim(model, gpu0_bsz=-2)
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        BalancedDataParallel("model", gpu0_bsz=1)


def test_real_class_on_a_machine_without_gpus_is_stock(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the no-accelerator behaviour")
    model = Probe()
    dp = BalancedDataParallel(model, gpu0_bsz=1)
    assert dp.device_ids == []  # nn.DataParallel's own behaviour without accelerators: run the module as is
    out = dp(x=torch.ones(3, 2))
    assert [s["rows"] for s in model.seen] == [3] and out["loss"].dim() == 0
    assert isinstance(dp, nn.DataParallel) and unwrap_model(dp) is model


def test_attributes_fall_through_to_the_wrapped_model(tmp_path):
    model = tiny_bert_classifier()
    dp = SimulatedBalancedDataParallel(model, n_devices=2, gpu0_bsz=1)
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
    config = GPT2Config(vocab_size=40, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config).eval()
    dp = SimulatedBalancedDataParallel(model, n_devices=2, gpu0_bsz=0)
    ids = torch.tensor([[1, 2, 3]])
    expected = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(dp.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0), expected)


def test_simulation_swaps_only_the_device_work():
    # Everything else (validation, chunk sizes, device skipping, forward) is BalancedDataParallel's own code.
    own = {name for name, value in vars(SimulatedBalancedDataParallel).items() if callable(value)}
    assert own == {"_scatter_chunks", "parallel_apply", "_check_module_device"}
    for name in ("forward", "_plan", "chunk_sizes", "__init__", "__getattr__"):
        assert getattr(SimulatedBalancedDataParallel, name) is getattr(BalancedDataParallel, name), name


def test_public_names():
    assert hf_parallel.BalancedDataParallel is BalancedDataParallel
    assert hf_parallel.balanced_chunk_sizes is balanced_chunk_sizes
    assert {"BalancedDataParallel", "balanced_chunk_sizes"} <= set(hf_parallel.__all__)
    assert issubclass(SimulatedBalancedDataParallel, BalancedDataParallel)


# ---- The real class on GPUs (skipped without) ----


def _gpu_check(device_ids, gpu0_bsz):
    torch.manual_seed(0)
    model = tiny_bert_classifier().cuda()
    reference = tiny_bert_classifier().cuda()
    ids = torch.randint(5, 50, (7, 8), device="cuda")
    labels = torch.randint(0, 2, (7,), device="cuda")
    dp = BalancedDataParallel(model, device_ids=device_ids, gpu0_bsz=gpu0_bsz)
    out = dp(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=False, token_type_ids=None)
    expected = reference(input_ids=ids, attention_mask=torch.ones_like(ids))
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    assert out.logits.device == torch.device("cuda", device_ids[0])
    loss = torch.nn.functional.cross_entropy(out.logits, labels, reduction="sum")
    loss.backward()
    torch.nn.functional.cross_entropy(expected.logits, labels, reduction="sum").backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        dp(input_ids=ids, num_items_in_batch=torch.ones(len(device_ids), 1, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("gpu0_bsz", [0, 1, 3])
def test_real_data_parallel_path_on_one_gpu(gpu0_bsz):
    # Two replicas on one GPU run nn.DataParallel's real scatter / replicate / parallel_apply / gather.
    _gpu_check([0, 0], gpu0_bsz)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("gpu0_bsz", [0, 2])
def test_real_data_parallel_on_two_gpus(gpu0_bsz):
    _gpu_check([0, 1], gpu0_bsz)
