"""``jax_function``'s value checks and in-place updates of inputs.

Value checks: where eager raises on argument values (an embedding index past the table,
a gather index out of bounds, an integer division by zero), a direct call of ``fn``
raises eager's exception, and ``fn.checked`` returns the checks as a value that goes
through ``jax.jit``, ``jax.vmap``, ``jax.lax.scan`` and ``jax.grad`` and raises eager's
exception with ``.throw()``. In-place updates: ``fn.with_updates`` returns the new
values of the inputs the model writes into, as eager leaves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import dynajax
from dynajax.interop import InputUpdatesDiscardedWarning, ValueCheckResult
from tests.interop.test_jax_function import narrow, to_torch
from tests.tolerances import assert_same

# ---------------------------------------------------------------------------------
# Value checks
# ---------------------------------------------------------------------------------


def floor_divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a // b


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(1, index)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, target)


def histc(x: torch.Tensor) -> torch.Tensor:
    return torch.histc(x, bins=4)


@dataclasses.dataclass
class CheckCase:
    """A model, valid example arguments, and arguments on which eager raises."""

    model: Callable[..., Any]
    good: tuple[torch.Tensor, ...]
    bad: tuple[torch.Tensor, ...]


CASES = {
    "embedding": CheckCase(
        nn.Embedding(10, 4), (torch.tensor([[1, 2, 3]]),), (torch.tensor([[1, 12, 3]]),)
    ),
    "gather": CheckCase(
        gather,
        (torch.randn(2, 4), torch.tensor([[0, 3], [1, 2]])),
        (torch.randn(2, 4), torch.tensor([[0, 3], [5, 2]])),
    ),
    "int-floor-divide": CheckCase(
        floor_divide,
        (torch.tensor([7, -9, 4]), torch.tensor([2, 4, 3])),
        (torch.tensor([7, -9, 4]), torch.tensor([2, 0, 3])),
    ),
    "cross-entropy-target": CheckCase(
        cross_entropy,
        (torch.randn(3, 5), torch.tensor([0, 4, 2])),
        (torch.randn(3, 5), torch.tensor([0, 5, 2])),
    ),
    # A float payload (the range), decoded from the check's integer vector.
    "histc-range": CheckCase(
        histc, (torch.tensor([0.5, 1.5, 3.0]),), (torch.tensor([1.5, float("inf"), 2.0]),)
    ),
}


def eager_error(case: CheckCase) -> tuple[type[Exception], str]:
    with pytest.raises(Exception) as info:
        case.model(*case.bad)
    return type(info.value), str(info.value)


def numpy_args(args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    return [t.numpy() for t in args]


@contextlib.contextmanager
def raises_eagers_error(case: CheckCase) -> Iterator[Any]:
    """Expects eager's exception type, with eager's message (and dynajax's note)."""
    error, message = eager_error(case)
    with pytest.raises(error) as info:
        yield info
    assert type(info.value) is error
    assert str(info.value) == message


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
@pytest.mark.parametrize("name", list(CASES))
def test_direct_call_raises_eagers_error(name: str, x64: bool) -> None:
    case = CASES[name]
    with jax.enable_x64(x64):
        fn, state = dynajax.jax_function(case.model, *case.good)
        with torch.no_grad():
            expected = case.model(*case.good)
        assert_same(to_torch(fn(state, *numpy_args(case.good))), narrow(expected))
        with raises_eagers_error(case) as info:
            fn(state, *numpy_args(case.bad))
        assert "value check" in " ".join(getattr(info.value, "__notes__", [""]))
        # with_state and with_updates check too
        with raises_eagers_error(case):
            fn.with_updates(state, *numpy_args(case.bad))


@pytest.mark.parametrize("name", list(CASES))
def test_checked_under_jit_returns_the_error_as_a_value(name: str) -> None:
    case = CASES[name]
    fn, state = dynajax.jax_function(case.model, *case.good)
    checked = jax.jit(fn.checked)
    out, err = checked(state, *numpy_args(case.good))
    assert isinstance(err, ValueCheckResult)
    assert not err.failed() and err.get() is None
    err.throw()  # nothing failed: nothing raised
    with torch.no_grad():
        assert_same(to_torch(out), narrow(case.model(*case.good)))
    _, err = checked(state, *numpy_args(case.bad))
    assert err.failed()
    error, message = eager_error(case)
    assert err.get() == f"{error.__name__}: {message}"
    with raises_eagers_error(case):
        err.throw()


def test_checked_under_vmap_and_scan_raises_for_the_first_failing_element() -> None:
    case = CASES["embedding"]
    fn, state = dynajax.jax_function(case.model, *case.good)
    good, bad = case.good[0].numpy(), case.bad[0].numpy()
    batch = np.stack([good, good, bad])
    _, err = jax.jit(jax.vmap(fn.checked, in_axes=(None, 0)))(state, batch)
    assert np.asarray(err.vector).shape[0] == 3
    assert [bool(v) for v in np.asarray(err.vector)[:, 0]] == [False, False, True]
    with raises_eagers_error(case) as info:
        err.throw()
    assert "at index (2,)" in " ".join(info.value.__notes__)
    _, err = jax.vmap(fn.checked, in_axes=(None, 0))(state, batch[:2])
    assert not err.failed()

    def step(total: jax.Array, ids: jax.Array) -> tuple[jax.Array, ValueCheckResult]:
        out, err = fn.checked(state, ids)
        return total + out.sum(), err

    total, errs = jax.jit(lambda xs: jax.lax.scan(step, jnp.zeros(()), xs))(batch)
    with raises_eagers_error(case):
        errs.throw()
    _, errs = jax.lax.scan(step, jnp.zeros(()), batch[:2])
    assert not errs.failed()
    # A model with no checks: the result holds the code alone, 0.
    linear, linear_state = dynajax.jax_function(nn.Linear(4, 2), torch.randn(3, 4))
    assert linear.checked is linear.checked  # one object: jax.jit caches its traces
    _, err = jax.vmap(linear.checked, in_axes=(None, 0))(linear_state, np.ones((3, 3, 4)))
    assert err.checks == () and np.asarray(err.vector).shape == (3, 1)
    assert not err.failed() and err.get() is None


def test_checked_under_grad_and_with_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.BatchNorm1d(3)).train()
    case = CheckCase(
        model, (torch.tensor([[1, 2, 3], [4, 5, 6]]),), (torch.tensor([[1, 2, 3], [4, 10, 6]]),)
    )
    fn, state = dynajax.jax_function(model, *case.good)
    params, buffers = fn.split_state(state)

    def loss(p: dict[str, jax.Array], ids: jax.Array) -> tuple[jax.Array, Any]:
        out, new_state, err = fn.checked.with_state({**p, **buffers}, ids)
        return out.sum() ** 2, (new_state, err)

    grad = jax.jit(jax.grad(loss, has_aux=True))
    grads, (new_state, err) = grad(params, case.good[0].numpy())
    assert not err.failed()
    model(*case.good).sum().pow(2).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None
        assert_same(to_torch(grads[n]), p.grad, path=f"grad[{n}]")
    for n, b in model.named_buffers():
        assert_same(to_torch(new_state[n]), narrow(b), path=n)
    _, (_, err) = grad(params, case.bad[0].numpy())
    with raises_eagers_error(case):
        err.throw()


