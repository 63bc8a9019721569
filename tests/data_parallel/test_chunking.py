"""The split arithmetic: balanced_chunk_sizes and suggest_gpu0_bsz (property tests), and the one check of the split
options that BalancedDataParallel and TrainingArguments share."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_parallel import BalancedDataParallel, TrainingArguments, balanced_chunk_sizes, suggest_gpu0_bsz
from hf_parallel.data_parallel.chunking import gpu0_balance

BATCH = st.integers(0, 300)
DEVICES = st.integers(1, 9)
GPU0_BSZ = st.none() | st.integers(0, 200)
GPU0_WEIGHT = st.floats(0, 1, allow_nan=False) | st.sampled_from([0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0])
# A linear memory model (memory = constant + per-row cost x rows), measured at an even split.
LINEAR_MEMORY = (
    st.integers(2, 8),  # GPUs
    st.integers(1, 64),  # rows per GPU at the even split
    st.integers(1, 1000),  # per-row memory
    st.integers(0, 50_000),  # constant memory of the other GPUs
    st.integers(0, 100_000),  # GPU 0's extra constant memory
)


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
        (52, 3, {"gpu0_bsz": 16}, [16, 18, 18]),  # the examples usually quoted for BalancedDataParallel
        (53, 3, {"gpu0_bsz": 16}, [16, 19, 18]),
        (10, 3, {"gpu0_bsz": 3}, [3, 4, 3]),  # the anchors give [4, 4, 2]: 4 rows on GPU 0, above gpu0_bsz
        (32, 2, {"gpu0_bsz": 14}, [14, 18]),  # the 2-GPU example usually quoted
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
        ((10, 2, -1, None), "gpu0_bsz must be a whole number >= 0, got -1"),
        ((10, 2, 1.5, None), r"gpu0_bsz must be a whole number >= 0, got 1\.5"),
        ((10, 2, True, None), "gpu0_bsz must be a whole number >= 0, got True"),
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


@pytest.mark.parametrize(
    "peaks, rows, static, expected",
    [
        ([20e9, 12e9], [16, 16], 4e9, 8),  # the docstring's example: both end at 16 GB
        ([20e9, 12e9], [16, 16], 0.0, 10),  # no static part: per-row cost overestimated, fewer rows moved
        ([12e9, 12e9, 12e9], [16, 16, 16], 4e9, 16),  # already even: the even share (no gpu0_bsz needed)
        ([30e9, 10e9, 10e9], [8, 8, 8], 2e9, 0),  # GPU 0 too heavy for any rows: 0
        ([14e9, 12e9, 12e9], [4, 10, 10], 2e9, 2),  # measured under a balanced split already
    ],
)
def test_suggest_gpu0_bsz_examples(peaks, rows, static, expected):
    assert suggest_gpu0_bsz(peaks, rows, static) == expected


@pytest.mark.parametrize(
    "peaks, rows, static, message",
    [
        ([1.0], [1], 0.0, "at least two GPUs"),
        ([1.0, 2.0], [1], 0.0, "one peak and one row count per GPU"),
        ([1.0, float("nan")], [1, 1], 0.0, "finite numbers"),
        ([1.0, 2.0], [1, -1], 0.0, "whole numbers"),
        ([1.0, 2.0], [2, 0], 0.0, "had no rows"),
        ([5.0, 2.0], [1, 1], 3.0, "not above static_memory"),
        ([5.0, 2.0], [1, 1], -1.0, "static_memory must be"),
    ],
)
def test_suggest_gpu0_bsz_rejects_bad_measurements(peaks, rows, static, message):
    with pytest.raises(ValueError, match=message):
        suggest_gpu0_bsz(peaks, rows, static)
    with pytest.raises(ValueError, match=message):
        gpu0_balance(peaks, rows, static)


@settings(max_examples=1000, deadline=None)
@given(*LINEAR_MEMORY)
def test_suggestion_evens_out_a_linear_memory_model(n, per_gpu, per_row, static, extra):
    # Memory = constant + per_row x rows on every GPU, GPU 0's constant larger by `extra`; measured at an even split.
    batch = n * per_gpu
    rows = [per_gpu] * n
    peaks = [float(static + extra + per_row * per_gpu)] + [float(static + per_row * per_gpu)] * (n - 1)
    g = suggest_gpu0_bsz(peaks, rows, float(static))
    assert 0 <= g <= per_gpu

    def gpu0(rows0):
        return static + extra + per_row * rows0

    def others(rows0):  # the mean of the other GPUs once they share the rest
        return static + per_row * (batch - rows0) / (n - 1)

    if g > 0:
        assert gpu0(g) <= others(g) + 1e-6  # GPU 0 no heavier than the others...
    if g < per_gpu:
        assert gpu0(g + 1) > others(g + 1) - 1e-6  # ...and one more row would make it heavier
    # Without the static part the per-row cost is overestimated: the suggestion moves no more rows than needed.
    assert g <= suggest_gpu0_bsz(peaks, rows, 0.0) <= per_gpu


@pytest.mark.parametrize(
    "peaks, rows, static, balanced_rows, gpu0_empty, others_full",
    [
        # Peaks [70, 30, 30, 30] GB on 32 rows, 10 GB of weights: with no rows GPU 0 still peaks at 50 GB, above the
        # others' 36.7 GB with all 32 rows, so no gpu0_bsz evens the load (suggest_gpu0_bsz clamps to 0).
        ([70e9, 30e9, 30e9, 30e9], [8, 8, 8, 8], 10e9, -4.0, 50e9, 30e9 + 2.5e9 * (32 / 3 - 8)),
        ([30e9, 10e9, 10e9], [8, 8, 8], 2e9, -16 / 3, 22e9, 14e9),
        ([20e9, 12e9], [16, 16], 4e9, 8.0, 12e9, 20e9),  # evened at 8 rows: both at 16 GB
        ([12e9, 12e9, 12e9], [16, 16, 16], 4e9, 16.0, 4e9, 16e9),  # even already: the even share
        ([10e9, 14e9], [8, 8], 6e9, 10.0, 2e9, 22e9),  # GPU 0 the lower one: above the even share
    ],
)
def test_gpu0_balance_tells_whether_any_gpu0_bsz_evens_the_load(
    peaks, rows, static, balanced_rows, gpu0_empty, others_full
):
    balance = gpu0_balance(peaks, rows, static)
    assert balance.rows == pytest.approx(balanced_rows)
    assert balance.gpu0_empty == pytest.approx(gpu0_empty)
    assert balance.others_full == pytest.approx(others_full)
    assert (balance.rows < 0) == (balance.gpu0_empty > balance.others_full)
    even_share = sum(rows) // len(rows)
    assert suggest_gpu0_bsz(peaks, rows, static) == max(0, min(even_share, math.floor(balanced_rows)))


@settings(max_examples=1000, deadline=None)
@given(*LINEAR_MEMORY)
def test_gpu0_balance_predicts_a_linear_memory_model(n, per_gpu, per_row, static, extra):
    # The memory model of test_suggestion_evens_out_a_linear_memory_model, with the static part known exactly.
    batch = n * per_gpu
    peaks = [float(static + extra + per_row * per_gpu)] + [float(static + per_row * per_gpu)] * (n - 1)
    balance = gpu0_balance(peaks, [per_gpu] * n, float(static))
    assert balance.gpu0_empty == pytest.approx(static + extra)
    assert balance.others_full == pytest.approx(static + per_row * batch / (n - 1))
    # Below 0 rows exactly when GPU 0's extra alone outweighs the whole batch spread over the others.
    if extra * (n - 1) > per_row * batch:
        assert balance.rows < 0 and suggest_gpu0_bsz(peaks, [per_gpu] * n, float(static)) == 0
    elif extra * (n - 1) < per_row * batch:
        assert balance.rows > 0


BAD_SPLIT_OPTIONS = {
    # options: the error every caller raises
    "both": ({"gpu0_bsz": 1, "gpu0_weight": 0.5}, r"Set at most one of gpu0_bsz \(1\) and gpu0_weight \(0\.5\)"),
    "negative rows": ({"gpu0_bsz": -1}, "gpu0_bsz must be a whole number >= 0, got -1"),
    "fractional rows": ({"gpu0_bsz": 2.5}, r"gpu0_bsz must be a whole number >= 0, got 2\.5"),
    "weight not a number": ({"gpu0_weight": "0.5"}, r"gpu0_weight must be a number in \[0, 1\], got '0\.5'"),
    "weight above 1": ({"gpu0_weight": 1.5}, r"gpu0_weight must be a finite number in \[0, 1\] .*got 1\.5"),
}


@pytest.mark.parametrize("case", list(BAD_SPLIT_OPTIONS))
def test_every_caller_checks_the_split_options_the_same_way(case, tmp_path):
    options, message = BAD_SPLIT_OPTIONS[case]
    with pytest.raises(ValueError, match=message):
        balanced_chunk_sizes(10, 2, **options)
    with pytest.raises(ValueError, match=message):
        BalancedDataParallel(nn.Linear(2, 2), **options)
    with pytest.raises(ValueError, match=message):
        TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, use_cpu=True, **options)
