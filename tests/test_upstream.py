"""The upstream contract (hf_parallel.upstream): every hook and attribute we rely on still exists as we use it. An
upgrade of transformers or accelerate that changes one fails here, by name, instead of training wrongly."""

from __future__ import annotations

import inspect

import pytest
import transformers
from packaging.version import Version

from hf_parallel import Seq2SeqTrainer, Trainer, TrainerMixin
from hf_parallel.upstream import (
    CALLED,
    CHECKED_IN,
    GRADIENT_STATE_ATTRIBUTES,
    HOOKS,
    INSTANCE_ATTRIBUTES,
    NOT_OVERRIDDEN,
    TRAINING_ATTRIBUTES,
    temporarily,
)
from tests.harness import training_args
from tests.paths import ROOT
from tests.tiny import classification_rows, tiny_bert_classifier

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


def test_ci_checks_the_releases_the_table_names():
    run = (ROOT / ".ci" / "run").read_text()
    for transformers_version, accelerate_version in CHECKED_IN:
        assert f"transformers=={transformers_version}" in run or transformers_version == CHECKED_IN[-1][0], run
        assert f"accelerate=={accelerate_version}" in run or accelerate_version == CHECKED_IN[-1][1]
