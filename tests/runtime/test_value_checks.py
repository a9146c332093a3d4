"""Value checks at run time (dynajax/lowering/checks.py, runtime/compiled.py).

The four programs of issue 18 (an embedding, a gather and an advanced index out of
range, an integer division by zero) raise eager's exception type and message, forward
and in training; a failed call changes nothing the user owns (in-place updates, buffers,
gradients); the check output stays out of the way of the direct call path, dynamic
shapes and padding to buckets; ``checks=False`` and ``DYNAJAX_CHECKS`` turn the checks
off, and the persistent cache keeps the two programs apart.

    pytest -q tests/runtime/test_value_checks.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from dynajax.config import Options
from dynajax.errors import OptionsError
from dynajax.lowering import checks
from dynajax.runtime.compiled import CompiledPartition
from dynajax.runtime.jax_internals import X64
from tests.helpers import assert_no_fallbacks, compile_with, param_grads
from tests.tolerances import assert_same

L = torch.tensor


def partitions(backend: dynajax.Backend, kind: str | None = None) -> list[CompiledPartition]:
    """The JAX partitions of every graph (of one kind) that ``backend`` compiled."""
    return [
        m
        for g in backend.graphs
        if kind is None or g.kind == kind
        for m in g.graph_module.children()
        if isinstance(m, CompiledPartition)
    ]


def recorded(backend: dynajax.Backend, kind: str) -> list[str]:
    """The ops whose value checks the partitions of ``kind`` graphs recorded."""
    found = []
    for p in partitions(backend, kind):
        assert p.value_checks is not None and p.value_checks.checks is not None
        found += [c.op for c in p.value_checks.checks]
    return found


def eager_error(fn: Callable[..., Any], *args: Any) -> BaseException:
    with pytest.raises(Exception) as info:  # noqa: PT011 - compared below
        fn(*args)
    return info.value


def assert_raises_like_eager(compiled: Callable[..., Any], fn: Callable[..., Any], *args: Any):
    expected = eager_error(fn, *args)
    with pytest.raises(type(expected)) as info:
        compiled(*args)
    assert type(info.value) is type(expected)
    assert str(info.value) == str(expected)


# ---------------------------------------------------------------------------------
# The four programs of the issue
# ---------------------------------------------------------------------------------


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.embedding(i)


def _gather(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, 1, i)


def _index(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return x[i]


def _floordiv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a // b


def test_embedding_out_of_range_raises_index_error() -> None:
    torch.manual_seed(0)
    model = _Embed()
    compiled, backend = compile_with(model)
    assert_raises_like_eager(compiled, model, L([1, 12]))
    assert_no_fallbacks(backend)
    assert_same(compiled(L([1, 9])), model(L([1, 9])))  # the same compiled graph, valid


def test_gather_out_of_range_raises() -> None:
    compiled, _ = compile_with(_gather)
    assert_raises_like_eager(compiled, _gather, torch.randn(3, 10), L([[0, 12]]))


def test_index_out_of_range_raises() -> None:
    compiled, _ = compile_with(_index)
    assert_raises_like_eager(compiled, _index, torch.randn(3, 10), L([0, 5]))


def test_integer_division_by_zero_raises() -> None:
    compiled, _ = compile_with(_floordiv)
    assert_raises_like_eager(compiled, _floordiv, L([1, 2]), L([1, 0]))
    assert_same(compiled(L([7, -7]), L([2, 2])), _floordiv(L([7, -7]), L([2, 2])))


def test_the_error_says_where_it_was_checked() -> None:
    compiled, _ = compile_with(_gather)
    with pytest.raises(RuntimeError) as info:
        compiled(torch.randn(3, 10), L([[0, 12]]))
    notes = "".join(getattr(info.value, "__notes__", []))
    if hasattr(info.value, "add_note"):  # Python 3.11 on
        assert "aten.gather.default" in notes and "checks=False" in notes


# ---------------------------------------------------------------------------------
# Training: forward and backward graphs
# ---------------------------------------------------------------------------------


def test_embedding_training_checks_forward_only_as_eager() -> None:
    """Eager's embedding backward checks no index (and its decomposition clamps), so the
    backward graph records no check; the forward raises before autograd sees anything."""
    torch.manual_seed(0)
    model = _Embed()
    reference = _Embed()
    reference.load_state_dict(model.state_dict())
    compiled, backend = compile_with(model)
    compiled(L([[1, 2], [3, 9]])).square().sum().backward()
    reference(L([[1, 2], [3, 9]])).square().sum().backward()
    assert_same(param_grads(model), param_grads(reference), path="grad")
    assert recorded(backend, "forward") == ["aten.embedding.default"]
    assert recorded(backend, "backward") == []
    model.zero_grad(set_to_none=True)
    assert_raises_like_eager(compiled, reference, L([[1, 2], [3, 12]]))
    assert model.embedding.weight.grad is None


@pytest.mark.parametrize(
    ("fn", "inputs", "backward_checks"),
    [
        pytest.param(
            _gather,
            lambda: (torch.randn(3, 10), L([[0, 9], [1, 2], [3, 4]])),
            ["aten.scatter_add.default"],  # gather's backward: scatter_add, checked in eager
            id="gather",
        ),
        pytest.param(
            _index,
            lambda: (torch.randn(3, 10), L([0, 2])),
            ["aten.index_put.default"],  # index's backward: index_put_ (accumulate)
            id="index",
        ),
    ],
)
def test_backward_graphs_check_as_eagers_backward(
    fn: Callable[..., Any], inputs: Callable[[], tuple[Any, ...]], backward_checks: list[str]
) -> None:
    torch.manual_seed(0)
    x, i = inputs()
    x_eager = x.clone().requires_grad_()
    x = x.requires_grad_()
    compiled, backend = compile_with(fn)
    compiled(x, i).square().sum().backward()
    fn(x_eager, i).square().sum().backward()
    assert_same(x.grad, x_eager.grad, path="grad")
    assert recorded(backend, "backward") == backward_checks
    bad = L([[0, 12], [1, 2], [3, 4]]) if fn is _gather else L([0, 5])
    x.grad = None
    assert_raises_like_eager(compiled, fn, x, bad)
    assert x.grad is None


def test_a_backward_op_raises_eagers_error() -> None:
    """nll_loss_backward (decomposed to a scatter) raises eager's own message."""

    def backward(grad, x, t):
        return torch.ops.aten.nll_loss_backward(grad, x, t, None, 1, -100, torch.ones(()))

    compiled, _ = compile_with(backward)
    assert_raises_like_eager(compiled, backward, L(1.0), torch.randn(3, 10), L([0, 1, 12]))


