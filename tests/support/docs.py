"""Helpers for the documentation tests: README's snippets, printed-output comments, and
resolving the dotted names the docs mention without importing torch or CuPy."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: Modules a snippet or a docs page may need that CI does not install.
OPTIONAL_MODULES = {"torch", "cupy", "cupyx", "matplotlib"}


def snippet(text: str, name: str) -> str:
    """The ```python block right after ``<!-- snippet: name -->``."""
    marker = f"<!-- snippet: {name} -->"
    start = text.index(marker)
    m = re.match(r"\s*```python\n(.*?)```", text[start + len(marker) :], flags=re.S)
    assert m, f"no python block right after {marker}"
    return m.group(1)


def snippet_names(text: str) -> list:
    return re.findall(r"<!-- snippet: ([\w-]+) -->", text)


def expected_prints(code: str, explanations: bool = True) -> list:
    """What each ``print(...)  # expected`` line says it prints. With ``explanations``, an
    explanation may follow two spaces (not for NumPy's output, which has double spaces)."""
    out = []
    for line in code.splitlines():
        m = re.match(r"print\(.*\)\s+# (.*)$", line.strip())
        if m:
            said = m.group(1)
            out.append((re.split(r"\s{2,}", said)[0] if explanations else said).strip())
    return out


def _module_file(modname: str) -> Path | None:
    base = ROOT / Path(*modname.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _defined_in(body, name: str) -> ast.AST | None:
    """The statement of ``body`` that binds ``name`` (def, class, assignment, import)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name.split(".")[0]) == name for a in node.names
        ):
            return node
        if isinstance(node, (ast.If, ast.Try)):
            found = _defined_in(node.body, name) or _defined_in(getattr(node, "orelse", []), name)
            if found is not None:
                return found
    return None


def _resolve_from_files(parts: list) -> bool:
    """The longest prefix of ``parts`` that is a module file, then its attributes by source."""
    for i in range(len(parts), 0, -1):
        if _module_file(".".join(parts[:i])) is not None:
            return _resolve_by_source(".".join(parts[:i]), parts[i:])
    return False


def _resolve_by_source(modname: str, attrs: list) -> bool:
    """Whether ``modname.attrs...`` exists, read from the source with ast (for modules that
    import torch or CuPy)."""
    path = _module_file(modname)
    if path is None:
        return False
    if not attrs:
        return True
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = _defined_in(tree.body, attrs[0])
    if node is None:
        return False
    if isinstance(node, ast.ImportFrom) and node.module:
        real = next(a.name for a in node.names if (a.asname or a.name) == attrs[0])
        if _module_file(f"{node.module}.{real}") is not None:
            return resolve(f"{node.module}.{real}" + "".join(f".{a}" for a in attrs[1:]))
        return _resolve_by_source(node.module, [real, *attrs[1:]])
    if len(attrs) == 1:
        return True
    if isinstance(node, ast.ClassDef):
        return _defined_in(node.body, attrs[1]) is not None or _instance_attribute(node, attrs[1])
    return False


def _sets_self_attribute(fn: ast.AST, name: str) -> bool:
    """Whether ``fn`` (an ``__init__``) uses ``self.name``."""
    return any(
        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr == name
        for n in ast.walk(fn)
    )


def _instance_attribute(cls: ast.ClassDef, name: str) -> bool:
    return any(
        isinstance(fn, ast.FunctionDef) and fn.name == "__init__" and _sets_self_attribute(fn, name) for fn in cls.body
    )


def resolve(dotted: str) -> bool:
    """Whether the dotted name ``kvaddr.x.y`` exists: the longest importable module prefix,
    then attributes (instance attributes set in ``__init__`` count). A module that needs torch
    or CuPy is read from its source instead."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        modname = ".".join(parts[:i])
        try:
            obj = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name in OPTIONAL_MODULES:
                return _resolve_from_files(parts)
            continue
        except ImportError:
            return _resolve_from_files(parts)
        for j, attr in enumerate(parts[i:]):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
                continue
            if isinstance(obj, type) and j == len(parts[i:]) - 1:
                return _class_instance_attribute(obj, attr)
            return False
        return True
    return False


def _class_instance_attribute(cls: type, name: str) -> bool:
    import inspect
    import textwrap

    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError):
            continue
        if _sets_self_attribute(tree, name):
            return True
    fields = getattr(cls, "__dataclass_fields__", {})
    return name in fields


def doc_pages() -> list:
    """Every page of the docs site (docs/ and its folders, e.g. docs/integrations/)."""
    return sorted(DOCS.rglob("*.md"))


def page_name(page: Path) -> str:
    """A page's path inside docs/ (``vllm.md``, ``integrations/vllm.md``): how the nav and links name it."""
    return page.relative_to(DOCS).as_posix()
