"""dynajax bugs the differential fuzzer (``python -m fuzz``) found, each reduced to a
minimal program, marked ``xfail(strict=True)`` with its cause until it is fixed (then
the mark goes, and so does its entry in ``fuzz/known_bugs.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dynajax
from tests.helpers import compare_with_eager

NAN, INF = float("nan"), float("inf")


def _assert_raises_like_eager(fn: Callable[..., Any], *args: Any) -> None:
    """Eager raises; the compiled function raises an exception of the same type."""
    with pytest.raises(Exception) as eager:
        fn(*args)
    compiled = torch.compile(fn, backend=dynajax.Backend(cache_dir=""))
    with pytest.raises(type(eager.value)):
        compiled(*args)


@pytest.mark.xfail(
    strict=True,
    reason="aten.exp2 is jnp.exp2 in the input's dtype (_float_unary): for bfloat16 JAX "
    "computes exp(x * ln2) with the product rounded to bfloat16 (no excess precision), "
    "so exp2(10) is 1000, not 1024; eager computes in float32 and rounds once. "
    "float16 is 14x less accurate than eager but within the table.",
)
def test_exp2_bfloat16() -> None:
    x = torch.tensor([10.0, 14.6875, 3.3, -7.3], dtype=torch.bfloat16)
    compare_with_eager(lambda t: torch.exp2(t), x)


@pytest.mark.xfail(
    strict=True,
    reason="the _softmax/_log_softmax rules return ones/zeros for a 0-dim input whatever "
    "its value; eager computes exp(x - x) and x - x, NaN for NaN and +-inf.",
)
@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax], ids=lambda f: f.__name__)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=str)
def test_softmax_of_a_nonfinite_scalar(fn: Callable[..., torch.Tensor], value: float) -> None:
    compare_with_eager(lambda t: fn(t, 0), torch.tensor(value))


@pytest.mark.xfail(
    strict=True,
    reason="aten.sign/aten.sgn lower to jnp.sign, which keeps NaN; PyTorch's CPU kernel "
    "computes (0 < x) - (x < 0), 0 for NaN. Also the gradient of abs (abs_backward is "
    "grad * sgn(x)): eager's is 0 at NaN, dynajax's NaN.",
)
def test_sign_of_nan() -> None:
    compare_with_eager(lambda t: (torch.sign(t), torch.sgn(t)), torch.tensor([NAN, 1.5, -2.0]))


@pytest.mark.xfail(
    strict=True,
    reason="the same cause: the gradient of abs at a NaN (sgn(NaN) is NaN in dynajax, 0 "
    "in eager), here through a matmul that spreads it to every input gradient.",
)
def test_abs_gradient_at_nan() -> None:
    x = torch.tensor([NAN, 1.5, -2.0], requires_grad=True)
    y = x.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(torch.abs(x).sum(), x)
    compiled = torch.compile(lambda t: torch.abs(t), backend=dynajax.Backend(cache_dir=""))
    (actual,) = torch.autograd.grad(compiled(y).sum(), y)
    torch.testing.assert_close(actual, expected, equal_nan=True)


@pytest.mark.xfail(
    strict=True,
    reason="a product with a bool converted to float is 0 where the other factor is inf "
    "or NaN (eager: 0 * inf = NaN): XLA's algebraic simplifier rewrites x * convert(pred) "
    "into select(pred, x, 0), which is not IEEE-exact (plain jax.jit does the same). "
    "mul in float32/float64 (half precision multiplies in float32 and escapes), addcmul "
    "in every floating dtype (inf + 0 where eager has inf + NaN)",
)
@pytest.mark.parametrize(
    "fn, dtype",
    [
        (lambda b, x: b * x, torch.float32),
        (lambda b, x: torch.addcmul(x, b, x), torch.bfloat16),
    ],
    ids=["mul-float32", "addcmul-bfloat16"],
)
def test_product_with_a_bool_of_inf(fn: Callable[..., torch.Tensor], dtype: torch.dtype) -> None:
    b = torch.tensor([False, True, False])
    compare_with_eager(fn, b, torch.tensor([INF, NAN, -INF], dtype=dtype))


@pytest.mark.xfail(
    strict=True,
    reason="pow(x, 0.5) lowers to jnp.power, whose C pow semantics give pow(-inf, 0.5) = inf "
    "and pow(-0., 0.5) = 0.; eager's kernel computes sqrt for exponent 0.5 (NaN, -0.)",
)
def test_pow_half_of_special_values() -> None:
    compare_with_eager(lambda t: torch.pow(t, 0.5), torch.tensor([-INF, INF, 4.0]))


@pytest.mark.xfail(
    strict=True,
    reason="integer pow with an int64 exponent of 2**32 or more uses only the exponent's "
    "low 32 bits (jnp.power's square-and-multiply loop): 3 ** (2**40 + 1) gives 3; eager "
    "wraps modulo 2**64 like any int64 product",
)
def test_int64_pow_with_a_huge_exponent() -> None:
    compare_with_eager(
        lambda b, e: torch.pow(b, e), torch.tensor([3, -2, 5]), torch.tensor([2**40 + 1] * 3)
    )


@pytest.mark.xfail(
    strict=True,
    reason="the backward of amax/amin over a slice that holds a NaN: eager's grad * (x == "
    "result) / count is 0 / 0 = NaN for every element, dynajax's is 0",
)
@pytest.mark.parametrize("fn", [torch.amax, torch.amin], ids=lambda f: f.__name__)
def test_amax_gradient_with_nan(fn: Callable[..., torch.Tensor]) -> None:
    x = torch.tensor([1.0, NAN, 3.0], requires_grad=True)
    y = x.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(fn(x, 0), x)
    compiled = torch.compile(lambda t: fn(t, 0), backend=dynajax.Backend(cache_dir=""))
    (actual,) = torch.autograd.grad(compiled(y), y)
    torch.testing.assert_close(actual, expected, equal_nan=True)


@pytest.mark.xfail(
    strict=True,
    reason="backward raises 'one of the variables needed for gradient computation has been "
    "modified by an inplace operation': on the core-ATen-decomposed graph (sinc is cheap "
    "pointwise ops), the min-cut partitioner recomputes sinc(x0) in the backward from x0, "
    "an input the forward mutates (x0.neg_()); aot_autograd saves x0 itself, whose "
    "version the mutation bumps. aot_autograd with the same partitioner and dynajax's "
    "decompositions fails the same way; without the decompositions it saves sinc(x0)",
)
def test_backward_after_mutating_an_input_the_backward_recomputes_from() -> None:
    def f(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
        v0 = torch.sinc(x0)
        x0.neg_()
        return torch.hypot(x1, v0) - 0.5

    x0, x1 = torch.tensor(0.7), torch.tensor(300.0, requires_grad=True)
    out = torch.compile(f, backend=dynajax.Backend(cache_dir=""))(x0, x1)
    (grad,) = torch.autograd.grad(out, x1)
    (expected,) = torch.autograd.grad(f(torch.tensor(0.7), x1), x1)
    torch.testing.assert_close(grad, expected)


@pytest.mark.xfail(
    strict=True,
    reason="dynajax's value checks raise RuntimeError('index 5 is out of bounds for "
    "dimension 0 with size 3'): index_add's entry in lowering/checks.py _ORIGINS, or "
    "index_put's for a 0-dim self (decomposed to index_put); eager's index_add raises "
    "IndexError('index out of range in self') when self has 0 or 1 dims (RuntimeError "
    "from 2 dims on)",
)
@pytest.mark.parametrize("shape", [(), (3,)], ids=str)
def test_index_add_out_of_range_on_a_vector(shape: tuple[int, ...]) -> None:
    src = torch.ones(()) if not shape else torch.ones(1)
    _assert_raises_like_eager(
        lambda x, i, s: torch.index_add(x, 0, i, s), torch.zeros(shape), torch.tensor([5]), src
    )


# Eager's CPU kernels refuse some dtypes that the meta kernels (which Dynamo's fake
# tensors run) accept; dynajax computed a value where eager raises. Fixed: the
# capability stage asks the eager kernel (capability/eager_kernel.py) and such a node
# runs in PyTorch (EAGER_REFUSES); aot.py does not decompose such a call (softplus,
# silu, mish, frac, lerp decompose into ops that take the dtype).
@pytest.mark.parametrize(
    "fn, x",
    [
        (torch.relu, torch.tensor([True, False])),  # RuntimeError
        (torch.abs, torch.tensor([True, False])),  # NotImplementedError
        (lambda t: torch.sub(t, 1), torch.tensor([True, False])),  # RuntimeError
        (F.softplus, torch.tensor([1, -2])),  # NotImplementedError
        (F.silu, torch.tensor([1, -2])),  # NotImplementedError
        (lambda t: torch.softmax(t, 0), torch.tensor(3)),  # 0-dim; NotImplementedError
        (torch.frac, torch.tensor([1, -2])),  # NotImplementedError
        (torch.floor, torch.tensor([True, False])),  # NotImplementedError
        (F.mish, torch.tensor([True, False])),  # NotImplementedError
        (lambda t: torch.lerp(t, t, 0.25), torch.tensor([True, False])),
        (lambda t: torch.argmin(t, 0), torch.tensor([True, False])),  # RuntimeError
        (lambda t: torch.median(t, 0).values, torch.tensor([True, False])),
        (lambda t: F.linear(t, t[None]), torch.tensor([True, False])),  # NotImplementedError
    ],
    ids=[
        "relu-bool",
        "abs-bool",
        "sub-bool",
        "softplus-int64",
        "silu-int64",
        "softmax-int64-0d",
        "frac-int64",
        "floor-bool",
        "mish-bool",
        "lerp-bool",
        "argmin-bool",
        "median-bool",
        "linear-bool",
    ],
)
def test_raises_where_eager_kernel_lacks_the_dtype(
    fn: Callable[..., torch.Tensor], x: torch.Tensor
) -> None:
    _assert_raises_like_eager(fn, x)
