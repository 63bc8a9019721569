"""
The Python code blocks of README.md and the docs site (docs/), as the test suite runs them.

A page runs its ```` ```python ```` blocks in order, in one namespace, in a fresh working folder. An HTML comment
(invisible on GitHub and on the site) before a block says what it needs:

- `<!-- docs-test: setup NAME -->`: the names that setup NAME of `SETUPS` defines (a tiny model built from a config,
  its rows) are added to the page's namespace before the next block;
- `<!-- docs-test: skip REASON -->`: the next block is not run; the reason says it needs a GPU or the Hub.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(setup|skip)\s+(.*?)\s*-->")
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")
# A skipped block must need something the test machines do not have.
SKIP_REASONS = ("needs a GPU", "needs the Hub")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, counted from 1
    code: str
    setups: tuple[str, ...]  # the setups named since the previous Python block
    skip: str | None  # why it is not run, or None


def markdown_pages() -> list[Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(path: Path) -> list[Block]:
    """The page's Python code blocks, each with the setups and the skip named before it."""
    blocks, setups, skip = [], [], None
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        directive = DIRECTIVE.search(lines[i])
        fence = FENCE.match(lines[i])
        if directive:
            kind, value = directive.groups()
            if kind == "setup":
                setups.append(value)
            else:
                skip = value
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        if fence.group(2) == "python":
            blocks.append(Block(path, i + 1, "\n".join(lines[i + 1 : end]) + "\n", tuple(setups), skip))
            setups, skip = [], None
        i = end + 1
    return blocks


def run_page(path: Path, setups: dict[str, Callable], workdir: Path) -> list[Block]:
    """Run the page's blocks in order in one namespace; return the skipped ones."""
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    skipped = []
    with contextlib.ExitStack() as stack:
        for block in python_blocks(path):
            for name in block.setups:
                namespace.update(setups[name](stack, workdir))
            if block.skip is not None:
                skipped.append(block)
                continue
            where = f"{path.relative_to(ROOT)}:{block.line}"
            exec(compile(block.code, where, "exec"), namespace)  # the traceback names the page and the line
    torch.set_grad_enabled(True)
    return skipped
