"""Indexing, gathering and scattering."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering import checks
from dynajax.lowering.registry import lower
from dynajax.lowering.shape import norm_slice

aten = torch.ops.aten

# Eager's messages for indices out of bounds (lowering/checks.py; the list of checks
# with their kernels is tests/lowering/value_checks.txt).
_INDEX_MESSAGE = "index {value} is out of bounds for dimension {dim} with size {size}"
_ALONG_MESSAGE = "index {value} is out of bounds for dimension {axis} with size {size}"
_IN_SELF_MESSAGE = "index out of range in self"


def _bool_index_check(x, indices):
    for i in indices:
        if i is not None and i.dtype == np.bool_:
            return "boolean-mask indexing has a data-dependent output shape"
    return None


def _index_tuple(x, indices):
    idx = tuple(slice(None) if i is None else i for i in indices)
    return idx


def _check_indices(x, indices):
    """Eager's bounds check of advanced indexing (index, index_put; indices in
    ``[-size, size)``): the first failing element in row-major order of the broadcast
    indices, and there the first failing index tensor. Eager's ``dimension`` counts
    the index tensors (``x[:, idx]`` reports dimension 0); ``axis`` is x's own dim."""
    if not checks.checking():
        return
    found = [(axis, i) for axis, i in enumerate(indices) if i is not None]
    if not found:
        return
    shape = jnp.broadcast_shapes(*(i.shape for _, i in found))
    if not checks.for_another_op():  # (a decomposition's: that op's own rules apply)
        if math.prod(shape) and any(x.shape[axis] == 0 for axis, _ in found):
            # eager's setup refuses any index into a dim of size 0
            checks.fail_if(True, IndexError, "index is out of bounds for dimension with size 0")
            return
        rest = math.prod(n for d, n in enumerate(x.shape) if d not in dict(found))
        if math.prod(shape) * rest == 0:  # eager's kernel visits no element: no check
            return
    values = jnp.stack([jnp.broadcast_to(i, shape).astype(np.int64) for _, i in found], -1)
    checks.fail_if_out_of_bounds(
        values,
        np.array([x.shape[axis] for axis, _ in found], np.int64),
        IndexError,
        _INDEX_MESSAGE,
        negative=True,
        shape=x.shape,
        itemsize=x.dtype.itemsize,
        dim=np.arange(len(found), dtype=np.int64),
        axis=np.array([axis for axis, _ in found], np.int64),
    )


@lower(aten.index.Tensor, check=_bool_index_check)
def _index(x, indices):
    _check_indices(x, indices)  # eager raises on indices out of range; XLA clamps
    return x[_index_tuple(x, indices)]


@lower(
    aten.index_put.default,
    check=lambda x, indices, values, accumulate=False: _bool_index_check(x, indices),
)
def _index_put(x, indices, values, accumulate=False):
    _check_indices(x, indices)
    idx = _index_tuple(x, indices)
    if accumulate:
        return _add_at(x, idx, values)
    return x.at[idx].set(values.astype(x.dtype))


def _add_at(x, idx, values):
    """``x`` with ``values`` added at ``idx`` in x's dtype (bool addition: logical or)."""
    if x.dtype == np.bool_:
        return x.astype(np.int32).at[idx].add(values.astype(np.int32)) != 0
    return x.at[idx].add(values.astype(x.dtype))


@lower(aten.index_add.default)
def _index_add(x, dim, index, source, *, alpha=1):
    """``index_add`` whole (``aot.table.CHECKED_KERNELS``), for eager's two
    checks of its indices: a self of two dims or more, added along its first or last dim with alpha
    1, an int64 index and a source of self's sizes apart from that dim, goes through
    scatter_add (a RuntimeError naming the index); any other call through a loop
    (IndexError "index out of range in self"). A self of two dims or more with no
    elements, or an empty index, is not checked. The sum is PyTorch's decomposition's:
    ``index_put`` with ``accumulate=True`` of ``source * alpha``."""
    d = dim % max(x.ndim, 1)
    if x.ndim > 1:
        if index.size and x.size:
            scatter = (
                d in (0, x.ndim - 1)
                and alpha == 1
                and index.dtype == np.int64
                and source.ndim == x.ndim
                and all(source.shape[i] == n for i, n in enumerate(x.shape) if i != d)
            )
            if scatter:
                _check_along(x, d, index)
            else:
                checks.fail_if_out_of_bounds(
                    index, x.shape[d], IndexError, _IN_SELF_MESSAGE, negative=False
                )
    else:
        checks.fail_if_out_of_bounds(index, x.size, IndexError, _IN_SELF_MESSAGE, negative=False)
    if alpha != 1:
        source = source * alpha
    x1 = x.reshape(1) if x.ndim == 0 else x
    if source.ndim != x1.ndim:  # a 0-dim source of a vector or 0-dim self
        source = source.reshape(tuple(-1 if i == d else n for i, n in enumerate(x1.shape)))
    idx = (slice(None),) * d + (index.reshape(-1),)
    return _add_at(x1, idx, source).reshape(x.shape)


