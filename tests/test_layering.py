"""The core modules import downward only: primitives, then the plan, then the schedule, then replay.

Every import counts, at module level or inside a function (a lazy import is still a dependency),
except those under ``if TYPE_CHECKING:``.
"""

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "schedlang"

#: lower layers first; a module may import only from its own layer or below
LAYERS = [
    ["schedlang.errors"],
    ["schedlang.primitives.params"],
    ["schedlang.primitives.base"],
    ["schedlang.primitives.*", "schedlang.primitives"],
    ["schedlang.fingerprint"],
    ["schedlang.plan"],
    ["schedlang.schedule"],
    ["schedlang.replaying"],
]
#: layers above the core, which the core must never import
ABOVE = ("schedlang.build", "schedlang.verify", "schedlang.train", "schedlang.cli", "schedlang.checkpoint",
         "schedlang.pretrained", "schedlang.models", "schedlang.demo", "schedlang.replaying")
#: the one way up: ``Schedule.report`` is an entry point into the report package, imported on call
#: (and ``trace`` keeps each graph as traced, drawn by ``report.graph_svg``, which imports no core module)
ALLOWED_UP = {("schedlang.schedule", "schedlang.report"), ("schedlang.primitives.trace", "schedlang.report.graph_svg")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path):
    """Every schedlang module ``path`` imports (names imported from a package count as its submodules)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("schedlang"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("schedlang"):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                              or (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists() else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


@functools.lru_cache(maxsize=None)
def _graph():
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _layer(module: str):
    for i, layer in enumerate(LAYERS):
        for pattern in layer:
            if module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1])):
                return i
    return None


def test_the_graph_is_read():
    graph = _graph()
    assert "schedlang.primitives.base" in graph["schedlang.plan"]
    assert "schedlang.plan" in graph["schedlang.schedule"] and "schedlang.schedule" in graph["schedlang.replaying"]


@pytest.mark.parametrize("module", sorted(m for m in _graph() if _layer(m) is not None))
def test_core_modules_import_downward_only(module):
    graph = _graph()
    mine = _layer(module)
    for target in sorted(graph[module]):
        if (module, target) in ALLOWED_UP:
            continue
        layer = _layer(target)
        if layer is not None:
            assert layer <= mine, f"{module} imports {target}, a layer above it"
        elif module != "schedlang.replaying":
            assert not target.startswith(ABOVE), f"{module} imports {target}, which builds on the core"
            assert target != "schedlang", f"{module} imports the package root (which imports everything)"


def test_no_import_cycle_through_the_core():
    graph = _graph()
    core = {m for m in graph if _layer(m) is not None}
    # depth-first search for a cycle that passes through a core module, over the whole package
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in graph.get(m, ()):
            if (m, t) in ALLOWED_UP or t == "schedlang":
                continue
            if state.get(t) == "open":
                cycle = stack[stack.index(t):] + [t]
                assert not core.intersection(cycle), " -> ".join(cycle)
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(core):
        if m not in state:
            visit(m)
