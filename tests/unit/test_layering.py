"""kvaddr's layering, checked by parsing every module's imports (module level and inside
functions, absolute and relative, ``TYPE_CHECKING`` blocks included).

Layers, and the kvaddr layers each may import (besides itself):

    library     kvaddr/*.py but cli.py, and kvaddr/__init__.py: nothing else of kvaddr
    engines     kvaddr/engines/ (engine adapters): the library
    torch       kvaddr/torch/ (PyTorch ops): the library, engines
    strategies  the library, engines, torch
    measure     the library, engines, torch, strategies
    traces      the library, engines, torch, strategies, measure
    gate        the library, engines, torch, strategies, measure
    commands    every layer but cli
    cli         everything

Also: no import cycle among kvaddr modules (a package counts as its __init__), and no
module imports another module's underscore name (``from kvaddr.x import _y``, ``import
kvaddr._x``) or reaches one through an imported module (``mod._y``).
"""

from __future__ import annotations

import ast
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PACKAGE = os.path.join(ROOT, "kvaddr")

ALLOWED = {
    "library": {"library"},
    "engines": {"library", "engines"},
    "torch": {"library", "engines", "torch"},
    "strategies": {"library", "engines", "torch", "strategies"},
    "measure": {"library", "engines", "torch", "strategies", "measure"},
    "traces": {"library", "engines", "torch", "strategies", "measure", "traces"},
    "gate": {"library", "engines", "torch", "strategies", "measure", "gate"},
    "commands": {"library", "engines", "torch", "strategies", "measure", "traces", "gate", "commands"},
    "cli": {"library", "engines", "torch", "strategies", "measure", "traces", "gate", "commands", "cli"},
}
SUBPACKAGES = ("engines", "torch", "strategies", "measure", "traces", "gate", "commands")