def _index_select_check(x, dim, index):
    if x.ndim > 1 and x.size == 0 and x.shape[dim % x.ndim] == 0 and index.size > 0:
        return "index_select along an empty dim of an empty tensor (PyTorch raises)"
    return None


@lower(aten.index_select.default, check=_index_select_check)
def _index_select(x, dim, index):
    """Eager's kernel checks the indices in one of two ways: with its dim-1 fast path
    (and for an empty self of more than one dim), a RuntimeError naming the index;
    otherwise (self of at most one dim, or dim other than 1), IndexError."""
    d = dim % x.ndim if x.ndim else 0
    if x.ndim > 1 and (d == 1 or x.size == 0):
        message = "INDICES element is out of DATA bounds, id={value} axis_dim={size}"
        checks.fail_if_out_of_bounds(index, x.shape[d], RuntimeError, message, negative=False)
    else:
        size = x.shape[d] if x.ndim else 1
        checks.fail_if_out_of_bounds(index, size, IndexError, _IN_SELF_MESSAGE, negative=False)
    return x if x.ndim == 0 else jnp.take(x, index, axis=d)


def _check_along(x, dim, index):
    """Eager's bounds check of gather and the scatters: indices in ``[0, size)``."""
    d = dim % max(x.ndim, 1)
    size = x.shape[d] if x.ndim else 1
    checks.fail_if_out_of_bounds(index, size, RuntimeError, _ALONG_MESSAGE, negative=False, axis=d)


def _along(x, dim, index):
    """Full index tuple addressing x[..., index, ...] elementwise along dim."""
    d = dim % max(x.ndim, 1)
    grids = jnp.meshgrid(*(jnp.arange(n) for n in index.shape), indexing="ij", sparse=True)
    return tuple(index if i == d else grids[i] for i in range(index.ndim))


@lower(aten.gather.default)
def _gather(x, dim, index, *, sparse_grad=False):
    _check_along(x, dim, index)
    if index.size == 0:  # PyTorch accepts an empty index of any rank
        return jnp.zeros(index.shape, x.dtype)
    if x.ndim == 0:
        return x.reshape(index.shape)
    return x[_along(x, dim, index)]


@lower(aten.scatter.src)
def _scatter_src(x, dim, index, src):
    _check_along(x, dim, index)
    if x.ndim == 0:
        return src.reshape(()).astype(x.dtype) if index.size else x
    src = src[tuple(slice(0, n) for n in index.shape)]
    return x.at[_along(x, dim, index)].set(src.astype(x.dtype))


@lower(aten.scatter.value)
def _scatter_value(x, dim, index, value):
    _check_along(x, dim, index)
    if x.ndim == 0:
        return jnp.asarray(value, x.dtype) if index.size else x
    return x.at[_along(x, dim, index)].set(jnp.asarray(value, x.dtype))


@lower(aten.scatter_add.default)
def _scatter_add(x, dim, index, src):
    _check_along(x, dim, index)
    return _scatter_add_values(x, dim, index, src)


def _scatter_add_values(x, dim, index, src):
    if x.dtype == np.bool_:  # bool addition is logical or
        return _scatter_add_values(x.astype(np.int32), dim, index, src.astype(np.int32)) != 0
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
    if st == 1:
        # A contiguous slice is an update of a block, not a scatter. (A scatter over
        # whole dims has no indices, and jaxlib 0.10's CPU compiler aborted the process
        # on one that fed a reversed cumsum: "Invalid binary instruction opcode map",
        # narrow's gradient inside cumsum's; fuzz seed 5, program 6662.)
        starts = [0] * x.ndim
        starts[d] = s
        return jax.lax.dynamic_update_slice(x, src.astype(x.dtype), starts)
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
    if reduce == "mean" and x.dtype == np.bool_:
        return "scatter_reduce mean of bool"
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
    _check_along(x, dim, index)
    return _scatter_reduce_values(x, dim, index, src, reduce, include_self=include_self)


