"""Edge cases of graph inputs and outputs behave as eager."""

from __future__ import annotations

import pytest
import torch

import dynajax
from tests.helpers import compare_with_eager, compile_with
from tests.tolerances import assert_same


def test_non_tensor_inputs() -> None:
    def f(x, n: int, s: float, flag: bool, nothing, xs):
        y = x * n + s
        if flag:
            y = y - 1
        if nothing is None:
            y = y * 2
        return y + xs[0] * xs[1]

    x = torch.randn(3)
    compare_with_eager(f, x, 3, 0.5, True, None, [torch.randn(3), torch.randn(3)])


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3)], ids=str)
def test_zero_size_tensors(shape) -> None:
    def f(x):
        return torch.sin(x) + 1, x.sum(-1), x * 2

    compare_with_eager(f, torch.randn(shape))


def test_graph_with_no_ops() -> None:
    def f(x, y):
        return x, y

    x, y = torch.randn(2), torch.randn(3)
    compiled = torch.compile(f, backend="dynajax")
    a, b = compiled(x, y)
    assert a is x and b is y


def test_outputs_that_are_inputs_and_computed() -> None:
    def f(x, y):
        return x, torch.cos(y), y

    x, y = torch.randn(2), torch.randn(3)
    out = torch.compile(f, backend="dynajax")(x, y)
    assert out[0] is x and out[2] is y
    assert_same(out[1], torch.cos(y))


def test_scalar_tensors() -> None:
    def f(x, y):
        return x * y + 1, (x > 0), x.to(torch.int64) + 3

    compare_with_eager(f, torch.tensor(2.5), torch.tensor(-1.5))


def test_zero_dim_tensor_promotion() -> None:
    def f(x, s):
        # 0-dim float64 does not widen a float32 tensor; an int tensor + 0-dim float
        # gives the 0-dim tensor's category at the default dtype.
        return x + s, torch.arange(3) + s

    compare_with_eager(f, torch.randn(3), torch.tensor(2.0, dtype=torch.float64))


def test_requires_grad_inputs_under_no_grad() -> None:
    lin = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4, requires_grad=True)
    backend = dynajax.Backend()
    compiled = torch.compile(lin, backend=backend)
    with torch.no_grad():
        out = compiled(x)
        ref = lin(x)
    assert not out.requires_grad
    assert_same(out, ref)
    assert [g.kind for g in backend.graphs] == ["inference"]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float64,
        torch.int64,
        torch.int32,
        torch.bool,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
    ],
    ids=str,
)
def test_dtypes_survive(dtype) -> None:
    def f(x):
        return x.clone() * 1 if dtype != torch.bool else x & x

    x = (torch.randn(5) * 10).to(dtype) if dtype != torch.bool else torch.randn(5) > 0
    assert not compare_with_eager(f, x).fallbacks


def test_non_contiguous_input() -> None:
    def f(x):
        return x * 2 + 1

    x = torch.randn(4, 6).t()
    compare_with_eager(f, x)
    compare_with_eager(f, torch.randn(4, 6)[:, ::2])


@pytest.mark.parametrize(
    "name",
    ["scatter_add", "scatter_reduce_sum", "scatter_reduce_prod", "scatter_amin", "index_put"],
)
def test_bool_accumulating_scatters_and_empty_gather(name) -> None:
    # Bool addition is logical or and multiplication logical and, in JAX as in eager;
    # JAX's own scatter-add refuses bool. A gather with an empty index of another rank
    # is accepted by PyTorch.
    torch.manual_seed(0)
    x = torch.rand(4, 5) > 0.5
    src = torch.rand(4, 5) > 0.5
    index = torch.randint(0, 4, (4, 5))
    fns = {
        "scatter_add": lambda x, s, i: x.scatter_add(0, i, s),
        "scatter_reduce_sum": lambda x, s, i: x.scatter_reduce(0, i, s, "sum"),
        "scatter_reduce_prod": lambda x, s, i: x.scatter_reduce(
            0, i, s, "prod", include_self=False
        ),
        "scatter_amin": lambda x, s, i: x.scatter_reduce(1, i, s, "amin"),
        "index_put": lambda x, s, i: x.index_put((i[0],), s[0], accumulate=True),
    }
    fn = fns[name]
    backend = dynajax.Backend()
    actual = torch.compile(fn, backend=backend, fullgraph=True)(x, src, index)
    assert dynajax.Report(backend.graphs).fallbacks == []
    assert torch.equal(actual, fn(x, src, index))

    empty = torch.zeros(2, 0, dtype=torch.int64)
    compare_with_eager(lambda v, i: torch.gather(v, 0, i), torch.arange(5.0), empty)


# An input written in place that has internal overlap (several elements at one
# address): eager's in-place kernels refuse it before their other checks, except those
# that write every aliased element alike (fill_, zero_, index_put_), which eager runs.
# Dynajax runs such a call in eager PyTorch; the same graph with an input of its own
# memory runs in JAX.
_OVERLAP_CASES = {
    "add_": lambda x: x.add_(1),
    # a bad index too: eager's overlap error comes first, not the index's
    "index_add_-bad-index": lambda x: x.index_add_(0, torch.tensor([0, 5]), torch.tensor([1, 2])),
    "scatter_": lambda x: x.scatter_(0, torch.tensor([0]), torch.tensor([9])),
    "fill_": lambda x: x.fill_(4),
    "zero_": lambda x: x.zero_(),
    "index_put_": lambda x: x.index_put_((torch.tensor([0]),), torch.tensor(9)),
}


@pytest.mark.parametrize("name", list(_OVERLAP_CASES))
def test_an_input_written_in_place_with_internal_overlap_is_eagers(name: str) -> None:
    f = _OVERLAP_CASES[name]

    def run(fn, x):
        try:
            return fn(x), x
        except Exception as e:  # noqa: BLE001 - eager's error is the expected result
            # (what eager's kernel wrote before it raised is not compared: dynajax's
            # value checks leave the input as it was)
            return type(e), str(e)

    compiled, backend = compile_with(f)
    own = torch.tensor([3, 5])
    assert_same(run(compiled, own.clone()), run(f, own.clone()))
    assert backend.graphs and not backend.graphs[-1].fallbacks  # the graph runs in JAX
    for _ in range(2):  # (a recompile for the new strides, then its cached call)
        assert_same(run(compiled, torch.tensor([3]).expand(2)), run(f, torch.tensor([3]).expand(2)))
