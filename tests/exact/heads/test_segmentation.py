"""
Semantic segmentation with an auxiliary head (`use_auxiliary_head=True`): BEiT (its loss through `loss_function`), DPT
and UperNet (inline), each with batch normalisation in its heads. The auxiliary logits are not in the outputs; the
head records them from the model's `auxiliary_head` and adds `auxiliary_loss_weight` x their per-pixel sums.

One forward per step (one process, the step's rows in one batch): the model's own loss and gradient. Under gradient
accumulation batch normalisation takes each micro-batch's statistics, as on one device with accumulation: the
reference is then the model's own loss on each micro-batch, weighted by its labelled pixels (warned, naming the split);
stock takes the mean of the micro-batches' means (x2 here: it does not divide by the accumulation steps).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.data.data_collator import default_data_collator

import hf_parallel
from hf_parallel.exact import resolve_head
from tests.helpers.harness import GA2, SINGLE, TRAIN_ROWS, max_relative_diff, record_hf_parallel_log, run_case
from tests.helpers.heads import Case
from tests.helpers.tiny import tiny

TOL = 1e-5
CLASSES = 3


def _deterministic(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout off everywhere (DPT's auxiliary head hard-codes 0.1): the reference's forwards draw nothing."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _beit(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny(
        transformers.BeitConfig,
        image_size=16,
        patch_size=8,
        num_labels=CLASSES,
        num_hidden_layers=4,
        out_indices=[0, 1, 2, 3],
        use_auxiliary_head=True,
        auxiliary_channels=8,
        pool_scales=[1, 2],
        initializer_range=0.5,
        drop_path_rate=0.0,
    )
    return _deterministic(transformers.BeitForSemanticSegmentation(config))


def _dpt(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny(
        transformers.DPTConfig,
        image_size=16,
        patch_size=8,
        num_labels=CLASSES,
        num_hidden_layers=4,
        backbone_out_indices=[0, 1, 2, 3],
        neck_hidden_sizes=[8, 8, 8, 8],
        fusion_hidden_size=8,
        use_auxiliary_head=True,
    )
    return _deterministic(transformers.DPTForSemanticSegmentation(config))


def _upernet(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    backbone = transformers.ConvNextConfig(
        hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1], out_features=["stage1", "stage2", "stage3", "stage4"]
    )
    config = transformers.UperNetConfig(
        backbone_config=backbone,
        hidden_size=8,
        auxiliary_channels=8,
        num_labels=CLASSES,
        use_auxiliary_head=True,
        pool_scales=[1, 2],
    )
    return transformers.UperNetForSemanticSegmentation(config)


def _rows(size: int):
    def rows(n: int, seed: int) -> list[dict]:
        """Label maps with uneven ignored bands (255), one image wholly ignored."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for i in range(n):
            labels = torch.randint(0, CLASSES, (size, size), generator=g)
            labels[: (0, size // 4, size, size // 2, 1)[i % 5]] = 255
            out.append({"pixel_values": torch.randn(3, size, size, generator=g), "labels": labels})
        return out

    return rows


CASES = {
    "beit": Case("beit_auxiliary", _beit, _rows(16)),
    "dpt": Case("dpt_auxiliary", _dpt, _rows(16)),
    "upernet": Case("upernet_auxiliary", _upernet, _rows(64)),  # ConvNeXt's 4 stages halve 64 pixels to 2
}


class RecordingTrainer(hf_parallel.Trainer):
    """Records the micro-batches a step trains on, in order (the sampler shuffles the rows)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.micro_batches = [*getattr(self, "micro_batches", []), {k: v.clone() for k, v in inputs.items()}]
        return super().training_step(model, inputs, num_items_in_batch)


def _own(case: Case, batches: list[dict]) -> tuple[float, dict]:
    """The model's own loss on each batch (train mode), weighted by its labelled pixels, and its gradient."""
    model = case.build(0)
    total = sum(int(batch["labels"].ne(255).sum()) for batch in batches)
    loss = sum(model(**batch).loss * (int(batch["labels"].ne(255).sum()) / total) for batch in batches)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(CASES))
def test_one_forward_per_step_is_the_models_own_loss(name):
    case = CASES[name]
    assert resolve_head(case.build(0)).auxiliary_weight == pytest.approx(0.4)
    loss, grads = _own(case, [default_data_collator(case.rows(TRAIN_ROWS, 1))])
    with record_hf_parallel_log() as log:
        result = run_case(case, SINGLE, eval_rows=0)
    assert "left to the Trainer" not in log.text, log.text
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < 1e-4  # DPT's float32 rounding reaches 1.6e-5


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_accumulation_is_the_micro_batches_own_losses_by_their_pixels(name):
    case = CASES[name]
    with record_hf_parallel_log() as log:
        ours = run_case(case, GA2, classes=(RecordingTrainer, hf_parallel.TrainingArguments), eval_rows=0)
    warnings = [message for message in log.messages if "batch normalisation" in message]
    assert len(warnings) == 1 and "2 accumulated micro-batches" in warnings[0], log.text
    assert "left to the Trainer" not in log.text, log.text
    loss, grads = _own(case, ours.trainer.micro_batches)
    assert ours.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(ours.grads, grads) < 1e-4
    stock = run_case(case, GA2, stock=True, eval_rows=0)
    assert abs(stock.loss / loss - 1) > 0.3  # the control: stock's mean of means, not divided by the steps