def _scatter_reduce_values(x, dim, index, src, reduce, *, include_self=True):
    if x.dtype == np.bool_:  # sum, prod, amax, amin of bools: or, and, or, and
        ints = (x.astype(np.int32), dim, index, src.astype(np.int32), reduce)
        return _scatter_reduce_values(*ints, include_self=include_self) != 0
    if x.ndim == 0:
        x, index, src = x.reshape(1), index.reshape(-1), src.reshape(-1)
        out = _scatter_reduce_values(x, 0, index, src, reduce, include_self=include_self)
        return out.reshape(())
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


_SCATTER_LEGACY_REDUCES = {"add": "sum", "multiply": "prod"}


def _scatter_legacy_check(x, dim, index, src, *, reduce):
    if reduce not in _SCATTER_LEGACY_REDUCES:
        return f"scatter with reduce={reduce!r} (PyTorch takes 'add' or 'multiply')"
    return None


@lower(aten.scatter.reduce, check=_scatter_legacy_check)
def _scatter_legacy(x, dim, index, src, *, reduce):
    # ``Tensor.scatter_(dim, index, src, reduce=...)``: scatter_reduce with self included.
    return _scatter_reduce(x, dim, index, src, _SCATTER_LEGACY_REDUCES[reduce])


@lower(aten.scatter.value_reduce, check=_scatter_legacy_check)
def _scatter_value_legacy(x, dim, index, value, *, reduce):
    src = jnp.full(index.shape, value, x.dtype)
    return _scatter_reduce(x, dim, index, src, _SCATTER_LEGACY_REDUCES[reduce])


@lower(aten.masked_scatter.default)
def _masked_scatter(x, mask, source):
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    flat_x = jnp.broadcast_to(x, shape).reshape(-1)
    flat_m = jnp.broadcast_to(mask, shape).reshape(-1)
    if checks.checking():
        checks.fail_if(
            jnp.sum(flat_m, dtype=np.int64) > source.size,
            RuntimeError,
            "Number of elements of source < number of ones in mask",
        )
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


@lower(aten.put.default)
def _put(x, index, source, accumulate=False):
    # x.flatten()[index] = source (or +=): indices address x's row-major elements.
    checks.fail_if(
        x.size == 0 and index.size > 0,
        IndexError,
        "put_(): Tried to put elements into an empty tensor",
    )
    checks.fail_if_out_of_bounds(
        index,
        x.size,
        IndexError,
        "out of range: tried to access index {value} on a tensor of {size} elements.",
        negative=True,
    )
    if index.size == 0:
        return x
    flat = x.reshape(-1)
    idx = index.reshape(-1)
    idx = jnp.where(idx < 0, idx + flat.size, idx)
    src = source.reshape(-1).astype(x.dtype)
    if not accumulate:
        out = flat.at[idx].set(src)
    elif x.dtype == np.bool_:
        out = flat.at[idx].max(src)  # bool += is logical or
    else:
        out = flat.at[idx].add(src)
    return out.reshape(x.shape)


_INDEX_REDUCES = ("prod", "mean", "amax", "amin")


def _index_reduce_check(x, dim, index, source, reduce, *, include_self=True):
    if reduce not in _INDEX_REDUCES:
        return f"index_reduce with reduce={reduce!r}"
    return None


@lower(aten.index_reduce.default, check=_index_reduce_check)
def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    # index_reduce along dim is scatter_reduce with index broadcast across the other
    # dims: source's slice i goes to x's slice index[i].
    size = x.shape[dim % x.ndim] if x.ndim else 1
    checks.fail_if_out_of_bounds(index, size, IndexError, _IN_SELF_MESSAGE, negative=False)
    return _index_reduce_values(x, dim, index, source, reduce, include_self=include_self)


