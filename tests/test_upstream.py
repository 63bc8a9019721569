"""The upstream contract (hf_parallel.upstream): every hook and attribute we rely on still exists as we use it. An
upgrade of transformers or accelerate that changes one fails here, by name, instead of training wrongly."""

from __future__ import annotations

import inspect

import pytest
import transformers

from hf_parallel import Trainer, TrainingArguments
from hf_parallel.upstream import HOOKS, INSTANCE_ATTRIBUTES, TRAINING_ATTRIBUTES, temporarily
from tests.tiny import classification_rows, tiny_bert_classifier


@pytest.mark.parametrize("hook", HOOKS, ids=[hook.name for hook in HOOKS])
def test_hook_signatures_match_upstream(hook):
    upstream = inspect.signature(getattr(transformers.Trainer, hook.name))
    assert tuple(upstream.parameters) == hook.parameters, f"transformers changed Trainer.{hook.name}"
    ours = inspect.signature(getattr(Trainer, hook.name))
    assert tuple(ours.parameters) == hook.parameters
    for param in upstream.parameters.values():
        assert ours.parameters[param.name].default == param.default, (hook.name, param.name)


def test_every_overridden_hook_is_in_the_table():
    listed = {hook.name for hook in HOOKS}
    overridden = {
        name
        for name, value in vars(Trainer).items()
        if callable(value) and not name.startswith("__") and hasattr(transformers.Trainer, name)
    }
    assert overridden <= listed, f"overrides missing from hf_parallel.upstream.HOOKS: {sorted(overridden - listed)}"


def test_attributes_we_rely_on_exist(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, per_device_train_batch_size=2, report_to=[],
        save_strategy="no",
    )  # fmt: skip
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
