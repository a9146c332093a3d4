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
elements, so here the integer case is refused (it runs in PyTorch). The backend keeps the ops in
``FUSED_KERNELS`` out of aot_autograd's decomposition table so that these rules, which
follow the kernels, see them (autograd still differentiates them with PyTorch's own
formulas).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.dtypes import as_dtype, default_float, is_integral, promote, result_type
from dynajax.lowering.registry import lower

aten = torch.ops.aten

FUSED_KERNELS: tuple[torch._ops.OpOverload, ...] = (
    aten.addcdiv.default,
    aten.addr.default,
    aten.linalg_cross.default,
    aten.linspace.default,
    aten.linspace.Tensor_Tensor,
    aten.linspace.Tensor_Scalar,
    aten.linspace.Scalar_Tensor,
)


def _opmath(dtype: np.dtype) -> np.dtype:
    """The type PyTorch's CPU kernels compute half-precision values in."""
    half = (np.dtype(jnp.bfloat16), np.dtype(np.float16))
    return np.dtype(np.float32) if np.dtype(dtype) in half else np.dtype(dtype)


def _addcdiv_check(x, t1, t2, *, value=1):
    if is_integral(t1.dtype) and is_integral(t2.dtype):
        return "integer addcdiv (eager raises: integer division is not supported)"
    return None


@lower(aten.addcdiv.default, check=_addcdiv_check)
def _addcdiv(x, t1, t2, *, value=1):
    dtype = result_type(x, t1, t2)
    x, t1, t2 = promote(x, t1, t2, dtype=_opmath(dtype))
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
    acc = _opmath(dtype)
    if steps == 1:
        return jnp.full((1,), start, dtype)
    first, last = jnp.asarray(start).astype(acc), jnp.asarray(end).astype(acc)
    step = (last - first) / (steps - 1)
    idx = jnp.arange(steps)
    # The kernel's two halves: from the start up to the middle, from the end after it.
    forward = first + step * idx.astype(acc)
    backward = last - step * (steps - 1 - idx).astype(acc)
    return jnp.where(idx < steps // 2, forward, backward).astype(dtype)
