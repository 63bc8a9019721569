"""
The README and the docs site say what is true today: every Python code block runs (tests/helpers/docs_blocks.py), the
README stays short and its links resolve, its set-up and test commands are the ones CI runs, and the command reference
lists every option of `hf-parallel`. The site's own links and API references are checked by its strict build (`mkdocs
build --strict` in .ci/run).
"""

from __future__ import annotations

import argparse
import re

import pytest

from hf_parallel.commands.main import build_parser
from tests.helpers.docs_blocks import ROOT, SKIP_REASONS, markdown_pages, python_blocks, run_page
from tests.helpers.docs_setups import SETUPS

PAGES = markdown_pages()
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")

pytestmark = pytest.mark.usefixtures("no_gpus")

# Packages of the `test` extra a page may import, which a machine installed without it lacks (a GPU image without
# trl or datasets): such a page skips there, as tests/test_trl.py does.
OPTIONAL_IMPORTS = re.compile(r"^(?:from|import) (trl|datasets|peft)\b", re.M)


# Pages whose blocks launch ranks or train for long (about 30 s): in CI's `full` step, out of the default 8 minutes.
LONG_PAGES = ("docs/how-to/custom-loop.md",)


def _page(page):
    name = str(page.relative_to(ROOT))
    return pytest.param(page, id=name, marks=[pytest.mark.full] if name in LONG_PAGES else [])


@pytest.mark.parametrize("page", [_page(p) for p in PAGES if python_blocks(p)])
def test_python_blocks_run(page, tmp_path, monkeypatch):
    imported = {m.group(1) for block in python_blocks(page) for m in OPTIONAL_IMPORTS.finditer(block.code)}
    for package in sorted(imported):
        pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    skipped = run_page(page, SETUPS, tmp_path)
    if skipped:
        pytest.skip("; ".join(f"line {block.line}: {block.skip}" for block in skipped) + " (the others ran)")


def test_blocks_name_known_setups_and_skip_only_for_a_gpu_or_the_hub():
    blocks = [block for page in PAGES for block in python_blocks(page)]
    assert len(blocks) >= 15, len(blocks)  # the parser found the blocks
    for block in blocks:
        where = f"{block.path.relative_to(ROOT)}:{block.line}"
        assert set(block.setups) <= set(SETUPS), (where, block.setups)
        assert block.skip is None or block.skip.startswith(SKIP_REASONS), (where, block.skip)


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    targets = [m.group(1) for m in LINK.finditer(text) if not m.group(1).startswith(("http://", "https://"))]
    assert targets, "the README links to the docs"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing


def test_readme_quick_start_is_what_ci_runs():
    readme = README.read_text(encoding="utf-8")
    quick_start = re.search(r"## Quick start\n+```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").replace(" -q -e", " -e").replace("install -q ", "install ")
    setup, main_job, tests = quick_start
    assert setup in ci, setup
    assert any(line.strip().startswith(f"{tests} ") or line.strip() == tests for line in ci.splitlines()), tests
    assert main_job == "python examples/train.py"  # CI runs it through tests/test_examples.py


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings if o not in ("-h", "--help")}


def test_cli_reference_lists_every_option():
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in subparsers.choices.items():
        section = page.split(f"## `hf-parallel {name}`")[1].split("\n## ")[0]
        documented = set(re.findall(r"`(--?[a-z][\w-]*)", section))
        assert documented == _options(parser), name
