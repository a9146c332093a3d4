"""Tensor creation: full, arange, scalar_tensor, empty (as zeros), *_like."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax.export import is_symbolic_dim

from dynajax.lowering.dtypes import default_float, is_integral
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _fill_dtype(value, dtype):
    if dtype is not None:
        return dtype
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int64)
    return default_float()


@lower(aten.full.default)
def _full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value, _fill_dtype(fill_value, dtype))


@lower(aten.full_like.default)
def _full_like(
    x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    return jnp.full(x.shape, fill_value, dtype or x.dtype)


@lower(aten.zeros_like.default)
def _zeros_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(x.shape, dtype or x.dtype)


@lower(aten.ones_like.default)
def _ones_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(x.shape, dtype or x.dtype)


# Uninitialized memory in PyTorch; zeros are one valid content.
@lower(aten.empty.memory_format)
def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), dtype or default_float())


@lower(aten.empty_strided.default)
def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), dtype or default_float())


@lower(aten.empty_permuted.default)  # what empty_like of a dense tensor becomes
def _empty_permuted(
    size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None
):
    return jnp.zeros(tuple(size), dtype or default_float())


@lower(aten.empty_like.default)
def _empty_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(x.shape, dtype or x.dtype)


@lower(aten.new_empty.default)
def _new_empty(x, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), dtype or x.dtype)


@lower(aten.new_zeros.default)
def _new_zeros(x, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), dtype or x.dtype)


@lower(aten.new_ones.default)
def _new_ones(x, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), dtype or x.dtype)


@lower(aten.new_full.default)
def _new_full(x, size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value, dtype or x.dtype)


@lower(aten.scalar_tensor.default)
def _scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s, dtype or default_float())


@lower(aten.fill.Scalar)
def _fill_scalar(x, value):
    return jnp.full(x.shape, value, x.dtype)


@lower(aten.fill.Tensor)
def _fill_tensor(x, value):
    return jnp.broadcast_to(value.astype(x.dtype), x.shape)


@lower(aten.lift_fresh_copy.default)
def _lift_fresh_copy(x):
    return x


@lower(aten.copy.default)
def _copy(x, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(x.dtype), x.shape)


def _arange_dtype(start, end, step, dtype):
    if dtype is not None:
        return dtype
    if all(
        (isinstance(v, int) and not isinstance(v, bool)) or is_symbolic_dim(v)
        for v in (start, end, step)
    ):
        return np.dtype(np.int64)
    return default_float()


def _arange_length(start, end, step):
    if any(is_symbolic_dim(v) for v in (start, end, step)):
        # A size of jax.export's shape polymorphism (arange(x.shape[1])): an integer
        # expression, so the ceiling is integer division.
        return max(-((start - end) // step), 0)
    return max(int(np.ceil((end - start) / step)), 0)


def _truncate(v):
    """``int(v)``; a symbolic size (jax.export) is an integer already."""
    return v if is_symbolic_dim(v) else int(v)


@lower(aten.arange.start_step)
def _arange(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    dt = _arange_dtype(start, end, step, dtype)
    if dt == np.int64:
        # PyTorch sizes an int64 arange from the truncated bounds and step
        # (arange(-0.9, 2.1, 2.0, dtype=int64) has 1 element, int32 has 2).
        n = _arange_length(_truncate(start), _truncate(end), _truncate(step))
    else:
        n = _arange_length(start, end, step)
    # start + i * step in PyTorch's accumulate type, then cast: float64 for floating
    # outputs; int64 for integer ones, whose kernel first truncates a float start and
    # step (arange(-0.9, 2.1, 2.0, dtype=int32) is [0, 2]); the length comes from the
    # untruncated values.
    if is_integral(dt):
        start_ = jnp.asarray(_truncate(start), np.int64)
        step_ = jnp.asarray(_truncate(step), np.int64)
        return (start_ + jnp.arange(n, dtype=np.int64) * step_).astype(dt)
    acc = np.float64
    return (jnp.asarray(start, acc) + jnp.arange(n, dtype=acc) * jnp.asarray(step, acc)).astype(dt)


@lower(aten.arange.default)
def _arange_end(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(0, end, 1, dtype=dtype)


@lower(aten.arange.start)
def _arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(start, end, 1, dtype=dtype)


# Uninitialized memory in PyTorch; zeros are one valid content. (JAX values have no
# strides: the stride argument only describes PyTorch's memory layout.)
@lower(aten.new_empty_strided.default)
def _new_empty_strided(x, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), dtype or x.dtype)


def _tri_indices(numpy_fn, row, col, offset, dtype):
    rows, cols = numpy_fn(row, offset, col)
    return jnp.asarray(np.stack([rows, cols]), dtype or np.int64)


@lower(aten.tril_indices.default)
def _tril_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _tri_indices(np.tril_indices, row, col, offset, dtype)


@lower(aten.triu_indices.default)
def _triu_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _tri_indices(np.triu_indices, row, col, offset, dtype)