def _index_reduce_values(x, dim, index, source, reduce, *, include_self=True):
    if x.ndim == 0 or source.ndim == 0:  # 0-dim tensors act as 1-element vectors
        x1, index1, source1 = (t.reshape(-1) for t in (x, index, source))
        out = _index_reduce_values(x1, 0, index1, source1, reduce, include_self=include_self)
        return out.reshape(x.shape)
    d = dim % source.ndim
    shape = [1] * source.ndim
    shape[d] = index.size
    full = jnp.broadcast_to(index.reshape(shape), source.shape)
    return _scatter_reduce_values(x, d, full, source, reduce, include_self=include_self)


@lower(aten.nonzero_static.default)
def _nonzero_static(x, *, size, fill_value=-1):
    # Indices of the first `size` nonzero elements (row-major), padded with fill_value.
    if x.ndim == 0:
        return jnp.zeros((size, 0), np.int64)
    if x.size == 0:  # jnp.nonzero pads empty inputs with 0, not fill_value
        return jnp.full((size, x.ndim), fill_value, np.int64)
    found = jnp.nonzero(x != 0, size=size, fill_value=fill_value)
    return jnp.stack(found, axis=1).astype(np.int64)


# ---------------------------------------------------------------------------------
# Storage addressing: as_strided and its scatter
# ---------------------------------------------------------------------------------
# as_strided(x, size, stride, offset) reads x's *storage*: output element j is the
# storage element at offset + sum(j * stride). A rule sees x's logical value, so it
# needs eager's layout of x (capability/layout.py): logical element i of x sits at
# x.storage_offset + sum(i * x.stride). The rule is exact when every storage position
# the op touches holds some element of x; it then becomes a gather (or scatter) with
# indices computed here, at trace time, in NumPy. Positions outside x's elements (the
# rest of a larger base tensor, or gaps between strided elements) are memory the JAX
# value does not have: such nodes are refused and run in eager PyTorch.


def _positions(shape, stride, offset) -> np.ndarray:
    """Storage position of each element of a (shape, stride, offset) view, row-major."""
    pos = np.full((1,) * len(shape), offset, np.int64)
    for d, (n, s) in enumerate(zip(shape, stride, strict=True)):
        axis = np.arange(n, dtype=np.int64) * s
        pos = pos + axis.reshape((1,) * d + (n,) + (1,) * (len(shape) - d - 1))
    return np.broadcast_to(pos, tuple(shape)).reshape(-1)


def _storage_index(shape, layout, size, stride, offset):
    """Row-major indices into x's elements of the storage positions a view reads.

    Returns (indices shaped ``size``, None), or (None, reason) when some position holds
    no element of x.
    """
    held = _positions(shape, layout.stride, layout.storage_offset)
    reads = _positions(size, stride, layout.storage_offset if offset is None else offset)
    if reads.size == 0:
        return np.zeros(tuple(size), np.int64), None
    order = np.argsort(held, kind="stable")
    ordered = held[order]
    k = np.clip(np.searchsorted(ordered, reads), 0, max(ordered.size - 1, 0))
    if ordered.size == 0 or not np.array_equal(ordered[k], reads):
        first = reads[ordered.size == 0 or np.argmax(ordered[k] != reads)]
        return None, (
            f"reads storage position {int(first)}, which holds no element of the input "
            f"(its elements lie at offset {layout.storage_offset} with strides "
            f"{list(layout.stride)}): eager reads memory the JAX value does not have"
        )
    return order[k].reshape(tuple(size)), None


def _strided_args_error(size, stride, offset) -> str | None:
    if len(size) != len(stride):
        return f"size {list(size)} and stride {list(stride)} differ in length"
    if any(s < 0 for s in size) or any(s < 0 for s in stride):
        return "negative sizes or strides (eager raises)"
    if offset is not None and offset < 0:
        return "negative storage offset (eager raises)"
    return None


def _as_strided_check(x, size, stride, storage_offset=None, *, layout):
    error = _strided_args_error(size, stride, storage_offset)
    if error is not None:
        return f"as_strided: {error}"
    if layout.input.unknown is not None:
        return f"as_strided of a tensor with no known eager layout: {layout.input.unknown}"
    _, reason = _storage_index(x.shape, layout.input, size, stride, storage_offset)
    return None if reason is None else f"as_strided {reason}"


