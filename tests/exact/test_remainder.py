"""
The padded last step of an epoch under DDP (`hf_parallel.exact.remainder`): which rows of a rank's last batch are
real, and how padding rows are left out of the targets and the counts. The end-to-end runs (DDP ranks against one
device on the leftover rows) are in tests/test_exact_loss.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_parallel.exact import CrossEntropyHead, ExactLoss, QuestionAnsweringHead, count_step
from hf_parallel.exact.remainder import (
    TARGET_KEYS,
    first_rows,
    mask_padding,
    packed_sample_ids,
    real_rows,
    sample_ids_of,
)


@pytest.mark.parametrize(
    ("rows", "remainder", "process_index", "real"),
    [
        (4, 2, 0, 2),  # 2 real rows left for 2 ranks of 4: rank 0 holds both
        (4, 2, 1, 0),  # rank 1 holds only padding
        (4, 6, 1, 2),  # 6 left: rank 0 holds 4, rank 1 the other 2
        (4, 8, 1, 4),  # a whole step left: every row real
        (4, 0, 0, None),  # the epoch divides evenly: no padding, nothing to mark
        (4, -1, 1, None),  # not known (an iterable set each rank reads itself, uncounted)
    ],
)
def test_real_rows_of_each_rank(rows, remainder, process_index, real):
    assert real_rows(rows, remainder=remainder, process_index=process_index) == real


def test_padding_rows_are_ignored_in_the_targets_not_dropped():
    labels = {"labels": torch.tensor([[1, 2], [3, 4], [5, 6]]), "shift_labels": torch.tensor([[2, -100], [4, -100]])}
    masked = mask_padding(labels, TARGET_KEYS, real=1, sample_ids=None)
    assert masked["labels"].tolist() == [[1, 2], [-100, -100], [-100, -100]]
    assert masked["shift_labels"].tolist() == [[2, -100], [-100, -100]]
    assert labels["labels"].tolist() == [[1, 2], [3, 4], [5, 6]]  # the caller's labels are not changed


def test_packed_rows_mask_the_padding_samples_of_a_row():
    # DataCollatorWithFlattening's one row of samples 0, 0, 1, 1, 1, 2: the first sample is real.
    batch = {"position_ids": torch.tensor([[0, 1, 0, 1, 2, 0]]), "labels": torch.tensor([[1, 2, 3, 4, 5, 6]])}
    ids = packed_sample_ids(batch)
    assert ids.tolist() == [0, 0, 1, 1, 1, 2]
    assert sample_ids_of(CrossEntropyHead(per_position=True), batch).tolist() == ids.tolist()
    assert sample_ids_of(CrossEntropyHead(), batch) is None  # not a per-position head: never packed
    masked = mask_padding({"labels": batch["labels"]}, TARGET_KEYS, real=1, sample_ids=ids)
    assert masked["labels"].tolist() == [[1, 2, -100, -100, -100, -100]]


def test_counts_leave_the_padding_rows_out():
    """The step knows its padded micro-batch's real rows (`real_rows`); the batch itself carries no mark."""
    exact = ExactLoss()
    batch = {"labels": torch.tensor([[1, 2, -100], [3, 4, 5]])}
    step = count_step(exact, CrossEntropyHead(), [batch], real_rows=(1,))
    assert step.counts.tolist() == [2]  # row 1 is padding
    assert count_step(exact, CrossEntropyHead(), [batch]).counts.tolist() == [5]
    assert list(batch) == ["labels"]
    qa = {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])}
    qa["attention_mask"] = torch.ones(2, 8)
    assert count_step(exact, QuestionAnsweringHead(), [qa], real_rows=(1,)).counts.tolist() == [1, 1]
    assert first_rows(qa, ("start_positions",), 1)["start_positions"].tolist() == [1]


def test_a_step_finds_its_padded_micro_batch_by_its_tensors():
    """The micro-batch a loss is asked for is found among the step's by its tensors (the same ones, or equal ones on
    another device, or a copy); one that is none of them is refused, naming the fix."""
    exact = ExactLoss()
    first, last = {"labels": torch.tensor([[1, 2, 3]])}, {"labels": torch.tensor([[4, 5, 6], [7, 8, 9]])}
    step = count_step(exact, CrossEntropyHead(), [first, last], real_rows=(None, 1))
    assert step.real_rows_of(dict(last)) == 1  # another dict, the same tensors (what the Trainer's preparation makes)
    assert step.real_rows_of({"labels": last["labels"].clone()}) == 1  # a copy
    assert step.real_rows_of(first) is None
    with pytest.raises(ValueError, match="not one of the step's counted micro-batches"):
        step.real_rows_of({"labels": torch.tensor([[0, 0, 0]])})
    assert count_step(exact, CrossEntropyHead(), [first, last]).real_rows_of({"labels": torch.zeros(1)}) is None


def test_every_rank_marks_the_last_batch_of_a_padded_epoch_alike():
    """
    A rank whose last batch is all real marks it too (as many real rows as it holds): what depends on a padded step
    (the check of a head skips a padded forward, and the check's vote is a collective) must take the same path on
    every rank, or the ranks wait on each other.
    """
    from torch.utils.data import DataLoader, DistributedSampler

    from hf_parallel.exact.remainder import EpochEnd, LoopPadding, padded_rows

    head = QuestionAnsweringHead()
    batch = {"start_positions": torch.arange(4), "end_positions": torch.arange(4)}
    # 14 rows for 2 ranks x 4 x 2 micro-batches: the last global batch holds 6 real rows, rank 0 its 4, rank 1 two.
    marks = [padded_rows(head, [batch, batch], EpochEnd(6, False), rank, True, print) for rank in (0, 1)]
    assert marks == [(None, 4), (None, 2)]
    assert padded_rows(head, [batch], EpochEnd(0, False), 0, True, print) == ()  # the epoch divides evenly

    # A DistributedSampler's padding in a hand-written loop: 5 samples for 2 ranks, batches of 2; rank 0 reads
    # samples 0, 2, 4 (all real), rank 1 reads 1, 3 and sample 0 again.
    rows = [{"start_positions": torch.tensor([i]), "end_positions": torch.tensor([i])} for i in range(5)]
    seen = []
    for rank in (0, 1):
        loader = DataLoader(rows, batch_size=2, sampler=DistributedSampler(rows, 2, rank, shuffle=False))
        padding = LoopPadding(ExactLoss(), loader, "x", None, rank, 2)
        seen.append([padding.mark(head, [b], None) for b in loader])
    assert seen == [[(), (1,)], [(), (0,)]]
    even = [{"start_positions": torch.tensor([i]), "end_positions": torch.tensor([i])} for i in range(4)]
    loader = DataLoader(even, batch_size=2, sampler=DistributedSampler(even, 2, 1, shuffle=False))
    padding = LoopPadding(ExactLoss(), loader, "x", None, 1, 2)
    assert [padding.mark(head, [b], None) for b in loader] == [()]  # no padding: nothing marked
