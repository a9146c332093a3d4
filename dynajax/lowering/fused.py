"""Ops that PyTorch runs as one CPU kernel whose rounding its decomposition misses.

PyTorch's core decompositions rewrite these ops into chains of simpler ops that round
differently from the kernels: ``addcdiv`` computes in its opmath type (float32 for
bfloat16 and float16) and rounds once, where the chain rounds after each op;
``addr`` rounds after every multiply, but in the order ``(alpha * vec1) * vec2``
where the decomposition computes ``alpha * (vec1 * vec2)``; ``linalg_cross`` rounds
each product and the difference to the input dtype, where the decomposition computes
in float32 and rounds once. In bfloat16 each difference moves results by an ulp
(0.0625 at magnitude 8), which is a different answer. ``linspace`` into an integer
dtype truncates per SIMD vector of the CPU (its values depend on AVX2 vs AVX-512);
its decomposition computes in float32 and truncates once, an off-by-one in some
elements, so here the integer case is refused (it runs in PyTorch). ``logspace``
rounds its start and end to the dtype before computing the exponents (by 4 bfloat16
ulps at 1e4, where the decomposition does not). The backend keeps the ops in
``dynajax.aot.table.FUSED_KERNELS`` out of aot_autograd's decomposition
table so that these rules, which follow the kernels, see them (autograd still
differentiates them with PyTorch's own formulas).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.dtypes import (
    as_dtype,
    default_float,
    is_integral,
    opmath,
    promote,
    result_type,
)
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _addcdiv_check(x, t1, t2, *, value=1):
    if is_integral(t1.dtype) and is_integral(t2.dtype):
        return "integer addcdiv (eager raises: integer division is not supported)"
    return None


@lower(aten.addcdiv.default, check=_addcdiv_check)
def _addcdiv(x, t1, t2, *, value=1):
    dtype = result_type(x, t1, t2)
    x, t1, t2 = promote(x, t1, t2, dtype=opmath(dtype))
    return (x + as_dtype(value, x.dtype) * (t1 / t2)).astype(dtype)


@lower(aten.addr.default)
def _addr(x, vec1, vec2, *, beta=1, alpha=1):
    dtype = result_type(x, vec1, vec2)
    x, vec1, vec2 = promote(x, vec1, vec2, dtype=dtype)
    shape = jnp.broadcast_shapes(x.shape, (vec1.shape[0], vec2.shape[0]))
    if dtype == np.bool_:
        out = bool(alpha) & vec1[:, None] & vec2[None, :]
        if beta:
            out = out | x
        return jnp.broadcast_to(out, shape)
    # The kernel's order: (alpha * vec1) * vec2, each product rounded to the dtype.
    out = (as_dtype(alpha, dtype) * vec1)[:, None] * vec2[None, :]
    if beta != 0:  # beta == 0 ignores the input, NaN and inf included
        out = as_dtype(beta, dtype) * x + out
    return jnp.broadcast_to(out, shape)


@lower(aten.linalg_cross.default)
def _linalg_cross(x, y, dim=-1):
    x, y = promote(x, y)
    shape = jnp.broadcast_shapes(x.shape, y.shape)
    x, y = jnp.broadcast_to(x, shape), jnp.broadcast_to(y, shape)
    axis = dim % len(shape)

    def part(a, i):
        return jax.lax.index_in_dim(a, i, axis, keepdims=True)

    # Each product and difference rounded to the dtype, as the kernel does.
    out = [
        part(x, (i + 1) % 3) * part(y, (i + 2) % 3) - part(x, (i + 2) % 3) * part(y, (i + 1) % 3)
        for i in range(3)
    ]
    return jnp.concatenate(out, axis=axis)


def _linspace_dtype(start, end, dtype):
    if dtype is not None:
        return np.dtype(dtype)
    if isinstance(start, complex) or isinstance(end, complex):
        return np.dtype(np.complex128 if default_float() == np.float64 else np.complex64)
    return default_float()


def _linspace_check(start, end, steps, *, dtype=None, **_):
    if is_integral(_linspace_dtype(start, end, dtype)):
        return (
            "integer linspace: PyTorch's kernel truncates per SIMD vector, so its values "
            "depend on the CPU's vector width"
        )
    return None


@lower(
    aten.linspace.default,
    aten.linspace.Tensor_Tensor,
    aten.linspace.Tensor_Scalar,
    aten.linspace.Scalar_Tensor,
    check=_linspace_check,
)
def _linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = _linspace_dtype(start, end, dtype)
    acc = opmath(dtype)
    if steps == 1:
        return jnp.full((1,), start, dtype)
    first, last = jnp.asarray(start).astype(acc), jnp.asarray(end).astype(acc)
    step = (last - first) / (steps - 1)
    idx = jnp.arange(steps)
    # The kernel's two halves: from the start up to the middle, from the end after it,
    # each a fused multiply-add (Vectorized::fmadd): one rounding, where a multiply
    # then an add round twice (linspace(-1, 2, 16)[5]: 1.49e-8 in eager, 0 unfused;
    # the training fuzzer, seed 4 run 248, where Rprop took that gradient's sign). In
    # float32, the float64 product and sum are exact and round once, as the FMA does
    # (the formula: bit for bit with eager on 3,000 random float32 calls; the rule on 40
    # random compiled calls). Half precision and float64 are not yet bit for bit (an
    # ulp off in some elements, as before): the kernel's path for them is another, and
    # float64's FMA would need wider floats.
    wide = np.dtype(np.float64) if np.dtype(acc) == np.dtype(np.float32) else acc
    first_w, last_w, step_w = first.astype(wide), last.astype(wide), step.astype(wide)
    forward = (first_w + step_w * idx.astype(wide)).astype(acc)
    backward = (last_w - step_w * (steps - 1 - idx).astype(wide)).astype(acc)
    return jnp.where(idx < steps // 2, forward, backward).astype(dtype)


@lower(
    aten.logspace.default,
    aten.logspace.Tensor_Tensor,
    aten.logspace.Tensor_Scalar,
    aten.logspace.Scalar_Tensor,
)
def _logspace(
    start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=None
):
    # PyTorch's CPU kernel: start and end converted to the dtype (through float32 for
    # half precision, truncated for integers) and their difference rounded to it; the
    # step and exponents in float32 for float32 and half precision (float64 for
    # float64 and integers), from the start up to the middle and from the end after
    # it; base ** exponent in float64, converted to the dtype. A single step is
    # base ** start, from the unconverted start. (Bit for bit with eager on the OpInfo
    # samples and on 500 random bfloat16 and float16 calls.)
    dtype = _linspace_dtype(start, end, dtype)
    complex_ = jnp.issubdtype(dtype, jnp.complexfloating)
    wide = np.dtype(np.complex128 if complex_ else np.float64)

    def to_dtype(v):
        v = jnp.asarray(v)
        if np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
            v = v.astype(np.float32)
        return v.astype(dtype)

    base_ = jnp.asarray(base, wide)
    if steps == 0:
        return jnp.zeros((0,), dtype)
    if steps == 1:
        return to_dtype(jnp.power(base_, jnp.asarray(start).astype(wide))).reshape(1)
    if is_integral(dtype) or np.dtype(dtype) in (np.float64, np.complex128):
        acc = wide
    else:
        acc = np.dtype(np.complex64 if complex_ else np.float32)
    first, last = to_dtype(start).astype(acc), to_dtype(end).astype(acc)
    # end - start is a subtraction of two dtype values, rounded to the dtype.
    diff = last - first
    if np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
        info = jnp.finfo(dtype)
        diff = jax.lax.reduce_precision(diff, info.nexp, info.nmant)
    step = diff / jnp.asarray(steps - 1, acc)
    idx = jnp.arange(steps)
    forward = first + step * idx.astype(acc)
    backward = last - step * (steps - 1 - idx).astype(acc)
    exponent = jnp.where(idx < steps // 2, forward, backward)
    return to_dtype(jnp.power(base_, exponent.astype(wide)))
