"""The upstream contract (hf_parallel.upstream): every hook and attribute we rely on still exists as we use it. An
upgrade of transformers or accelerate that changes one fails here, by name, instead of training wrongly."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import transformers
from packaging.version import Version

from hf_parallel import Seq2SeqTrainer, Trainer, TrainerMixin
from hf_parallel.upstream import (
    CALLED,
    CHECKED_IN,
    GRADIENT_STATE_ATTRIBUTES,
    HOOKS,
    IMPORTED_NAMES,
    INSTANCE_ATTRIBUTES,
    NOT_OVERRIDDEN,
    PRIVATE_ATTRIBUTES,
    TRAINING_ATTRIBUTES,
    temporarily,
)
from tests.helpers.harness import training_args
from tests.helpers.paths import ROOT
from tests.helpers.tiny import classification_rows, tiny_bert_classifier

OURS = {"Trainer": Trainer, "Seq2SeqTrainer": Seq2SeqTrainer}


@pytest.mark.parametrize("hook", HOOKS, ids=[f"{hook.owner}.{hook.name}" for hook in HOOKS])
def test_hook_signatures_match_upstream(hook):
    upstream = inspect.signature(getattr(getattr(transformers, hook.owner), hook.name))
    assert tuple(upstream.parameters) == hook.parameters, f"transformers changed {hook.owner}.{hook.name}"
    ours = inspect.signature(getattr(OURS[hook.owner], hook.name))
    assert tuple(ours.parameters) == hook.parameters
    for param in upstream.parameters.values():
        assert ours.parameters[param.name].default == param.default, (hook.name, param.name)


@pytest.mark.parametrize(
    ("ours", "stock"), [(TrainerMixin, transformers.Trainer), (Seq2SeqTrainer, transformers.Seq2SeqTrainer)]
)
def test_every_overridden_hook_is_in_the_table(ours, stock):
    listed = {hook.name for hook in HOOKS}
    overridden = {
        name
        for name, value in vars(ours).items()
        if callable(value) and not name.startswith("__") and hasattr(stock, name)
    }
    assert overridden, f"{ours.__name__} overrides nothing of {stock.__name__}?"
    assert overridden <= listed, f"overrides missing from hf_parallel.upstream.HOOKS: {sorted(overridden - listed)}"


def test_attributes_we_rely_on_exist(tmp_path):
    args = training_args(tmp_path, max_steps=1, per_device_train_batch_size=2)
    trainer = Trainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_rows(4))
    owners = {"trainer": trainer, "accelerator": trainer.accelerator}
    for owner, name, why in INSTANCE_ATTRIBUTES:
        assert hasattr(owners[owner], name), f"{owner}.{name} is gone ({why})"
    assert hasattr(transformers.Trainer, "loss_is_scaled_for_ga")
    trainer.train()
    for owner, name, why in TRAINING_ATTRIBUTES:
        assert hasattr(owners[owner], name), f"{owner}.{name} is gone after training ({why})"


def test_temporarily_restores_even_on_error():
    class Box:
        value = 1

    box = Box()
    with pytest.raises(RuntimeError), temporarily(box, "value", 2):
        assert box.value == 2
        raise RuntimeError
    assert box.value == 1


@pytest.mark.parametrize(("name", "parameters", "why"), CALLED, ids=[row[0] for row in CALLED])
def test_called_methods_exist_with_their_parameters(name, parameters, why):
    stock = Seq2SeqTrainer if name in ("compute_loss_context_manager", "_prepare_inputs") else transformers.Trainer
    assert tuple(inspect.signature(getattr(stock, name)).parameters) == parameters, f"{name} changed ({why})"


@pytest.mark.parametrize(("name", "since", "why"), NOT_OVERRIDDEN, ids=[row[0] for row in NOT_OVERRIDDEN])
def test_newer_hooks_are_left_to_stock(name, since, why):
    # Present from `since` on, and never overridden by hf_parallel (a change there needs its own test first).
    assert hasattr(transformers.Trainer, name) == (Version(transformers.__version__) >= Version(since)), name
    assert name not in vars(TrainerMixin), f"{name} is overridden now: move it to HOOKS ({why})"


def test_gradient_state_attributes_exist():
    from accelerate.state import GradientState

    state = GradientState()
    for name in GRADIENT_STATE_ATTRIBUTES:
        assert hasattr(state, name), f"accelerate's GradientState.{name} is gone"


def _owners_of_private_attributes() -> dict:
    """The objects `PRIVATE_ATTRIBUTES` names, made by the installed accelerate and transformers."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)
    recorded = tiny_bert_classifier()
    recorded(input_ids=torch.ones(1, 4, dtype=torch.long), output_hidden_states=True)
    return {
        "prepared model": accelerator.prepare(tiny_bert_classifier()),
        "DataLoaderShard": accelerator.prepare(DataLoader(range(4), batch_size=2)),
        "accelerator": accelerator,
        "PreTrainedModel": recorded.base_model,  # the model whose forward records the hidden states
    }


def test_private_attributes_we_rely_on_exist():
    owners = _owners_of_private_attributes()
    assert type(owners["DataLoaderShard"]).__name__ == "DataLoaderShard"
    for owner, name, why in PRIVATE_ATTRIBUTES:
        assert hasattr(owners[owner], name), f"{owner}.{name} is gone ({why})"
    # The marks are set, not only declared: hf_parallel reads them with getattr(..., False).
    assert owners["prepared model"]._is_accelerate_prepared is True
    assert owners["PreTrainedModel"]._output_capturing_hooks_installed is True


@pytest.mark.parametrize(("module", "name", "why"), IMPORTED_NAMES, ids=[row[1] for row in IMPORTED_NAMES])
def test_imported_names_exist(module, name, why):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone ({why})"


def test_the_state_exact_loop_writes_steers_accumulate():
    # What ExactLoop writes (hf_parallel/loop.py, LoopStep._sync_at and ExactLoop._mark_padding) still means to
    # accelerate what it meant: the dataloader's `_drop_last` is the DataLoader's, its `end_of_dataloader` is the
    # GradientState's, and `accelerator.step` is the count accumulate() syncs on.
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    for drop_last in (False, True):
        assert accelerator.prepare(DataLoader(range(5), batch_size=2, drop_last=drop_last))._drop_last is drop_last
    loader = accelerator.prepare(DataLoader(range(8), batch_size=2))
    for index, _ in enumerate(loader):
        if index > 0:
            continue
        assert accelerator.gradient_state.active_dataloader is loader
        loader.end_of_dataloader = False
        for step, syncs in ((accelerator.gradient_state.num_steps - 1, True), (0, False)):
            accelerator.step = step
            with accelerator.accumulate(model):
                assert accelerator.sync_gradients is syncs, f"accelerator.step={step}"
        loader.end_of_dataloader = True
        assert accelerator.gradient_state.end_of_dataloader
        accelerator.step = 0
        with accelerator.accumulate(model):
            assert accelerator.sync_gradients, "end_of_dataloader no longer syncs accumulate()"
        loader.end_of_dataloader = False


def test_ci_checks_the_releases_the_table_names():
    run = (ROOT / ".ci" / "run").read_text()
    for transformers_version, accelerate_version in CHECKED_IN:
        assert f"transformers=={transformers_version}" in run or transformers_version == CHECKED_IN[-1][0], run
        assert f"accelerate=={accelerate_version}" in run or accelerate_version == CHECKED_IN[-1][1]
