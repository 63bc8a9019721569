"""
The house rules of the package (docs/contributing.md, "Layout"), read from its source: how many modules lie at the
top, how long a function may be, which way the imports point, and the head families' registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_parallel

PACKAGE = Path(hf_parallel.__file__).parent
MAX_TOP_MODULES = 8
MIN_FAMILY_MODULES = 5
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _tree(module: str) -> ast.Module:
    return ast.parse(SOURCES[module].read_text(), filename=str(SOURCES[module]))


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The hf_parallel modules an import statement of `module` names (a package's submodule by its own name)."""
    if node.level:
        package = module if SOURCES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    if not base.startswith("hf_parallel"):
        return []
    names = [f"{base}.{alias.name}" for alias in node.names]
    return [name for name in names if name in SOURCES] or [base]


def _imports(module: str, top_level_only: bool) -> set[str]:
    """The hf_parallel modules `module` imports: at its top level (what runs on import), or anywhere."""
    tree = _tree(module)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            found.update(_resolve(module, node))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hf_parallel"))
    return found


def test_at_most_eight_modules_at_the_top():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_the_families_have_a_room():
    families = sorted(path.name for path in (PACKAGE / "exact" / "heads").glob("*.py") if path.name != "__init__.py")
    assert len(families) >= MIN_FAMILY_MODULES, families


def test_every_function_is_short():
    # A module's length is a question (does it hold two ideas?), not a rule: cohesion decides its edges.
    long_functions = []
    for module in SOURCES:
        for node in ast.walk(_tree(module)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                first = node.body[0]
                lines -= first.end_lineno - first.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long_functions.append(f"{module}.{node.name}: {lines}")
    assert not long_functions, long_functions


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_imports_of_the_package_have_no_cycle():
    graph = {module: _imports(module, top_level_only=True) - {module} for module in SOURCES}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_point_down():
    # Nothing imports the Trainer but the package's face (lazily).
    importers = {m for m in SOURCES if "hf_parallel.trainer" in _imports(m, top_level_only=False)}
    assert importers <= {"hf_parallel"}, importers
    # The Trainer and the loop reach the loss core through its face only.
    for module in ("hf_parallel.trainer", "hf_parallel.loss_overrides", "hf_parallel.loop"):
        inside = {m for m in _imports(module, top_level_only=False) if m.startswith("hf_parallel.exact.")}
        assert not inside, (module, inside)
    # The head families build on each other and on their base, never on the machinery above them.
    for module in (m for m in SOURCES if m.startswith("hf_parallel.exact.heads")):
        outside = {m for m in _imports(module, top_level_only=False) if not m.startswith("hf_parallel.exact.heads")}
        assert not outside, (module, outside)


def test_every_family_module_has_a_registry_entry():
    from hf_parallel.exact.heads import HEAD_FAMILIES, HeadFamily

    registered = {family.build.__module__ for family in HEAD_FAMILIES}
    modules = {m for m in SOURCES if m.startswith("hf_parallel.exact.heads.")}
    # base holds what every family builds on; router adds a term to an LM head, it is no family of its own; trainers'
    # families are found by the Trainer subclass that computes the loss (`trainer_loss_head`), not by the model.
    assert modules - registered == {
        "hf_parallel.exact.heads.base",
        "hf_parallel.exact.heads.router",
        "hf_parallel.exact.heads.trainers",
    }
    assert all(isinstance(family, HeadFamily) and family.classes for family in HEAD_FAMILIES)


def test_the_registry_resolves_a_class_by_its_first_family():
    from hf_parallel.exact.heads import HEAD_FAMILIES
    from hf_parallel.exact.heads.decoder import SEQ2SEQ_DECODER_LM, SEQ2SEQ_LM
    from hf_parallel.exact.heads.tokens import CAUSAL_LM

    # GPT-2's LM head is also in transformers' pre-training mapping: the causal LM row comes first.
    rows = [index for index, family in enumerate(HEAD_FAMILIES) if "GPT2LMHeadModel" in family.classes]
    assert HEAD_FAMILIES[rows[0]] is CAUSAL_LM and len(rows) > 1
    assert HEAD_FAMILIES.index(SEQ2SEQ_LM) < HEAD_FAMILIES.index(SEQ2SEQ_DECODER_LM)
