"""The package's layout rules: no import circle between kvcert's modules, and no library module over 400 lines.

Import graph: every module under src/kvcert, parsed with `ast` (nothing is imported). An edge A -> B is any import of
kvcert module B by A, at module level AND inside functions or methods: a lazy import that closes a loop hides the
circle from the importer instead of removing it (the two modules still need each other), so it counts. Imports under
`if TYPE_CHECKING:` never run and do not count. `from kvcert.x import y` is an edge to kvcert.x.y when that is a
module (a submodule import), else to kvcert.x; relative imports are resolved against the importing module's package.
Importing kvcert.a.b also runs kvcert/__init__.py and kvcert/a/__init__.py, but those implicit parent edges are not
counted: a package's __init__ re-exporting its submodules would otherwise put every module in one circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvcert"
MAX_LINES = 400
EXEMPT = ("exploratory",)  # exploratory analyses are scripts, not library modules


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never executed)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The kvcert modules that module `name` (at `path`) imports, anywhere in its body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if not (target == "kvcert" or target.startswith("kvcert.")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif target in modules:
                    out.add(target)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path back to its start) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, comp) for comp in components]


def _circle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component (breadth first)."""
    start, members = comp[0], set(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def test_import_graph_resolves_relative_submodule_and_lazy_imports(tmp_path):
    pkg = tmp_path / "kvcert"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "a.py").write_text("from .b import X\n\ndef f():\n    from kvcert import c\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvcert.c\n")
    (pkg / "c.py").write_text("def g():\n    from .sub import a\n    import kvcert.sub.a\n")
    modules = {"kvcert", "kvcert.sub", "kvcert.sub.a", "kvcert.sub.b", "kvcert.c"}
    assert imports_of("kvcert.sub", pkg / "sub" / "__init__.py", modules) == {"kvcert.sub.b"}
    assert imports_of("kvcert.sub.a", pkg / "sub" / "a.py", modules) == {"kvcert.sub.b", "kvcert.c"}
    assert imports_of("kvcert.sub.b", pkg / "sub" / "b.py", modules) == set()  # TYPE_CHECKING only
    assert imports_of("kvcert.c", pkg / "c.py", modules) == {"kvcert.sub.a"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles (module-level and function-level imports):\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_library_modules_at_most_400_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in EXEMPT or "__pycache__" in rel.parts:
            continue
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long.append(f"src/kvcert/{rel.as_posix()}: {n} lines")
    assert not long, f"library modules over {MAX_LINES} lines (split them):\n" + "\n".join(long)