def _gather_flat(x, idx):
    flat = x.reshape(-1)
    if idx.size == flat.size and np.array_equal(idx.reshape(-1), np.arange(idx.size)):
        return flat.reshape(idx.shape)  # the view reads x in row-major order
    if idx.size == 0:
        return jnp.zeros(idx.shape, x.dtype)
    dtype = np.int32 if flat.size < 2**31 else np.int64
    return flat[jnp.asarray(idx.astype(dtype))]


@lower(
    aten.as_strided.default,
    aten.as_strided_copy.default,
    aten._reshape_alias_copy.default,  # as_strided at the input's own offset
    check=_as_strided_check,
    needs_layout=True,
)
def _as_strided(x, size, stride, storage_offset=None, *, layout):
    idx, _ = _storage_index(x.shape, layout.input, size, stride, storage_offset)
    return _gather_flat(x, idx)


def _as_strided_scatter_check(x, src, size, stride, storage_offset=None, *, layout):
    # Eager clones x (keeping its strides when dense, offset 0) and copies src into
    # as_strided(clone, ...): the storage addressed is the output's.
    error = _strided_args_error(size, stride, storage_offset)
    if error is not None:
        return f"as_strided_scatter: {error}"
    if tuple(src.shape) != tuple(size):
        return f"as_strided_scatter: src shape {list(src.shape)} is not size {list(size)}"
    out = layout.output
    if out.unknown is not None:
        return f"as_strided_scatter of a tensor with no known eager layout: {out.unknown}"
    if np.unique(_positions(x.shape, out.stride, out.storage_offset)).size != np.prod(x.shape):
        return "as_strided_scatter output has overlapping elements"
    idx, reason = _storage_index(x.shape, out, size, stride, storage_offset)
    if reason is not None:
        return f"as_strided_scatter {reason}"
    if np.unique(idx).size != idx.size:
        return "as_strided_scatter writes one storage position twice (eager raises)"
    return None


@lower(aten.as_strided_scatter.default, check=_as_strided_scatter_check, needs_layout=True)
def _as_strided_scatter(x, src, size, stride, storage_offset=None, *, layout):
    idx, _ = _storage_index(x.shape, layout.output, size, stride, storage_offset)
    if idx.size == 0:
        return x
    flat = x.reshape(-1).at[jnp.asarray(idx.reshape(-1))].set(src.reshape(-1).astype(x.dtype))
    return flat.reshape(x.shape)


# ---------------------------------------------------------------------------------
# Segment reductions
# ---------------------------------------------------------------------------------

_SEGMENT_REDUCES = ("sum", "mean", "max", "min", "prod")


def _segment_reduce_check(data, reduce, *, lengths=None, indices=None, offsets=None, **_):
    if reduce not in _SEGMENT_REDUCES:
        return f"segment_reduce with reduce={reduce!r}"
    if lengths is None and offsets is None:
        return "segment_reduce without lengths or offsets (PyTorch raises)"
    return None


def _check_segments(data, lengths, offsets, axis, unsafe):
    """Eager's checks of segment_reduce's lengths or offsets, in its order."""
    if lengths is not None and not unsafe:
        checks.fail_if(lengths < 0, RuntimeError, "lengths contains negative value!")
        checks.fail_if(
            jnp.sum(lengths, axis=-1) != data.shape[axis % data.ndim],
            RuntimeError,
            "segment_reduce(): Expected all rows of lengths along axis to sum to "
            "data.size(lengths.dim()-1) when !unsafe.",
        )
    segment = lengths if lengths is not None else jnp.diff(offsets, axis=-1)
    checks.fail_if(
        segment < 0,
        RuntimeError,
        "Expected segment_length >= 0 to be true, but got false.  (Could this error "
        "message be improved?  If so, please report an enhancement request to PyTorch.)",
    )


