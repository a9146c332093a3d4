"""Matrix products."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from dynajax.lowering.dtypes import as_dtype, is_integral, result_type
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _matmul(a, b):
    # Integer matmuls accumulate in their own dtype, like PyTorch.
    if is_integral(a.dtype):
        return jnp.matmul(a, b, preferred_element_type=a.dtype)
    return jnp.matmul(a, b)


@lower(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(a, b):
    return _matmul(a, b)


@lower(aten.dot.default, aten.vdot.default)
def _dot(a, b):
    return jnp.dot(a, b)


@lower(aten.mv.default)
def _mv(a, v):
    return _matmul(a, v)


def _scale(x, s):
    return x if s == 1 else x * as_dtype(s, x.dtype)


@lower(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def _addmm(bias, a, b, *, beta=1, alpha=1):
    prod = _scale(_matmul(a, b), alpha)
    if beta == 0:  # PyTorch ignores bias (even NaN) when beta == 0
        return jnp.broadcast_to(prod, prod.shape).astype(result_type(bias, a))
    return (_scale(bias, beta) + prod).astype(result_type(bias, a))
