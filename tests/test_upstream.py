"""The upstream contract (hf_parallel.upstream): every hook and attribute we rely on still exists as we use it. An
upgrade of transformers or accelerate that changes one fails here, by name, instead of training wrongly."""

from __future__ import annotations

import ast
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
    PRIVATE_NAMES,
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


def test_temporarily_lets_a_shadowed_method_show_through_again():
    class Box:
        def value(self):
            return "the class's"

    box, own = Box(), Box()
    own.value = lambda: "the instance's"
    with temporarily(box, "value", lambda: "within"), temporarily(own, "value", lambda: "within"):
        assert box.value() == own.value() == "within"
    # Not left as an instance attribute (a bound method kept on it would hide a later patch of the class).
    assert "value" not in vars(box) and box.value() == "the class's"
    assert own.value() == "the instance's"  # an instance attribute before stays one
    Box.value = lambda self: "patched"
    assert box.value() == "patched"
    # A submodule lives in `_modules`, not in the instance's dict: set back, not removed.
    wrapper, inner = torch.nn.Sequential(torch.nn.Linear(1, 1)), torch.nn.Linear(1, 1)
    before = wrapper[0]
    with temporarily(wrapper, "0", inner):
        assert wrapper[0] is inner
    assert wrapper[0] is before


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


# ---- Private names of torch, DeepSpeed, transformers and accelerate ----


def _resolve(path: str):
    """The module or class a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            found = getattr(found, part)
        return found
    raise ImportError(path)


@pytest.mark.parametrize("row", PRIVATE_NAMES, ids=[f"{row.owner}.{row.name}" for row in PRIVATE_NAMES])
def test_private_names_we_rely_on_exist(row):
    if row.owner.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="DeepSpeed's rows are checked where it is installed (CI's first env)")
    if row.owner.startswith("trl."):
        pytest.importorskip("trl", reason="TRL's rows are checked where it is installed (the test extra)")
    if row.owner == "transformers.loss.loss_lw_detr":
        pytest.importorskip(row.owner, reason="a release without LW-DETR; the code guards the import")
    if row.source is not None:
        source = inspect.getsource(_resolve(row.source))
        assert row.name in source, f"{row.source} no longer uses {row.name} ({row.why})"
    else:
        assert hasattr(_resolve(row.owner), row.name), f"{row.owner}.{row.name} is gone ({row.why})"


# Private names any Python object of these kinds has (NamedTuple's documented API, os._exit).
_PYTHON = {"_fields", "_make", "_replace", "_asdict", "_exit"}


def _private_uses() -> dict[str, list[str]]:
    """
    Every `_`-prefixed name hf_parallel reaches on an object other than its own `self`, `cls` or `super()`: attributes,
    names imported from other packages, and names given to getattr / hasattr / setattr / delattr; by name, where.
    """
    package = ROOT / "hf_parallel"
    uses: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute):
                base = node.value
                own = (isinstance(base, ast.Name) and base.id in ("self", "cls")) or (
                    isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
                )
                name = None if own else node.attr
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                for alias in node.names:
                    if alias.name.startswith("_") and not node.module.startswith("hf_parallel"):
                        uses.setdefault(alias.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
                if node.func.id in ("getattr", "hasattr", "setattr", "delattr"):
                    argument = node.args[1]
                    name = argument.value if isinstance(argument, ast.Constant) else None
            if isinstance(name, str) and name.startswith("_") and not name.startswith("__"):
                uses.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return uses


def test_every_private_name_of_another_library_is_in_the_contract():
    contract = (
        {row.name for row in PRIVATE_NAMES}
        | {part for row in PRIVATE_NAMES for part in row.owner.split(".") if part.startswith("_")}
        | {name for _, name, _ in (*PRIVATE_ATTRIBUTES, *IMPORTED_NAMES, *INSTANCE_ATTRIBUTES, *TRAINING_ATTRIBUTES)}
        | {hook.name for hook in HOOKS}
        | {name for name, _, _ in CALLED}
    )
    # hf_parallel's own marks on objects it does not own (a wrapper's forward, a module, a dataloader's stream).
    marks = {name for name in _private_uses() if name.startswith("_hf_parallel")}
    outside = {name: where for name, where in _private_uses().items() if name not in contract | marks | _PYTHON}
    assert not outside, (
        "private names reached on objects that are not the code's own, outside hf_parallel/upstream.py's contract "
        f"(add a row with a test, use a public name, or make hf_parallel's own name public): {outside}"
    )
