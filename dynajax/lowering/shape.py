"""Shape and layout ops: views, permutations, concatenation, slicing, padding.

JAX arrays are immutable values, so every view op is a plain value-producing op;
aot_autograd has already made the graph functional.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.dtypes import result_type
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _dim(x, d):
    return d % max(x.ndim, 1)


@lower(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(x, size):
    return jnp.reshape(x, tuple(size))


@lower(aten.view.dtype)
def _view_dtype(x, dtype):
    return (
        jax.lax.bitcast_convert_type(x, dtype)
        if np.dtype(dtype).itemsize == x.dtype.itemsize
        else _bitcast_resize(x, dtype)
    )


def _bitcast_resize(x, dtype):
    src, dst = x.dtype.itemsize, np.dtype(dtype).itemsize
    if src > dst:
        out = jax.lax.bitcast_convert_type(x, dtype)  # adds a trailing dim
        return out.reshape(*x.shape[:-1], x.shape[-1] * (src // dst))
    x = x.reshape(*x.shape[:-1], x.shape[-1] // (dst // src), dst // src)
    return jax.lax.bitcast_convert_type(x, dtype)


@lower(aten.permute.default)
def _permute(x, dims):
    return jnp.transpose(x, tuple(_dim(x, d) for d in dims))


@lower(aten.t.default)
def _t(x):
    return x.T


@lower(aten.transpose.int)
def _transpose(x, dim0, dim1):
    if x.ndim == 0:
        return x
    return jnp.swapaxes(x, _dim(x, dim0), _dim(x, dim1))


@lower(aten.expand.default)
def _expand(x, size, *, implicit=False):
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if (s == -1 and i >= lead) else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, shape)


@lower(aten.squeeze.dim)
def _squeeze_dim(x, dim):
    if x.ndim == 0:
        return x
    d = _dim(x, dim)
    return jnp.squeeze(x, d) if x.shape[d] == 1 else x


@lower(aten.squeeze.dims)
def _squeeze_dims(x, dim):
    if x.ndim == 0:
        return x
    ds = tuple(sorted({_dim(x, d) for d in dim if x.shape[_dim(x, d)] == 1}))
    return jnp.squeeze(x, ds) if ds else x


@lower(aten.squeeze.default)
def _squeeze(x):
    return jnp.squeeze(x)


@lower(aten.unsqueeze.default)
def _unsqueeze(x, dim):
    return jnp.expand_dims(x, dim % (x.ndim + 1))


@lower(aten.cat.default)
def _cat(tensors, dim=0):
    dt = result_type(*tensors)
    # PyTorch skips legacy empty 1-D tensors of shape (0,) in cat.
    parts = [t.astype(dt) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not parts:
        return jnp.zeros((0,), dt)
    return jnp.concatenate(parts, axis=dim % parts[0].ndim)


@lower(aten.stack.default)
def _stack(tensors, dim=0):
    dt = result_type(*tensors)
    return jnp.stack([t.astype(dt) for t in tensors], axis=dim % (tensors[0].ndim + 1))


def _split_points(sizes):
    return list(np.cumsum(sizes)[:-1])


@lower(aten.split_with_sizes.default)
def _split_with_sizes(x, split_sizes, dim=0):
    return tuple(jnp.split(x, _split_points(split_sizes), axis=_dim(x, dim)))


@lower(aten.split.Tensor)
def _split(x, split_size, dim=0):
    d = _dim(x, dim)
    n = x.shape[d]
    sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
    if not sizes:
        sizes = [0]
    return tuple(jnp.split(x, _split_points(sizes), axis=d))


@lower(aten.unbind.int)
def _unbind(x, dim=0):
    d = _dim(x, dim)
    return tuple(jnp.squeeze(p, d) for p in jnp.split(x, x.shape[d], axis=d))


# PyTorch's "to the end" for a slice (``x[1:]`` records end=INT64_MAX).
_SLICE_TO_END = (1 << 63) - 1


def norm_slice(n, start, end, step):
    start = 0 if start is None else start
    # min(INT64_MAX, n) is n, but jax.export cannot prove it of a symbolic n.
    end = n if end is None or (isinstance(end, int) and end >= _SLICE_TO_END) else end
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    start = min(max(start, 0), n)
    end = min(max(end, start), n)
    return start, end, step


@lower(aten.slice.Tensor)
def _slice(x, dim=0, start=None, end=None, step=1):
    d = _dim(x, dim)
    s, e, st = norm_slice(x.shape[d], start, end, step)
    return jax.lax.slice_in_dim(x, s, e, st, axis=d)


@lower(aten.select.int)
def _select(x, dim, index):
    d = _dim(x, dim)
    return jax.lax.index_in_dim(x, index % x.shape[d], axis=d, keepdims=False)


@lower(aten.narrow.default)
def _narrow(x, dim, start, length):
    d = _dim(x, dim)
    start = start % x.shape[d] if start < 0 else start
    return jax.lax.slice_in_dim(x, start, start + length, axis=d)


@lower(aten.flip.default)
def _flip(x, dims):
    return jnp.flip(x, tuple(_dim(x, d) for d in dims)) if dims else x


@lower(aten.roll.default)
def _roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(_dim(x, d) for d in dims))


@lower(aten.repeat.default)
def _repeat(x, repeats):
    lead = len(repeats) - x.ndim
    x = x.reshape((1,) * lead + x.shape)
    return jnp.tile(x, tuple(repeats))


@lower(aten.constant_pad_nd.default)
def _constant_pad_nd(x, pad, value=0):
    # pad lists (before, after) pairs starting from the last dim; negative pads crop.
    cfg = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        cfg[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return jax.lax.pad(x, jnp.asarray(value, x.dtype), cfg)


@lower(aten.diagonal.default)
def _diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, _dim(x, dim1), _dim(x, dim2))


@lower(aten.tril.default)
def _tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lower(aten.triu.default)
def _triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


# ---------------------------------------------------------------------------------
# Gradients of padding (the forward pads are decomposed; their backwards are not)
# ---------------------------------------------------------------------------------


def _replication_pad(x, pad):
    # pad lists (before, after) pairs from the last dim; each output reads the nearest
    # input element, which also covers negative (cropping) pads.
    for i in range(len(pad) // 2):
        axis = x.ndim - 1 - i
        n = x.shape[axis]
        idx = np.clip(np.arange(-pad[2 * i], n + pad[2 * i + 1]), 0, n - 1)
        x = jnp.take(x, jnp.asarray(idx), axis=axis)
    return x


@lower(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)
def _replication_pad_backward(grad, x, padding):
    # Padding is linear in its input: the exact gradient is the VJP of the forward.
    _, vjp = jax.vjp(lambda x_: _replication_pad(x_, list(padding)), x)
    return vjp(grad.astype(x.dtype))[0]


@lower(aten.narrow_copy.default)
def _narrow_copy(x, dim, start, length):
    return _narrow(x, dim, start, length)


@lower(aten.unfold.default)
def _unfold(x, dimension, size, step):
    # Windows x[i*step : i*step + size] along `dimension`, each becoming a new last dim.
    if x.ndim == 0:
        return x.reshape(1)
    d = _dim(x, dimension)
    windows = (x.shape[d] - size) // step + 1
    idx = np.arange(windows)[:, None] * step + np.arange(size)[None, :]
    out = jnp.take(x, jnp.asarray(idx), axis=d)  # axis d -> (windows, size)
    return jnp.moveaxis(out, d + 1, -1)


# ---------------------------------------------------------------------------------
# View-copy variants (what functionalization emits for views in some modes): a JAX
# value is never a view, so each is its view op's rule.
# ---------------------------------------------------------------------------------

lower(aten.view_copy.default, aten._reshape_copy.default)(_view)
lower(aten.view_copy.dtype)(_view_dtype)
lower(aten.permute_copy.default)(_permute)
lower(aten.unbind_copy.int)(_unbind)
lower(aten.select_copy.int)(_select)
lower(aten.slice_copy.Tensor)(_slice)
lower(aten.split_copy.Tensor)(_split)


@lower(aten.detach_copy.default)
def _detach_copy(x):
    return x