def test_checks_off_and_traced_calls_do_not_raise() -> None:
    # fn stays pure: under jax.jit it computes no checks (JAX's own semantics for an
    # index out of range: a clamped or filled value); checks=False turns the checks of
    # direct calls off too. fn.checked is the checked form for both.
    case = CASES["embedding"]
    bad = case.bad[0].numpy()
    fn, state = dynajax.jax_function(case.model, *case.good)
    out = jax.jit(fn)(state, bad)
    assert out.shape == (1, 3, 4)
    unchecked, state = dynajax.jax_function(case.model, *case.good, checks=False)
    assert unchecked(state, bad).shape == (1, 3, 4)
    with raises_eagers_error(case):
        unchecked.checked(state, bad)[1].throw()


# ---------------------------------------------------------------------------------
# Inputs updated in place
# ---------------------------------------------------------------------------------


class Accumulate(nn.Module):
    """Writes into two of its inputs: a running sum and a step counter (in a tuple)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, total: torch.Tensor, counters: tuple[torch.Tensor]
    ) -> torch.Tensor:
        y = self.linear(x)
        total.add_(y)
        counters[0].add_(1)
        return y.relu().sum()


def test_inputs_updated_in_place_come_back_from_with_updates() -> None:
    torch.manual_seed(0)
    model = Accumulate()
    x, total, step = torch.randn(2, 4), torch.randn(2, 4), torch.tensor(3)
    fn, state = dynajax.jax_function(model, x, total, (step,))
    assert fn.mutated_inputs == (1, 2)
    args = (x.numpy(), total.numpy(), (step.numpy(),))
    out, new_state, new_args = jax.jit(fn.with_updates)(state, *args)
    total_t, counters_t = total.clone(), (step.clone(),)
    with torch.no_grad():
        expected = model(x, total_t, counters_t)
    assert_same(to_torch(out), expected)
    assert new_state.keys() == state.keys()
    assert_same(to_torch(new_args[0]), x)  # not updated: passed through
    assert_same(to_torch(new_args[1]), total_t)
    assert isinstance(new_args[2], tuple)
    assert_same(to_torch(new_args[2][0]), narrow(counters_t[0]))

    # A scan carrying the updated inputs equals the eager loop over the same tensors.
    xs = torch.randn(3, 2, 4)

    def step_fn(carry: Any, xi: jax.Array) -> tuple[Any, jax.Array]:
        t, c = carry
        out, _, (_, t, c) = fn.with_updates(state, xi, t, c)
        return (t, c), out

    (t, c), outs = jax.lax.scan(step_fn, args[1:], xs.numpy())
    with torch.no_grad():
        expected_outs = torch.stack([model(xi, total, (step,)) for xi in xs])
    assert_same(to_torch(outs), expected_outs)
    assert_same(to_torch(t), total)
    assert_same(to_torch(c[0]), narrow(step))


def test_forms_that_drop_input_updates_warn_once() -> None:
    torch.manual_seed(0)
    model = Accumulate()
    x, total, step = torch.randn(2, 4), torch.zeros(2, 4), torch.tensor(0)
    fn, state = dynajax.jax_function(model, x, total, (step,))
    args = (x.numpy(), total.numpy(), (step.numpy(),))
    with pytest.warns(InputUpdatesDiscardedWarning, match="with_updates"):
        fn(state, *args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn.with_state(state, *args)  # once per function
        fn.with_updates(state, *args)  # the form that keeps them never warns
    plain, plain_state = dynajax.jax_function(nn.Linear(4, 4), x)
    assert plain.mutated_inputs == ()
    _, _, (same,) = plain.with_updates(plain_state, x.numpy())
    np.testing.assert_array_equal(np.asarray(same), x.numpy())
