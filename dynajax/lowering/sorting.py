"""Sorting and selection: sort, argsort, topk.

PyTorch orders NaN above every number (last ascending, first descending) and treats
-0.0 and 0.0 as equal; ``jax.lax.sort`` already does both for ascending keys, so a
descending sort sorts on an order-reversing key instead of flipping the result (which
would also reverse the order of ties).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.dtypes import is_floating
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _sort_check(x, *args, **kwargs):
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return "sorting complex numbers (PyTorch raises)"
    return None


def _descending_keys(x):
    """Keys whose ascending order is x's descending order, NaN first."""
    if is_floating(x.dtype):
        return [~jnp.isnan(x), -x]
    if x.dtype == np.bool_:
        return [jnp.logical_not(x)]
    return [jnp.bitwise_not(x)]  # ~x reverses the order of any integer, without overflow


def sort_along(x, dim, descending):
    """(values, int64 indices) of a stable sort of ``x`` along ``dim``."""
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    d = dim % x.ndim
    iota = jax.lax.broadcasted_iota(np.int64, x.shape, d)
    keys = _descending_keys(x) if descending else [x]
    *_, values, indices = jax.lax.sort(
        (*keys, x, iota), dimension=d, is_stable=True, num_keys=len(keys)
    )
    return values, indices


@lower(aten.sort.default, check=_sort_check)
def _sort(x, dim=-1, descending=False):
    return sort_along(x, dim, descending)


@lower(aten.sort.stable, check=_sort_check)
def _sort_stable(x, *, stable=None, dim=-1, descending=False):
    # A stable sort is one valid result of an unstable one.
    return sort_along(x, dim, descending)


@lower(aten.argsort.default, check=_sort_check)
def _argsort(x, dim=-1, descending=False):
    return sort_along(x, dim, descending)[1]


@lower(aten.argsort.stable, check=_sort_check)
def _argsort_stable(x, *, stable, dim=-1, descending=False):
    return sort_along(x, dim, descending)[1]


@lower(aten.topk.default, check=_sort_check)
def _topk(x, k, dim=-1, largest=True, sorted=True):
    # Sorted output is one valid answer for sorted=False, whose order PyTorch leaves open.
    values, indices = sort_along(x, dim, largest)
    if x.ndim == 0:
        return values, indices
    d = dim % x.ndim
    return (
        jax.lax.slice_in_dim(values, 0, k, axis=d),
        jax.lax.slice_in_dim(indices, 0, k, axis=d),
    )
