"""The tree's imports run one way (issue 46): no module reaches back, through any chain, to one that imports it —
top-level imports and function-local ones alike (a function-local import hides a circle from Python, not from the
design). Read with `ast`, nothing imported; `if TYPE_CHECKING:` blocks are left out (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"tokenwing": REPO / "engine" / "tokenwing", "runmyai": REPO / "app" / "runmyai"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for root in PACKAGES.values():
        for f in root.rglob("*.py"):
            parts = list(f.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours an imported name lives in (`a.b.c` → `a.b` when c is a name in it); None: not ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    checking_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in checking_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}" if base else up
            names = [f"{base}.{a.name}" for a in node.names]
        for name in names:
            owner = _owner(name, modules)
            if owner is not None and owner != module and not module.startswith(owner + "."):
                out.add(owner)  # (a package's __init__ that a submodule's import runs is no circle of its own)
    return out


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                part: list[str] = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    part.append(x)
                    if x == v:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_no_import_circles() -> None:
    modules = _modules()
    assert "tokenwing.cli" in modules and "runmyai.ui.controller" in modules  # (the tree was found)
    edges = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert _circles(edges) == []


def _unexplained_local_imports(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Imports of ours inside a function with no comment saying why they are lazy, on them or just above their
    block of imports."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    out = []
    for fn in ast.walk(ast.parse(text)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            relative = isinstance(node, ast.ImportFrom) and node.level > 0
            if not relative and not any(_owner(n, modules) for n in names):
                continue  # (not ours: numpy, the standard library)
            first = node.lineno - 1
            while first > 0 and lines[first - 1].lstrip().startswith(("from ", "import ")):
                first -= 1
            said = lines[first - 1 : node.end_lineno or node.lineno]
            if not any("lazy" in line.partition("#")[2] for line in said):
                out.append(f"{module}:{node.lineno}")
    return out


def test_every_function_local_import_says_why_it_is_lazy() -> None:
    """A function-local import is for start-up time (the CLI's commands, Qt after its platform is chosen), and
    says so; any other belongs at the top, where the circle test sees it for what it is."""
    modules = _modules()
    found = [x for m, p in sorted(modules.items()) for x in _unexplained_local_imports(m, p, modules)]
    assert found == []


def test_the_check_finds_a_circle_hidden_in_a_function() -> None:
    """The checker itself: the cli ↔ info circle as it was (info imported cli inside a function) is found."""
    assert _circles({"a.cli": {"a.info"}, "a.info": {"a.cli"}, "a.x": set()}) == [["a.cli", "a.info"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
