"""One micro-batch's forward and terms (`hf_parallel.exact.forward`): a user loss's count, packed rows."""

from __future__ import annotations

import torch

from hf_parallel.exact import ExactLoss, Route, RunContext, count_step, micro_batch_loss
from hf_parallel.exact.step import sample_terms, split_labels
from tests.helpers.heads import CASES


def test_a_user_loss_function_gets_the_exact_count():
    seen = {}

    def loss_func(outputs, labels, num_items_in_batch):
        seen["count"] = int(num_items_in_batch)
        return outputs["logits"].sum() * 0

    class Logits(torch.nn.Module):  # a model hf_parallel knows no head of
        def forward(self, **inputs):
            return {"logits": torch.ones(1)}

    exact, model = ExactLoss(label_names=["labels"]), Logits()
    head = exact.head(model, loss_func=loss_func, loss_func_shifts=True)
    assert head.name == "compute_loss_func" and head.shift and head.route is Route.USER_LOSS
    batches = [{"labels": torch.tensor([[1, 2, 3]])}, {"labels": torch.tensor([[4, -100, -100]])}]
    step = count_step(exact, head, batches)
    micro_batch_loss(exact, model, head, batches[0], step, RunContext(loss_func=loss_func))
    assert seen["count"] == 2  # shifted: 2 targets in the first row, none in the second


def test_a_packed_row_is_split_into_its_samples():
    """`DataCollatorWithFlattening` packs sequences into one row: its sums and counts are its sequences', each sequence
    a sample (the samples from `real` on, an epoch's padding, add nothing)."""
    from transformers import DataCollatorWithFlattening

    model = CASES["llama_causal_lm"].build(0).eval()
    sequences = [row["input_ids"][row["attention_mask"].bool()] for row in CASES["llama_causal_lm"].rows(5, 3)]
    packed = DataCollatorWithFlattening()([{"input_ids": s.tolist(), "labels": s.tolist()} for s in sequences])
    head = ExactLoss().head(model, packed)
    with torch.no_grad():
        inputs, labels = split_labels(head, packed, model)
        outputs = model(**inputs)
        expected_sums, expected_counts = [0.0], [0]  # the first `real` sequences' sums and counts, per `real`
        for ids in sequences:
            alone = model(input_ids=ids[None]).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(alone, ids[1:], reduction="sum") if len(ids) > 1 else 0.0
            expected_sums.append(expected_sums[-1] + float(loss))
            expected_counts.append(expected_counts[-1] + len(ids) - 1)
        for real in (None, *range(len(sequences) + 1)):
            # Added up in the one row (counting the samples would read a value off the device).
            sums, counts = sample_terms(head, outputs, dict(labels), inputs, real=real)
            index = len(sequences) if real is None else real
            assert sums.shape == (1, 1) and counts.shape == (1, 1)
            expected = torch.as_tensor(expected_sums[index], dtype=sums.dtype)
            torch.testing.assert_close(sums[0, 0], expected, rtol=1e-5, atol=1e-5)
            assert counts[0, 0].item() == expected_counts[index]
