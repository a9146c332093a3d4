"""Indexing, gathering and scattering."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.registry import lower
from dynajax.lowering.shape import norm_slice

aten = torch.ops.aten


def _bool_index_check(x, indices):
    for i in indices:
        if i is not None and i.dtype == np.bool_:
            return "boolean-mask indexing has a data-dependent output shape"
    return None


def _index_tuple(x, indices):
    idx = tuple(slice(None) if i is None else i for i in indices)
    return idx


@lower(aten.index.Tensor, check=_bool_index_check)
def _index(x, indices):
    # Out-of-range indices raise in PyTorch; XLA clamps. Valid programs agree.
    return x[_index_tuple(x, indices)]


@lower(
    aten.index_put.default,
    check=lambda x, indices, values, accumulate=False: _bool_index_check(x, indices),
)
def _index_put(x, indices, values, accumulate=False):
    idx = _index_tuple(x, indices)
    values = values.astype(x.dtype)
    return x.at[idx].add(values) if accumulate else x.at[idx].set(values)


@lower(aten.index_select.default)
def _index_select(x, dim, index):
    if x.ndim == 0:
        return x
    return jnp.take(x, index, axis=dim % x.ndim)


def _along(x, dim, index):
    """Full index tuple addressing x[..., index, ...] elementwise along dim."""
    d = dim % max(x.ndim, 1)
    grids = jnp.meshgrid(*(jnp.arange(n) for n in index.shape), indexing="ij", sparse=True)
    return tuple(index if i == d else grids[i] for i in range(index.ndim))


@lower(aten.gather.default)
def _gather(x, dim, index, *, sparse_grad=False):
    if x.ndim == 0:
        return x.reshape(index.shape)
    return x[_along(x, dim, index)]


@lower(aten.scatter.src)
def _scatter_src(x, dim, index, src):
    if x.ndim == 0:
        return src.reshape(()).astype(x.dtype) if index.size else x
    src = src[tuple(slice(0, n) for n in index.shape)]
    return x.at[_along(x, dim, index)].set(src.astype(x.dtype))


@lower(aten.scatter.value)
def _scatter_value(x, dim, index, value):
    if x.ndim == 0:
        return jnp.asarray(value, x.dtype) if index.size else x
    return x.at[_along(x, dim, index)].set(jnp.asarray(value, x.dtype))


@lower(aten.scatter_add.default)
def _scatter_add(x, dim, index, src):
    if x.ndim == 0:
        return x + src.reshape(()).astype(x.dtype) if index.size else x
    src = src[tuple(slice(0, n) for n in index.shape)]
    return x.at[_along(x, dim, index)].add(src.astype(x.dtype))


@lower(aten.select_scatter.default)
def _select_scatter(x, src, dim, index):
    d = dim % x.ndim
    idx = [slice(None)] * x.ndim
    idx[d] = index % x.shape[d]
    return x.at[tuple(idx)].set(src.astype(x.dtype))


@lower(aten.slice_scatter.default)
def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    d = dim % x.ndim
    s, e, st = norm_slice(x.shape[d], start, end, step)
    idx = [slice(None)] * x.ndim
    idx[d] = slice(s, e, st)
    return x.at[tuple(idx)].set(src.astype(x.dtype))


@lower(aten.masked_fill.Scalar)
def _masked_fill_scalar(x, mask, value):
    return jnp.where(mask, jnp.asarray(value, x.dtype), x)


@lower(aten.masked_fill.Tensor)
def _masked_fill_tensor(x, mask, value):
    return jnp.where(mask, value.astype(x.dtype), x)


# ---------------------------------------------------------------------------------
# Reducing scatters and masked scatter
# ---------------------------------------------------------------------------------

_SCATTER_REDUCES = ("sum", "prod", "mean", "amax", "amin")


def _scatter_reduce_check(x, dim, index, src, reduce, *, include_self=True):
    if reduce not in _SCATTER_REDUCES:
        return f"scatter_reduce with reduce={reduce!r}"
    return None


def _reduction_identity(dtype, reduce):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(-jnp.inf if reduce == "amax" else jnp.inf, dtype)
    if dtype == np.bool_:
        return jnp.asarray(reduce != "amax", dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if reduce == "amax" else info.max, dtype)


@lower(aten.scatter_reduce.two, check=_scatter_reduce_check)
def _scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    if x.ndim == 0:
        x, index, src = x.reshape(1), index.reshape(-1), src.reshape(-1)
        return _scatter_reduce(x, 0, index, src, reduce, include_self=include_self).reshape(())
    src = src[tuple(slice(0, n) for n in index.shape)].astype(x.dtype)
    idx = _along(x, dim, index)
    base = x if include_self else x.at[idx].set(_reduction_identity(x.dtype, reduce))
    at = base.at[idx]
    if reduce in ("sum", "mean"):
        out = at.add(src)
    elif reduce == "prod":
        out = at.multiply(src)
    elif reduce == "amax":
        out = at.max(src)
    else:
        out = at.min(src)
    if reduce != "mean":
        return out
    # Each slot is divided by the number of values it received (itself included when
    # include_self); slots nothing was scattered to keep their value.
    count = jnp.full(x.shape, 1 if include_self else 0, np.int64).at[idx].add(1)
    count = jnp.maximum(count, 1)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return out / count.astype(x.dtype)
    return jnp.floor_divide(out, count.astype(x.dtype))


@lower(aten.masked_scatter.default)
def _masked_scatter(x, mask, source):
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    flat_x = jnp.broadcast_to(x, shape).reshape(-1)
    flat_m = jnp.broadcast_to(mask, shape).reshape(-1)
    if source.size == 0 or flat_x.size == 0:
        return flat_x.reshape(shape)
    # The k-th True of the mask (in row-major order) takes the k-th element of source.
    pos = jnp.clip(jnp.cumsum(flat_m, dtype=np.int64) - 1, 0, source.size - 1)
    taken = source.reshape(-1)[pos].astype(x.dtype)
    return jnp.where(flat_m, taken, flat_x).reshape(shape)


@lower(aten.diagonal_scatter.default)
def _diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    # x with x.diagonal(offset, dim1, dim2) replaced by src (whose last dim is the
    # diagonal, as torch.diagonal lays it out).
    d1, d2 = dim1 % x.ndim, dim2 % x.ndim
    moved = jnp.moveaxis(x, (d1, d2), (-2, -1))
    n1, n2 = moved.shape[-2:]
    length = max(min(n1, n2 - offset) if offset >= 0 else min(n1 + offset, n2), 0)
    i = np.arange(length)
    rows, cols = (i, i + offset) if offset >= 0 else (i - offset, i)
    moved = moved.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))
