"""Abstract evaluations remembered across graphs and processes (capability/memo.py).

A verdict that was decided once (for another graph, or by another process through the
persistent cache) is not evaluated again, and is the same verdict; a user's rule is
evaluated afresh in each process, and a rule replaced meanwhile is evaluated again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jax.numpy as jnp
import pytest
import torch

import dynajax
from dynajax import store
from dynajax.capability import memo, support
from tests.helpers import count_calls
from tests.tolerances import assert_same


@pytest.fixture
def evaluations(monkeypatch):
    """Counts abstract evaluations (``[n]``); each test starts with an empty memory."""
    _new_process(monkeypatch)
    return count_calls(monkeypatch, support, "_evaluate")


def _new_process(monkeypatch) -> None:
    """What a new process starts with: no evaluations in memory, stores unread."""
    monkeypatch.setattr(memo, "_MEMORY", {})
    monkeypatch.setattr(memo, "_STORES", {})


def _program(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x @ x.t(), dim=-1).sort(dim=-1).values.cumsum(0)


def _compile(cache_dir, fn=_program, **options):
    torch._dynamo.reset()
    backend = dynajax.Backend(cache_dir=str(cache_dir), **options)
    return torch.compile(fn, backend=backend), backend


def _verdicts(backend) -> str:
    return backend.graphs[0].text(width=None).split("compiles")[0]


def test_a_second_graph_reuses_the_evaluations_of_the_first(tmp_path, evaluations) -> None:
    x = torch.randn(4, 4)
    f, first = _compile("")
    assert_same(f(x), _program(x))
    made = evaluations[0]
    assert made > 0
    f, second = _compile("")
    assert_same(f(x), _program(x))
    assert evaluations[0] == made
    assert _verdicts(second) == _verdicts(first)


def test_another_process_reads_them_from_the_cache(tmp_path, evaluations, monkeypatch) -> None:
    x = torch.randn(4, 4)
    f, first = _compile(tmp_path)
    f(x)
    made = evaluations[0]
    assert [p.suffix for p in tmp_path.glob("*.verdicts")] == [".verdicts"]
    _new_process(monkeypatch)
    f, second = _compile(tmp_path)
    assert_same(f(x), _program(x))
    assert evaluations[0] == made  # none evaluated again
    assert _verdicts(second) == _verdicts(first)
    # a process without the cache evaluates them again
    _new_process(monkeypatch)
    f, third = _compile("")
    f(x)
    assert evaluations[0] == 2 * made
    assert _verdicts(third) == _verdicts(first)


def test_refusals_are_remembered_with_their_reason(tmp_path, evaluations, monkeypatch) -> None:
    # boolean-mask assignment: index_put's rule refuses the mask (CHECK_REFUSED)
    def program(x):
        y = x.sin()
        y[y < 0.1] = 0.0
        return y.cos()

    x = torch.randn(8)
    f, first = _compile(tmp_path, program)
    assert_same(f(x), program(x))
    _new_process(monkeypatch)
    made = evaluations[0]
    f, second = _compile(tmp_path, program)
    assert_same(f(x), program(x))
    assert evaluations[0] == made
    assert _verdicts(second) == _verdicts(first)
    assert "CHECK_REFUSED: boolean-mask indexing" in _verdicts(second)


def test_stale_evaluations_are_evaluated_again(tmp_path, evaluations, monkeypatch) -> None:
    x = torch.randn(4, 4)
    _compile(tmp_path)[0](x)
    made = evaluations[0]
    _new_process(monkeypatch)
    real = store.versions()
    monkeypatch.setattr(store, "versions", lambda: (*real, ("dynajax sources", "edited")))
    _compile(tmp_path)[0](x)
    assert evaluations[0] == 2 * made


@torch.library.custom_op("dynajax_test_memo::halve", mutates_args=())
def _halve(x: torch.Tensor) -> torch.Tensor:
    return x / 2


@_halve.register_fake
def _(x):
    return torch.empty_like(x)


def _with_halve(x: torch.Tensor) -> torch.Tensor:
    return _halve(x.sin()).cos()


def test_user_rules_are_not_kept_and_a_new_rule_is_evaluated(
    tmp_path, evaluations, monkeypatch
) -> None:
    x = torch.randn(5)
    dynajax.register_rule("dynajax_test_memo::halve")(lambda a: a / 2)
    try:
        f, _ = _compile(tmp_path, _with_halve)
        assert_same(f(x), _with_halve(x))
        made = evaluations[0]
        _new_process(monkeypatch)
        f, backend = _compile(tmp_path, _with_halve)
        assert_same(f(x), _with_halve(x))
        assert evaluations[0] == made + 1  # the user rule's node only, again
        # a rule replaced in the same process is evaluated again, and its verdict is its own
        dynajax.register_rule("dynajax_test_memo::halve", override=True)(
            lambda a: jnp.zeros((1,), a.dtype)  # wrong shape: refused
        )
        f, backend = _compile(tmp_path, _with_halve)
        assert_same(f(x), _with_halve(x))
        assert evaluations[0] == made + 2
        assert "rule gives float32[1] where PyTorch gives float32[5]" in backend.graphs[0].text(
            width=None
        )
    finally:
        dynajax.unregister_rule("dynajax_test_memo::halve")


def test_keys_known_only_by_identity_are_not_kept() -> None:
    assert memo._text(("op", ("T", (3,), "float32"))) is not None
    assert memo._text(("op", ("id", 1234))) is None
    assert memo._text(("op", "<object at 0x7f00>")) is None


def _dynajax_imports(path: Path) -> set[str]:
    """The dynajax modules ``path`` imports, anywhere in it (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("dynajax.")}


def test_the_store_is_a_leaf_and_memo_does_not_reach_into_the_runtime() -> None:
    assert _dynajax_imports(Path(store.__file__)) == {"dynajax._version.__version__"}
    assert not any(
        name.startswith("dynajax.runtime") for name in _dynajax_imports(Path(memo.__file__))
    )
