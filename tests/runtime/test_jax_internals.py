"""JAX's private internals, behind dynajax.runtime.jax_internals: present on the JAX this
suite runs with (a release that moves one fails here, loudly), and the public fallbacks
give the same answers when they are gone."""

from __future__ import annotations

import ast
import pathlib

import jax
import numpy as np
import pytest
import torch

import dynajax
from dynajax.runtime import compiled as compiled_module
from dynajax.runtime import direct as direct_module
from dynajax.runtime import jax_internals
from tests.tolerances import assert_same

PACKAGE = pathlib.Path(dynajax.__file__).parent


def test_every_internal_is_present_on_this_jax() -> None:
    found = jax_internals.status()
    missing = [name for name, ok in found.items() if not ok]
    assert not missing, (
        f"JAX {jax.__version__} moved the internals {missing}: dynajax falls back to public "
        "JAX (slower per call); update dynajax/runtime/jax_internals.py"
    )


def test_no_other_module_reaches_into_jax_internals() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "jax_internals.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.Import) and any(
                a.name.startswith("jax._src") for a in node.names
            ):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


@pytest.mark.parametrize("private", [True, False], ids=["internal", "public"])
def test_x64_switch_turns_64_bit_on_and_restores(private: bool) -> None:
    switch = jax_internals._X64Switch(private=private)
    assert switch.uses_internal is private
    before = jax.dtypes.canonicalize_dtype(np.int64)
    token = switch.enable()
    try:
        assert jax.dtypes.canonicalize_dtype(np.int64) == np.int64
    finally:
        switch.restore(token)
    assert jax.dtypes.canonicalize_dtype(np.int64) == before


@pytest.fixture
def public_jax_only(monkeypatch):
    """The runtime as it runs on a JAX release without any of the internals."""
    monkeypatch.setattr(compiled_module, "X64", jax_internals._X64Switch(private=False))
    monkeypatch.setattr(compiled_module, "dispatch_of", lambda compiled: compiled)
    monkeypatch.setattr(direct_module, "direct_executor", lambda compiled: None)


@pytest.mark.parametrize("n_inputs", [1, 12])  # 12: past DIRECT_MIN_INPUTS
def test_public_fallbacks_give_the_eager_answer(public_jax_only, n_inputs: int) -> None:
    def f(*xs):
        total = xs[0] * 3
        for x in xs[1:]:
            total = total + x
        return total, total.double().sum()

    xs = [torch.arange(4, dtype=torch.int64) * 2**40 + i for i in range(n_inputs)]
    compiled = torch.compile(f, backend=dynajax.Backend())
    for _ in range(3):  # first call, then the steady path
        assert_same(compiled(*xs), f(*xs))
