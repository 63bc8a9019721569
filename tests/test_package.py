"""The package: its public names resolve through the lazy loader, and `hf_parallel.Trainer` / `TrainingArguments` are
a drop-in for transformers' (same losses and weights as stock where stock is already exact)."""

import pytest
import torch
import transformers

import hf_parallel
from hf_parallel import Trainer, TrainingArguments
from tests.helpers.harness import Topology, run_case


def test_public_names():
    assert set(hf_parallel.__all__) >= {"Trainer", "TrainingArguments"}
    # Every public name resolves through the lazy loader, and the loader knows no name that is not public.
    assert set(hf_parallel._EXPORTS) == set(hf_parallel.__all__) - {"__version__"}
    for name in hf_parallel.__all__:
        assert getattr(hf_parallel, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        hf_parallel.Trainr  # noqa: B018
    assert issubclass(Trainer, transformers.Trainer)
    assert issubclass(TrainingArguments, transformers.TrainingArguments)


def test_callback_names_are_public():
    for name in ("PeakMemoryCallback", "Gpu0BszAdvisorCallback", "suggest_gpu0_bsz"):
        assert name in hf_parallel.__all__ and hasattr(hf_parallel, name)


def test_drop_in_single_process_matches_stock():
    # transformers' own optimizer, schedule and clipping over 3 logged steps, not the harness's one plain SGD step.
    defaults = {name: getattr(transformers.TrainingArguments, name) for name in ("optim", "lr_scheduler_type")}
    overrides = dict(train_rows=12, eval_rows=0, max_steps=3, learning_rate=1e-2, max_grad_norm=1.0, **defaults)
    topology = Topology("one process x 4", per_device=4)
    stock = run_case("bert_single_label", topology, stock=True, **overrides)
    ours = run_case("bert_single_label", topology, **overrides)
    assert len(stock.losses) == 3
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(stock.losses), rtol=1e-6, atol=0)
    assert stock.params.keys() == ours.params.keys()
    for name in stock.params:
        torch.testing.assert_close(ours.params[name], stock.params[name], rtol=1e-6, atol=1e-7, msg=name)
