"""The project's import graph, read from the source with `ast` (nothing is imported): no module of
perfscope (collectors and dashboard included) reaches itself through its imports, and the store's
modules (perfscope/store/) import only earlier layers of the store (perfscope.store.LAYERS) and the
few foundation modules below it, never the analysis or anything else built on the store.

Every import counts, a lazy one inside a function too (it is a circle all the same, only one that
closes later); only imports under `if TYPE_CHECKING:` are left out, which never run.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: package name -> folder (pyproject's package-dir)
PACKAGES = {
    "perfscope": ROOT / "perfscope",
    "perfscope.collectors": ROOT / "collectors",
    "perfscope.dashboard": ROOT / "dashboard",
}
#: the modules outside perfscope/store/ that the store may import: below every room
FOUNDATION = {"perfscope.errors", "perfscope.words", "perfscope.duckdb_check", "perfscope.sizes"}


def modules() -> dict[str, Path]:
    """Every module of the project by its dotted name (a package by its own name, for __init__.py)."""
    found: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            if pkg == "perfscope" and rel[0] in ("collectors", "dashboard"):
                continue  # pragma: no cover (they are folders of their own)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join((pkg, *rel))] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree` that can run (not those under `if TYPE_CHECKING:`)."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules module `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in known:  # `from package import module`
                found.add(sub)
            elif target in known:
                found.add(target)
    found.discard(name)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    """The project's import graph (read once per test session)."""
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        # iterative Tarjan: (node, iterator over its successors)
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(edges.get(start, ()))))]
        while work:
            node, succ = work[-1]
            for nxt in succ:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def store_layers() -> tuple[str, ...]:
    """perfscope.store.LAYERS, read from the package's source."""
    tree = ast.parse((PACKAGES["perfscope"] / "store" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "LAYERS" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("perfscope/store/__init__.py defines no LAYERS")


def layer_problems(edges: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Each import of a store module that is not of an earlier layer or of the foundation."""
    rank = {f"perfscope.store.{m}": i for i, m in enumerate(layers)}
    problems = []
    for name in sorted(rank):
        for dep in sorted(edges.get(name, ())):
            if dep in FOUNDATION or (dep in rank and rank[dep] < rank[name]):
                continue
            where = "a later layer" if dep in rank else "outside the store"
            problems.append(f"{name} imports {dep} ({where})")
    return problems


def test_the_walk_sees_the_project() -> None:
    edges = graph()
    assert {"perfscope", "perfscope.store", "perfscope.store.writer", "perfscope.collectors"} <= set(edges)
    assert any(m.startswith("perfscope.dashboard.") for m in edges)
    assert len(edges) > 100
    # a module-level, a lazy and a `from package import module` import are all seen
    assert "perfscope.store.segments" in edges["perfscope.store.compact"]
    assert "perfscope.store.compact" in edges["perfscope.store.writer"]  # imported at close only
    assert "perfscope.store.leftovers" in edges["perfscope.store.writer"]  # `from . import leftovers`


def test_no_import_cycle_anywhere() -> None:
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_store_module_is_a_layer() -> None:
    layers = store_layers()
    on_disk = {p.stem for p in (PACKAGES["perfscope"] / "store").glob("*.py")} - {"__init__"}
    assert on_disk == set(layers), "perfscope.store.LAYERS must name every module of perfscope/store/"
    assert len(set(layers)) == len(layers)


def test_the_store_imports_only_earlier_layers() -> None:
    problems = layer_problems(graph(), store_layers())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_cycles_finds_exactly_the_circles(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert sorted(cycles(edges)) == expected


def test_a_store_module_importing_the_analysis_or_a_later_layer_is_named() -> None:
    layers = ("schema", "live", "writer")
    edges = {
        "perfscope.store.schema": {"perfscope.errors"},
        "perfscope.store.live": {"perfscope.store.schema", "perfscope.store.writer"},
        "perfscope.store.writer": {"perfscope.store.live", "perfscope.analysis.steady"},
    }
    assert layer_problems(edges, layers) == [
        "perfscope.store.live imports perfscope.store.writer (a later layer)",
        "perfscope.store.writer imports perfscope.analysis.steady (outside the store)",
    ]


def test_the_tests_mirror_the_rooms() -> None:
    """Each test lives in the folder of the room it tests (tests/store/ for perfscope/store/, charts'
    tests with the report's), or in tests/project/ for what spans the project; no test file is left
    at the top, and no two share a name (each folder is on sys.path: tests/rooms.py)."""
    tests = ROOT / "tests"
    rooms = {p.name for p in (ROOT / "perfscope").iterdir() if (p / "__init__.py").exists()}
    rooms |= {"collectors", "dashboard", "project"}
    assert sorted(p.name for p in tests.glob("test_*.py")) == []
    files = sorted(tests.glob("*/test_*.py"))
    assert {p.parent.name for p in files} <= rooms
    names = [p.name for p in files]
    assert len(names) == len(set(names)) and len(names) > 80