# ---------------------------------------------------------------------------------
# A failed call changes nothing the user owns
# ---------------------------------------------------------------------------------


def test_a_failed_call_leaves_inputs_updated_in_place_unchanged() -> None:
    def update_then_index(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        x.add_(1)  # written back by aot_autograd only after the compiled graph returns
        return x[i] * 2

    compiled, backend = compile_with(update_then_index)
    x = torch.arange(6.0).reshape(3, 2)
    before = x.clone()
    assert_raises_like_eager(compiled, update_then_index, x.clone(), L([0, 5]))
    with pytest.raises(IndexError):
        compiled(x, L([0, 5]))
    assert torch.equal(x, before)
    assert len(partitions(backend)) == 1  # the update and the index: one XLA program
    compiled(x, L([0, 2]))
    assert torch.equal(x, before + 1)


def test_a_failed_call_leaves_buffers_unchanged() -> None:
    """BatchNorm's running statistics (buffers updated in place) and the lookup that
    fails sit in one graph: the statistics keep their values."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(10, 4)
            self.norm = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return self.norm(x) + self.embedding(i)

    torch.manual_seed(0)
    model = Model().train()
    compiled, _ = compile_with(model)
    x = torch.randn(5, 4)
    compiled(x, L([1, 2, 3, 4, 5]))
    mean, var, count = (b.clone() for b in model.norm.buffers())
    with pytest.raises(IndexError, match="index out of range in self"):
        compiled(x, L([1, 2, 3, 4, 50]))
    for got, want in zip(model.norm.buffers(), (mean, var, count), strict=True):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------
# The per-call paths: direct, dynamic shapes, buckets
# ---------------------------------------------------------------------------------


class _Lookup(nn.Module):
    """Enough cached inputs (parameters, buffers) for the direct call path."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 4))
        self.register_buffer("ids", L([1, 2, 3]))
        self.register_buffer("divisor", L([1, 2, 3]))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers(self.embedding(self.ids)), self.ids // self.divisor


def test_the_direct_path_checks_and_strips_the_check_output() -> None:
    torch.manual_seed(0)
    model = _Lookup().eval()
    compiled, backend = compile_with(model)
    with torch.no_grad():
        first = compiled()
        second = compiled()  # all inputs cached: the direct entry point
        (part,) = partitions(backend)
        assert part._direct is not None, "the direct path was not taken"
        assert_same(second, model())
        assert_same(first, second)
        # A write that bypasses the version counter keeps the direct path in use.
        model.divisor.numpy()[1] = 0
        with pytest.raises(RuntimeError) as info:
            compiled()
        assert str(info.value) == "ZeroDivisionError"
        model.divisor.numpy()[1] = 2
        assert_same(compiled(), model())


def test_dynamic_shapes_check_every_size() -> None:
    compiled, backend = compile_with(_index, dynamic=True)
    for n in (3, 5, 7):
        x = torch.randn(n, 4)
        assert_same(compiled(x, L([0, n - 1])), _index(x, L([0, n - 1])))
        assert_raises_like_eager(compiled, _index, x, L([0, n]))
    assert_no_fallbacks(backend)


def test_padding_that_trips_a_check_falls_back_to_exact_sizes() -> None:
    """Zeros padded into a divisor fail the division's check: the call runs again at its
    exact size, gives eager's answer, and the partition stops padding (the reason is in
    the Report); a real division by zero still raises."""
    compiled, backend = compile_with(_floordiv, dynamic=True, pad_to_buckets=True)
    a, b = L([7, -7, 9, 10, 11]), L([2, 2, 3, 4, 5])
    assert_same(compiled(a, b), _floordiv(a, b))
    stats = backend.graphs[0].compile_stats
    assert any("value check fails on padded rows" in line for line in stats.exact), stats.exact
    a6, b6 = L([7, -7, 9, 10, 11, 12]), L([2, 2, 3, 4, 5, 6])
    assert_same(compiled(a6, b6), _floordiv(a6, b6))
    assert_raises_like_eager(compiled, _floordiv, a, L([2, 2, 0, 4, 5]))


def test_padding_that_keeps_checks_valid_stays_padded() -> None:
    """Indices padded with zeros are in range: an embedding lookup stays bucketed."""
    torch.manual_seed(0)
    weight = torch.randn(10, 4)

    def lookup(i: torch.Tensor) -> torch.Tensor:
        return F.embedding(i, weight) * 2

    compiled, backend = compile_with(lookup, dynamic=True, pad_to_buckets=True)
    for n in (5, 6, 7):
        i = torch.arange(n) % 10
        assert_same(compiled(i), lookup(i))
    stats = backend.graphs[0].compile_stats
    assert stats.buckets and not any("value check" in line for line in stats.exact)
    assert_raises_like_eager(compiled, lookup, L([1, 2, 3, 4, 12]))


# ---------------------------------------------------------------------------------
# Turning checks off; the cache
# ---------------------------------------------------------------------------------


def test_checks_off_adds_no_output_and_raises_nothing() -> None:
    compiled, backend = compile_with(_gather, checks=False)
    compiled(torch.randn(3, 10), L([[0, 12]]))  # JAX's answer, no error
    (part,) = partitions(backend)
    assert part.value_checks is None


def test_a_partition_without_checks_adds_no_output() -> None:
    compiled, backend = compile_with(lambda x: x.sin() * 2)
    compiled(torch.randn(3))
    (part,) = partitions(backend)
    assert part.value_checks is not None and part.value_checks.checks == ()


def test_the_option_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Options().checks is True
    assert Options.resolve({"checks": False}).checks is False
    monkeypatch.setenv("DYNAJAX_CHECKS", "0")
    assert Options.resolve().checks is False
    assert Options.resolve({"checks": True}).checks is True  # explicit options win
    monkeypatch.setenv("DYNAJAX_CHECKS", "maybe")
    with pytest.raises(OptionsError, match="DYNAJAX_CHECKS"):
        Options.resolve()
    monkeypatch.delenv("DYNAJAX_CHECKS")
    with pytest.raises(OptionsError, match="checks must be True or False"):
        Options(checks=1)  # type: ignore[arg-type]


def test_the_persistent_cache_keeps_checked_and_unchecked_programs_apart(tmp_path) -> None:
    x, bad = torch.randn(3, 10), L([[0, 12]])
    checked, _ = compile_with(_gather, cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError):
        checked(x, bad)
    torch._dynamo.reset()
    unchecked, backend = compile_with(_gather, cache_dir=str(tmp_path), checks=False)
    unchecked(x, bad)  # not the checked executable from the cache
    torch._dynamo.reset()
    again, _ = compile_with(_gather, cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError):
        again(x, bad)


# ---------------------------------------------------------------------------------
# The collector itself
# ---------------------------------------------------------------------------------


def test_fail_if_records_nothing_without_a_collector() -> None:
    assert not checks.checking()
    checks.fail_if(True, RuntimeError, "never raised")  # no collector: nothing happens


def test_the_first_failing_check_and_position_win() -> None:
    token = X64.enable()  # as the runtime traces
    try:
        _first_failing_check_and_position_win()
    finally:
        X64.restore(token)


def _first_failing_check_and_position_win() -> None:
    with checks.collecting() as c:
        checks.fail_if(jnp.asarray([False, False]), ValueError, "first {v}", v=jnp.asarray([1, 2]))
        checks.fail_if(
            jnp.asarray([False, True, True]), IndexError, "second {v}", v=jnp.asarray([3, 4, 5])
        )
        checks.fail_if(True, KeyError, "third")
        checks.fail_if(True, RuntimeError, "float {f}", f=jnp.asarray(-float("nan")))
    table = checks.CheckTable()
    table.record(c.checks)
    vector = np.asarray(c.result())
    assert int(vector[0]) == 2
    with pytest.raises(IndexError) as info:
        table.raise_if_failed(vector)
    assert str(info.value) == "second 4"
    assert checks.Check(RuntimeError, "{f}", ("f",), frozenset({"f"})).exception(
        [np.float64(-np.nan).view(np.int64)]
    ).args == ("-nan",)


def test_two_traces_must_record_the_same_checks() -> None:
    table = checks.CheckTable()
    table.record([checks.Check(IndexError, "a")])
    table.record([checks.Check(IndexError, "a")])
    with pytest.raises(AssertionError, match="different value checks"):
        table.record([checks.Check(IndexError, "b")])