@lower(aten.segment_reduce.default, check=_segment_reduce_check)
def _segment_reduce(
    data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None
):
    # Segment k of a row covers data[offsets[k]:offsets[k+1]] along axis; the dims
    # before axis are batch dims that lengths/offsets share. Lengths that do not sum to
    # the axis size make eager raise (unless unsafe): checked in the program.
    if checks.checking():
        _check_segments(data, lengths, offsets, axis, unsafe)
    if offsets is None:
        zero = jnp.zeros((*lengths.shape[:-1], 1), lengths.dtype)
        offsets = jnp.concatenate([zero, jnp.cumsum(lengths, axis=-1)], axis=-1)
    ax = axis % data.ndim
    lead, n, rest = data.shape[:ax], data.shape[ax], data.shape[ax + 1 :]
    segments = offsets.shape[-1] - 1
    rows = int(np.prod(lead, dtype=np.int64))
    offs = offsets.reshape(rows, segments + 1)
    pos = jnp.arange(n, dtype=offs.dtype)
    seg = jax.vmap(lambda ends: jnp.searchsorted(ends, pos, side="right"))(offs[:, 1:])
    inside = (pos[None, :] >= offs[:, :1]) & (seg < segments)
    ids = jnp.arange(rows, dtype=seg.dtype)[:, None] * segments + seg
    ids = jnp.where(inside, ids, rows * segments).reshape(-1)  # out of range: dropped
    flat = data.reshape(rows * n, *rest)
    num = rows * segments
    init = None if initial is None else jnp.asarray(initial, data.dtype)
    if reduce in ("sum", "mean"):
        out = jax.ops.segment_sum(flat, ids, num_segments=num)
        out = out if init is None else out + init
        if reduce == "mean":
            count = jax.ops.segment_sum(jnp.ones(flat.shape[:1], np.int64), ids, num_segments=num)
            count = count.reshape((num,) + (1,) * len(rest))
            empty = jnp.asarray(np.nan, data.dtype) if init is None else init
            out = jnp.where(count > 0, out / jnp.maximum(count, 1).astype(data.dtype), empty)
    elif reduce == "prod":
        out = jax.ops.segment_prod(flat, ids, num_segments=num)
        out = out if init is None else out * init
    else:
        seg_fn, combine = (
            (jax.ops.segment_max, jnp.maximum)
            if reduce == "max"
            else (jax.ops.segment_min, jnp.minimum)
        )
        out = seg_fn(flat, ids, num_segments=num)
        out = out if init is None else combine(out, init)
    return out.astype(data.dtype).reshape(*lead, segments, *rest)


# ---------------------------------------------------------------------------------
# Histograms: bin each coordinate by its edges, then scatter-add the weights
# ---------------------------------------------------------------------------------
# PyTorch's CPU kernel keeps bins consistent with the returned edges: an element goes
# to the last edge <= it (the rightmost bin also takes its right edge), and elements
# outside [first edge, last edge] or NaN are not counted. Edges computed from a bin
# count are torch.linspace of the outer edges (the data's min and max, or range),
# widened by 0.5 on each side when they coincide, and [0, 1] for empty input. Data
# with an infinite or NaN min/max makes eager raise; such values cannot be detected
# when the program is traced.


def _histogram_dtype_check(x, weight=None):
    if np.dtype(x.dtype) not in (np.float32, np.float64):
        return f"histogram of {np.dtype(x.dtype).name} (PyTorch's CPU kernel takes float32/float64)"
    if weight is not None and weight.dtype != x.dtype:
        return "histogram weight of another dtype (PyTorch raises)"
    return None


def _linspace(lo, hi, steps, dtype):
    # torch.linspace's CPU kernel: steps taken in the output dtype, the first half of
    # the points counted from the start and the second half back from the end.
    i = jnp.arange(steps)
    step = (hi - lo) / jnp.asarray(max(steps - 1, 1), dtype)
    head = lo + step * i.astype(dtype)
    tail = hi - step * (steps - 1 - i).astype(dtype)
    return jnp.where(i < steps // 2, head, tail)


def _outer_edges(coords, range_, d):
    """(leftmost, rightmost) edges of dim d of an (M, D) tensor, before linspace."""
    dtype = coords.dtype
    if range_ is not None:
        lo, hi = float(range_[2 * d]), float(range_[2 * d + 1])
        _check_finite_range(jnp.asarray(lo), jnp.asarray(hi), d)
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        return jnp.asarray(lo, dtype), jnp.asarray(hi, dtype)
    if coords.shape[0] == 0:
        _check_finite_range(jnp.zeros((), dtype), jnp.ones((), dtype), d)
        return jnp.asarray(0.0, dtype), jnp.asarray(1.0, dtype)
    lo, hi = jnp.min(coords[:, d]), jnp.max(coords[:, d])
    _check_finite_range(lo, hi, d)
    same = lo == hi
    return jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)


