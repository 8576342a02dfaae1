"""The core modules import downward only: primitives, then the plan, then the schedule, then replay; and no
module of the package takes part in an import circle.

Every import counts, at module level or inside a function (a lazy import is still a dependency). The
layer checks pass over those under ``if TYPE_CHECKING:``; the circle check counts them too (a type the
pieces of a circle share belongs in a module below them all).
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


def _imports(path: Path, type_checking: bool = False):
    """Every schedlang module ``path`` imports (names imported from a package count as its submodules); with
    ``type_checking``, those imported under ``if TYPE_CHECKING:`` too."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
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
def _graph(type_checking: bool = False):
    return {_module_name(p): _imports(p, type_checking) for p in PACKAGE.rglob("*.py")}


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


def _circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target == "schedlang" or target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _describe(circle, graph):
    inside = set(circle)
    return "; ".join(f"{m} -> {', '.join(sorted(t for t in graph[m] if t in inside))}" for m in circle)


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_takes_part_in_an_import_circle():
    """Over the whole package: imports inside functions and under ``if TYPE_CHECKING:`` count. (Importing the
    package root, ``schedlang``, is not followed: it imports everything, and is refused in the core above.)"""
    graph = _graph(type_checking=True)
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(_describe(c, graph) for c in circles)


def test_every_import_of_the_package_names_a_module_that_exists():
    """A relative import one level short (``..distributed`` from ``graph/tracer/``) names no module; inside a
    function it fails only when that function first runs."""
    graph = _graph(type_checking=True)
    missing = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                     if t != "schedlang" and t not in graph)
    assert not missing, missing


#: the most lines a module of the package may have: past it, a module holds more than one idea and is split
MAX_MODULE_LINES = 700


def test_no_module_is_over_the_line_limit():
    long = sorted(f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES)
    assert not long, f"split these modules (at most {MAX_MODULE_LINES} lines each): {long}"
