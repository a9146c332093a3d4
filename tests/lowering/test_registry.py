"""The rule table's own properties: where a rule was registered, the shape of the import
graph (the table is a leaf, the package lists the families), and that every rule can be
found by searching the source for its overload.

    pytest -q tests/lowering/test_registry.py
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import dynajax
from dynajax.lowering import registry

LOWERING = pathlib.Path(registry.__file__).parent
PACKAGE = "dynajax.lowering"


def _line() -> int:
    """The caller's current line number."""
    return sys._getframe(1).f_lineno


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(LOWERING).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


MODULES = {_module_name(p): p for p in sorted(LOWERING.rglob("*.py"))}


def _imports(path: pathlib.Path) -> list[str]:
    """Every module that ``path`` imports, anywhere in it (functions included); for
    ``from package import name``, the submodule ``package.name`` when there is one."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append(sub if sub in MODULES else node.module)
    return out


def _lower_calls(path: pathlib.Path) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("lower", "lower_when_defined")
    ]


def _dotted(node: ast.expr) -> str | None:
    """``aten.sin.default`` for that attribute chain, None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


# ---------------------------------------------------------------------------------
# Duplicate registrations
# ---------------------------------------------------------------------------------


@pytest.fixture
def throwaway_ops():
    """Two custom ops with no rule, removed (with anything registered for them) after."""
    lib = torch.library.Library("dynajax_test_registry", "DEF")
    lib.define("first(Tensor x) -> Tensor")
    lib.define("second(Tensor x) -> Tensor")
    ns = torch.ops.dynajax_test_registry
    ops = (ns.first.default, ns.second.default)
    saved = dict(registry._TABLE)
    try:
        yield ops
    finally:
        registry._TABLE.clear()
        registry._TABLE.update(saved)
        lib._destroy()


def _rule_a(x):
    return x


def _rule_b(x):
    return x


def test_a_rule_records_where_it_was_registered(throwaway_ops) -> None:
    op, _ = throwaway_ops
    line = _line() + 1
    registry.lower(op)(_rule_a)
    assert registry.get_rule(op).where == f"{__file__}:{line}"


def test_a_duplicate_names_both_registrations(throwaway_ops) -> None:
    op, other = throwaway_ops
    first = _line() + 1
    registry.lower(op)(_rule_a)
    with pytest.raises(ValueError) as raised:
        second = _line() + 1
        registry.lower(other, op)(_rule_b)
    message = str(raised.value)
    assert str(op) in message
    assert f"_rule_a registered at {__file__}:{first}" in message
    assert f"_rule_b registered at {__file__}:{second}" in message
    # Nothing of the refused call is registered, not even its first, new overload.
    assert registry.get_rule(op).fn is _rule_a
    assert registry.get_rule(other) is None


def test_a_duplicate_of_a_family_rule_names_the_family_module(throwaway_ops) -> None:
    op = torch.ops.aten.sin.default
    with pytest.raises(ValueError, match=r"elementwise\.py:\d+ and _rule_a registered at"):
        registry.lower(op)(_rule_a)
    assert registry.get_rule(op).fn.__name__ == "_sin"


def test_the_fixture_leaves_the_table_as_it_was() -> None:
    assert not any(op.namespace == "dynajax_test_registry" for op in registry.supported_ops())


# ---------------------------------------------------------------------------------
# Import graph
# ---------------------------------------------------------------------------------


def test_registry_imports_nothing_from_dynajax() -> None:
    imported = _imports(MODULES[f"{PACKAGE}.registry"])
    assert [m for m in imported if m == "dynajax" or m.startswith("dynajax.")] == []


def test_no_import_circle_in_the_lowering_package() -> None:
    graph = {
        name: sorted({m for m in _imports(path) if m in MODULES and m != name})
        for name, path in MODULES.items()
    }
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "import circle: " + " -> ".join((*path, name))
        if name in done:
            return
        for dep in graph[name]:
            visit(dep, (*path, name))
        done.add(name)

    for name in graph:
        visit(name, ())


def test_the_package_imports_every_module_that_registers_rules() -> None:
    registering = {name for name, path in MODULES.items() if _lower_calls(path)}
    imported = set(_imports(MODULES[PACKAGE]))
    assert registering - imported == set()


def test_importing_the_registry_alone_fills_the_table() -> None:
    # Rules by name (lower_when_defined) move from _PENDING to _TABLE when their library
    # (transformers) defines the op, which this process may have imported: count both.
    code = "import dynajax.lowering.registry as r; print(len(r._TABLE) + len(r._PENDING))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    dynajax.supported_ops()  # (fills the table in this process too)
    expected = len(registry._TABLE) + len(registry._PENDING)
    assert int(out.stdout.strip().splitlines()[-1]) == expected


# ---------------------------------------------------------------------------------
# Every rule can be found by name
# ---------------------------------------------------------------------------------


def _registered_names() -> dict[str, str]:
    """Each overload named in a ``lower(...)`` call of the lowering package, with where."""
    names = {}
    for path in MODULES.values():
        for call in _lower_calls(path):
            for arg in call.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    # lower_when_defined("transformers::grouped_mm_fallback.default")
                    names[arg.value.replace("::", ".")] = f"{path}:{arg.lineno}"
                    continue
                name = _dotted(arg)
                where = f"{path}:{arg.lineno}"
                assert name is not None and name.count(".") >= 2, (
                    f"{where}: lower() takes overloads named in full (aten.sin.default), "
                    f"not {ast.unparse(arg)}"
                )
                names[name.removeprefix("torch.ops.")] = where
    return names


def test_every_rule_is_registered_on_a_line_naming_its_overload() -> None:
    names = _registered_names()
    missing = sorted(str(op) for op in registry.supported_ops() if str(op) not in names)
    assert missing == []


def test_every_rule_has_a_name() -> None:
    anonymous = {
        str(op): rule.fn.__qualname__
        for op, rule in registry._TABLE.items()
        if not rule.fn.__qualname__.isidentifier()
    }
    assert anonymous == {}