def layer_of(module: str) -> str:
    """``kvaddr.measure.report`` -> ``measure``; ``kvaddr.planner`` -> ``library``; ``kvaddr.cli`` -> ``cli``."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in SUBPACKAGES:
        return parts[1]
    if module == "kvaddr.cli":
        return "cli"
    return "library"


def discover(package_dir: str = PACKAGE) -> dict:
    """``{module name: file}`` of every kvaddr module (``kvaddr.x.__init__`` is named ``kvaddr.x``)."""
    out = {}
    base = os.path.dirname(package_dir)
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), base)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, name)
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imports_of(module: str, source: str, modules: set, packages: set = frozenset()) -> tuple:
    """The kvaddr modules ``module`` imports, and its uses of other modules' underscore names.

    Returns
    -------
    (set of str, list of str)
        Imported module names (resolved: ``from kvaddr import cli`` is
        ``kvaddr.cli``, ``from kvaddr import StepPlanner`` is ``kvaddr``), and
        one line per underscore-name use (``line N: from kvaddr.x import _y``).
    """
    tree = ast.parse(source)
    package = module if module in packages else module.rpartition(".")[0]  # what relative imports start from
    found, private = set(), []
    module_aliases = {}

    def resolve_from(node: ast.ImportFrom) -> str:
        if node.level:
            parts = package.split(".")
            base = parts[: len(parts) - (node.level - 1)]
            return ".".join(base + ([node.module] if node.module else []))
        return node.module or ""

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "kvaddr" or alias.name.startswith("kvaddr."):
                    target = alias.name
                    while target not in modules and "." in target:
                        target = target.rpartition(".")[0]
                    found.add(target)
                    if any(_is_private(p) for p in alias.name.split(".")):
                        private.append(f"line {node.lineno}: import {alias.name}")
                    if alias.asname:
                        module_aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source_module = resolve_from(node)
            if not (source_module == "kvaddr" or source_module.startswith("kvaddr.")):
                continue
            if any(_is_private(p) for p in source_module.split(".")):
                private.append(f"line {node.lineno}: from {source_module} import ...")
            for alias in node.names:
                sub = f"{source_module}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                    module_aliases[alias.asname or alias.name] = sub
                    continue
                target = source_module
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                found.add(target)
                if _is_private(alias.name) and target != module:
                    private.append(f"line {node.lineno}: from {source_module} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
            and _is_private(node.attr)
        ):
            private.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({module_aliases[node.value.id]})")
    found.discard(module)
    return found, private


def build_graph(package_dir: str = PACKAGE) -> tuple:
    """``({module: set of imported kvaddr modules}, {module: [underscore-name uses]})``."""
    files = discover(package_dir)
    packages = {m for m, f in files.items() if f.endswith("__init__.py")}
    graph, private = {}, {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as fh:
            graph[module], uses = imports_of(module, fh.read(), set(files), packages)
        if uses:
            private[module] = uses
    return graph, private


def find_cycles(graph: dict) -> list:
    """Every strongly connected component of more than one module (or a module importing itself),
    each as a sorted list (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    out.append(sorted(component))
    return out


def layer_violations(graph: dict) -> list:
    """``"a imports b (layer x may not import layer y)"`` for every import against :data:`ALLOWED`."""
    out = []
    for module in sorted(graph):
        mine = layer_of(module)
        for target in sorted(graph[module]):
            theirs = layer_of(target)
            if theirs not in ALLOWED[mine]:
                out.append(f"{module} imports {target} (layer {mine} may not import layer {theirs})")
    return out


@pytest.fixture(scope="module")
def graph_and_private():
    return build_graph()


def test_the_checker_sees_every_module(graph_and_private):
    graph, _ = graph_and_private
    for name in ("kvaddr", "kvaddr.cli", "kvaddr.planner", "kvaddr.commands.common", "kvaddr.measure.profile_run"):
        assert name in graph
    # function-level imports count: kvaddr/__init__ imports the planner lazily.
    assert "kvaddr.planner" in graph["kvaddr"]
    assert graph["kvaddr.cli"] >= {"kvaddr.commands.profile", "kvaddr.commands.gate", "kvaddr.commands.traces"}


def test_no_import_cycle(graph_and_private):
    graph, _ = graph_and_private
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among kvaddr modules:\n" + "\n".join("  " + " <-> ".join(c) for c in cycles)


def test_layers_import_only_what_they_may(graph_and_private):
    graph, _ = graph_and_private
    bad = layer_violations(graph)
    assert not bad, "layering violations (see this file's docstring):\n" + "\n".join("  " + b for b in bad)


def test_no_module_uses_another_modules_underscore_names(graph_and_private):
    _, private = graph_and_private
    lines = [f"  {m}: {u}" for m, uses in sorted(private.items()) for u in uses]
    assert not lines, "underscore names used across modules:\n" + "\n".join(lines)


def test_every_subpackage_states_its_layer_rule():
    for sub in SUBPACKAGES:
        init = os.path.join(PACKAGE, sub, "__init__.py")
        if os.path.exists(init):
            with open(init, encoding="utf-8") as fh:
                assert "Layer:" in fh.read(), f"kvaddr/{sub}/__init__.py does not state its layer rule"


# ----------------------------------------------------------------------------- the checker itself


def test_the_checker_finds_a_cycle_and_a_layer_violation():
    graph = {
        "kvaddr": set(),
        "kvaddr.a": {"kvaddr.b"},
        "kvaddr.b": {"kvaddr.c"},
        "kvaddr.c": {"kvaddr.a"},
        "kvaddr.d": {"kvaddr.d"},
        "kvaddr.measure.x": {"kvaddr.commands.y", "kvaddr.a"},
        "kvaddr.commands.y": {"kvaddr.measure.x"},
        "kvaddr.engines.e": {"kvaddr.torch.t"},
        "kvaddr.torch.t": {"kvaddr.engines.e2"},
        "kvaddr.engines.e2": set(),
    }
    assert sorted(find_cycles(graph)) == [
        ["kvaddr.a", "kvaddr.b", "kvaddr.c"],
        ["kvaddr.commands.y", "kvaddr.measure.x"],
        ["kvaddr.d"],
    ]
    assert layer_violations(graph) == [
        "kvaddr.engines.e imports kvaddr.torch.t (layer engines may not import layer torch)",
        "kvaddr.measure.x imports kvaddr.commands.y (layer measure may not import layer commands)",
    ]
    assert find_cycles({"kvaddr.a": {"kvaddr.b"}, "kvaddr.b": set()}) == []


def test_the_checker_reads_relative_function_level_and_private_imports(tmp_path):
    pkg = tmp_path / "kvaddr"
    (pkg / "measure").mkdir(parents=True)
    (pkg / "commands").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "util.py").write_text("def _hidden():\n    pass\n")
    (pkg / "commands" / "__init__.py").write_text("")
    (pkg / "commands" / "c.py").write_text("X = 1\n")
    (pkg / "measure" / "__init__.py").write_text("")
    (pkg / "measure" / "m.py").write_text(
        "from .. import util\n"
        "from ..util import _hidden\n"
        "def f():\n"
        "    from kvaddr.commands import c\n"
        "    return util._hidden, c\n"
    )
    graph, private = build_graph(str(pkg))
    assert graph["kvaddr.measure.m"] == {"kvaddr.util", "kvaddr.commands.c"}
    assert len(private["kvaddr.measure.m"]) == 2  # the import of _hidden and util._hidden
    assert layer_violations(graph) == [
        "kvaddr.measure.m imports kvaddr.commands.c (layer measure may not import layer commands)"
    ]
