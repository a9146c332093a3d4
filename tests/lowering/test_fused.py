"""Fused pointwise kernels lowered whole (``dynajax/lowering/fused.py``): in bfloat16
their rounding differs from the chain of ops the core decompositions would produce,
so these compare bit for bit with eager, where the decomposed chain is an ulp off."""

from __future__ import annotations

import pytest
import torch

import dynajax
from tests.helpers import assert_ops_in_jax, compile_with
from tests.tolerances import assert_same


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_addcdiv_rounds_once_like_the_kernel(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, a = torch.randn(4096, dtype=dtype) * 8, torch.randn(4096, dtype=dtype)
    b = torch.rand(4096, dtype=dtype) + 0.05
    fn, backend = compile_with(lambda x, a, b: torch.addcdiv(x, a, b))
    assert torch.equal(fn(x, a, b), torch.addcdiv(x, a, b))
    assert_ops_in_jax(backend, "aten.addcdiv.default")


@pytest.mark.parametrize(
    ("dtype", "beta", "alpha"),
    [
        (torch.bfloat16, 0.5, 1.3),
        (torch.bfloat16, 1, 1),
        (torch.float16, 2.0, -0.7),
        (torch.float32, 0.5, 1.3),
        (torch.int64, 2, 3),
        (torch.bool, True, True),
        (torch.bool, False, True),
    ],
)
def test_addr_matches_the_kernel(dtype: torch.dtype, beta, alpha) -> None:
    torch.manual_seed(0)
    if dtype == torch.bool:
        m, u, v = torch.rand(30, 40) > 0.5, torch.rand(30) > 0.5, torch.rand(40) > 0.5
    elif dtype == torch.int64:
        m, u, v = (torch.randint(-9, 9, s) for s in ((30, 40), (30,), (40,)))
    else:
        m, u, v = (torch.randn(s, dtype=dtype) for s in ((30, 40), (30,), (40,)))
    fn, backend = compile_with(lambda m, u, v: torch.addr(m, u, v, beta=beta, alpha=alpha))
    got, want = fn(m, u, v), torch.addr(m, u, v, beta=beta, alpha=alpha)
    if dtype == torch.float32:  # rounding errors of float32 products, within tolerance
        assert_same(got, want)
    else:  # each product rounded to the dtype, in the kernel's order: bit for bit
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    assert_ops_in_jax(backend, "aten.addr.default")


def test_addr_with_beta_zero_ignores_nan_input() -> None:
    m = torch.full((3, 4), float("nan"))
    u, v = torch.randn(3), torch.randn(4)
    fn, _ = compile_with(lambda m, u, v: torch.addr(m, u, v, beta=0))
    assert_same(fn(m, u, v), torch.addr(m, u, v, beta=0))
    assert not fn(m, u, v).isnan().any()


def test_addr_gradients_match_eager() -> None:
    torch.manual_seed(0)
    args = [torch.randn(s, requires_grad=True) for s in ((5, 6), (5,), (6,))]
    fn, _ = compile_with(lambda m, u, v: torch.addr(m, u, v, beta=0.5, alpha=2.0).sin().sum())
    fn(*args).backward()
    got = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    torch.addr(*args, beta=0.5, alpha=2.0).sin().sum().backward()
    assert_same(got, [a.grad for a in args])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_linalg_cross_rounds_each_product_like_the_kernel(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    if dtype == torch.int64:
        a, b = torch.randint(-50, 50, (2000, 3)), torch.randint(-50, 50, (1, 3))
    else:
        a, b = torch.randn(2000, 3, dtype=dtype) * 3, torch.randn(1, 3, dtype=dtype) * 3
    fn, backend = compile_with(lambda a, b: torch.linalg.cross(a, b))
    got, want = fn(a, b), torch.linalg.cross(a, b)
    if dtype == torch.float32:
        assert_same(got, want)
    else:  # bfloat16: the float32 decomposition differed from eager in half the rows
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    assert_ops_in_jax(backend, "aten.linalg_cross.default")


def test_integer_linspace_runs_in_pytorch_and_float_linspace_in_jax() -> None:
    # linspace(0, 7, 50) into int64: the float32 decomposition truncated 3.9999998 to 3
    # where the kernel gives 4; the integer case is refused and runs eagerly.
    fn, backend = compile_with(lambda: torch.linspace(0, 7, 50, dtype=torch.int64))
    assert torch.equal(fn(), torch.linspace(0, 7, 50, dtype=torch.int64))
    (fallback,) = dynajax.Report(backend.graphs).fallbacks
    assert fallback.target == "aten.linspace.default" and "integer" in fallback.detail
    fn, backend = compile_with(lambda: torch.linspace(-2.5, 4.0, 33))
    assert_same(fn(), torch.linspace(-2.5, 4.0, 33))
    assert_ops_in_jax(backend, "aten.linspace.default")


@pytest.mark.parametrize(
    ("start", "end", "steps"), [(-1.0, 2.0, 16), (-3.7, 0.3, 41), (1e-3, 7.5, 100), (5.0, -2.0, 9)]
)
def test_float_linspace_rounds_once_per_element_as_the_kernels_fma(start, end, steps) -> None:
    # linspace(-1, 2, 16)[5] is 1.49e-8 in eager (an FMA), 0.0 as a multiply then an add;
    # Rprop took that product's sign (the training fuzzer, seed 4 run 248).
    fn, backend = compile_with(lambda: torch.linspace(start, end, steps))
    assert torch.equal(fn(), torch.linspace(start, end, steps))
    assert_ops_in_jax(backend, "aten.linspace.default")


@pytest.mark.parametrize(
    ("dtype", "steps"),
    [
        (torch.bfloat16, 2),  # 10 ** bf16(4.3) = 20480; 10 ** 4.3 rounds to 19968
        (torch.bfloat16, 7),
        (torch.bfloat16, 1),  # a single step reads the unrounded start
        (torch.int64, 9),  # start and end truncated, exponents in float64
        (torch.float64, 6),
    ],
)
def test_logspace_rounds_start_and_end_like_the_kernel(dtype: torch.dtype, steps: int) -> None:
    def logspace():
        return torch.logspace(4.3, -3.7, steps, base=3.0 if steps == 7 else 10.0, dtype=dtype)

    fn, backend = compile_with(logspace)
    got, want = fn(), logspace()
    assert got.dtype == want.dtype
    assert torch.equal(got, want), (got, want)
    assert_ops_in_jax(backend, "aten.logspace.default")


def test_logspace_with_tensor_bounds_matches_the_kernel() -> None:
    start, end = torch.tensor(0.0), torch.tensor(1.2)

    def fn(s, e):
        return torch.logspace(s, e, 4, dtype=torch.bfloat16)

    compiled, backend = compile_with(fn)
    assert torch.equal(compiled(start, end), fn(start, end))
    assert_ops_in_jax(backend, "aten.logspace.Tensor_Tensor")
