"""The package: its public names resolve through the lazy loader, and `hf_parallel.Trainer` / `TrainingArguments` are
a drop-in for transformers' (same losses and weights as stock where stock is already exact)."""

import ast
import configparser
import importlib.metadata
import re
import sys

import pytest
import torch
import transformers

import hf_parallel
from hf_parallel import Trainer, TrainingArguments
from tests.helpers.harness import Topology, run_case
from tests.helpers.paths import ROOT


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


# transformers' own optional needs for the families the tests train: its DETR matcher (scipy) and the box helpers it
# imports only where Pillow is. No test imports them itself.
TRANSFORMERS_NEEDS = {"scipy", "pillow"}


def _distribution(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _closure(names: set[str]) -> set[str]:
    """`names` and every distribution they require, as installed here."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_distribution(r) for r in requires if "extra ==" not in r]
    return seen


def _module_level_imports() -> set[str]:
    """The top-level modules every test module and helper imports at its top (what must be there to collect)."""
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"tests", "hf_parallel", "examples", "benchmarks", "__future__"}


def test_the_test_extra_carries_what_the_tests_need():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    declared = {_distribution(line) for line in config["options"]["install_requires"].splitlines() if line.strip()}
    test_extra = {
        _distribution(line)
        for line in config["options.extras_require"]["test"].splitlines()
        if line.strip() and not line.strip().startswith("#")
    }
    assert TRANSFORMERS_NEEDS <= test_extra, TRANSFORMERS_NEEDS - test_extra
    installed = _closure(declared | test_extra | {"torch"})
    distributions = importlib.metadata.packages_distributions()
    missing = {
        module: distributions.get(module)
        for module in _module_level_imports()
        if not {_distribution(d) for d in distributions.get(module, [module])} & installed
    }
    assert not missing, f"imported at the top of tests but not brought by `pip install -e .[test]`: {missing}"