def _check_finite_range(lo, hi, d):
    checks.fail_if(
        ~(jnp.isfinite(lo) & jnp.isfinite(hi)),
        RuntimeError,
        "torch.histogramdd: dimension {dim}'s range [{low}, {high}] is not finite",
        dim=d,
        low=lo,
        high=hi,
    )


def _bin_edges(coords, bins, range_):
    return [
        _linspace(*_outer_edges(coords, range_, d), bins[d] + 1, coords.dtype)
        for d in range(coords.shape[1])
    ]


def _histogramdd(coords, edges, weight, density):
    """The histogram of (M, D) coordinates over D edge sequences."""
    dtype = coords.dtype
    counts = [e.shape[0] - 1 for e in edges]
    keep = jnp.ones(coords.shape[:1], bool)
    flat = jnp.zeros(coords.shape[:1], np.int64)
    for d, e in enumerate(edges):
        c = coords[:, d]
        pos = jnp.searchsorted(e, c, side="right") - 1
        pos = jnp.clip(pos, 0, counts[d] - 1)  # the last edge belongs to the last bin
        keep = keep & (c >= e[0]) & (c <= e[-1])
        flat = flat * counts[d] + pos
    w = jnp.ones(coords.shape[:1], dtype) if weight is None else weight.reshape(-1)
    size = int(np.prod(counts, dtype=np.int64))
    hist = jnp.zeros((size,), dtype).at[flat].add(jnp.where(keep, w, 0).astype(dtype))
    hist = hist.reshape(counts)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            shape = [1] * len(edges)
            shape[d] = counts[d]
            hist = hist / jnp.diff(e).reshape(shape)
    return hist


def _histogram_bin_ct_check(x, bins=100, *, range=None, weight=None, density=False):
    if bins <= 0:
        return "histogram with bins <= 0 (PyTorch raises)"
    return _histogram_dtype_check(x, weight)


@lower(aten.histogram.bin_ct, check=_histogram_bin_ct_check)
def _histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
    coords = x.reshape(-1, 1)
    edges = _bin_edges(coords, [bins], range)
    return _histogramdd(coords, edges, weight, density), edges[0]


def _histogram_bins_tensor_check(x, bins, *, weight=None, density=False):
    if bins.ndim != 1 or bins.shape[0] < 1 or bins.dtype != x.dtype:
        return "histogram bins must be a non-empty 1-D tensor of the input's dtype"
    return _histogram_dtype_check(x, weight)


@lower(aten.histogram.bins_tensor, check=_histogram_bins_tensor_check)
def _histogram_bins_tensor(x, bins, *, weight=None, density=False):
    return _histogramdd(x.reshape(-1, 1), [bins], weight, density), bins


def _histogramdd_check(x, bins, *, range=None, weight=None, density=False):
    if x.ndim < 2 or len(bins) != x.shape[-1]:
        return "histogramdd input must be (..., D) with D bin counts (PyTorch raises)"
    if any(b <= 0 for b in bins):
        return "histogramdd with bins <= 0 (PyTorch raises)"
    return _histogram_dtype_check(x, weight)


@lower(aten._histogramdd_bin_edges.default, check=_histogramdd_check)
def _histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    return tuple(_bin_edges(x.reshape(-1, x.shape[-1]), bins, range))


@lower(aten._histogramdd_from_bin_cts.default, check=_histogramdd_check)
def _histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    coords = x.reshape(-1, x.shape[-1])
    return _histogramdd(coords, _bin_edges(coords, bins, range), weight, density)


def _histogramdd_tensors_check(x, bins, *, weight=None, density=False):
    if x.ndim < 2 or len(bins) != x.shape[-1]:
        return "histogramdd input must be (..., D) with D edge tensors (PyTorch raises)"
    if any(b.ndim != 1 or b.shape[0] < 1 or b.dtype != x.dtype for b in bins):
        return "histogramdd bins must be non-empty 1-D tensors of the input's dtype"
    return _histogram_dtype_check(x, weight)


@lower(aten._histogramdd_from_bin_tensors.default, check=_histogramdd_tensors_check)
def _histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    return _histogramdd(x.reshape(-1, x.shape[-1]), list(bins), weight, density)
