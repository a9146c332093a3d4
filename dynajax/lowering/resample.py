"""Resampling: nearest and (bi)linear upsampling, and grid sampling.

Only the ``.vec`` overloads have rules: the others are in PyTorch's core decomposition
table. Under torch.compile even the ``.vec`` ones are decomposed while Dynamo traces
(they are CompositeImplicitAutograd); their rules serve graphs that keep them.

Upsampling reads input pixels at positions that depend only on shapes and scale
factors, so the source indices and weights are computed at trace time with NumPy, in
the same precision and with the same formulas as PyTorch's CPU kernels
(``UpSample.h``); only the gathers and the weighted sums run in XLA.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.dtypes import is_floating
from dynajax.lowering.registry import lower

aten = torch.ops.aten

# ---------------------------------------------------------------------------------
# Upsampling
# ---------------------------------------------------------------------------------


def _output_size(x, nd, output_size, scale_factors):
    if output_size is not None:
        return list(output_size)
    return [math.floor(x.shape[x.ndim - nd + i] * scale_factors[i]) for i in range(nd)]


def _scales(nd, scale_factors):
    return list(scale_factors) if scale_factors is not None else [None] * nd


def _nearest_indices(n_in, n_out, scale):
    # UpSample.h: nearest_idx, with the scale in float32 as in the CPU kernel.
    if n_out == n_in:
        return np.arange(n_out)
    if n_out == 2 * n_in:
        return np.arange(n_out) >> 1
    s = (
        np.float32(1.0 / scale)
        if scale is not None and scale > 0
        else np.float32(n_in) / np.float32(n_out)
    )
    src = np.floor(np.arange(n_out, dtype=np.float32) * s).astype(np.int64)
    return np.minimum(src, n_in - 1)


def _upsample_nearest(x, output_size, scales):
    nd = len(output_size)
    out = x
    for i in range(nd):
        axis = x.ndim - nd + i
        idx = _nearest_indices(x.shape[axis], output_size[i], scales[i])
        out = jnp.take(out, jnp.asarray(idx), axis=axis)
    return out


def _opmath(dtype):
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _linear_indices(n_in, n_out, align_corners, scale, acc):
    """Source indices (i0, i1) and weights (w0, w1) of linear interpolation along one axis."""
    if align_corners:
        s = acc.type(n_in - 1) / acc.type(n_out - 1) if n_out > 1 else acc.type(0)
    elif scale is not None and scale > 0:
        s = acc.type(1.0 / scale)
    else:
        s = acc.type(n_in) / acc.type(n_out)
    dst = np.arange(n_out, dtype=acc)
    real = (
        s * dst
        if align_corners
        else np.maximum(s * (dst + acc.type(0.5)) - acc.type(0.5), acc.type(0))
    )
    i0 = np.minimum(np.floor(real).astype(np.int64), n_in - 1)
    i1 = i0 + (i0 < n_in - 1)
    w1 = np.clip(real - i0.astype(acc), 0, 1).astype(acc)
    return i0, i1, (acc.type(1) - w1), w1


def _upsample_linear(x, output_size, align_corners, scales):
    nd = len(output_size)
    acc = _opmath(x.dtype)
    out = x.astype(acc)
    for i in range(nd):
        axis = x.ndim - nd + i
        i0, i1, w0, w1 = _linear_indices(
            x.shape[axis], output_size[i], align_corners, scales[i], acc
        )
        bshape = [1] * x.ndim
        bshape[axis] = -1
        a = jnp.take(out, jnp.asarray(i0), axis=axis)
        b = jnp.take(out, jnp.asarray(i1), axis=axis)
        out = a * jnp.asarray(w0).reshape(bshape) + b * jnp.asarray(w1).reshape(bshape)
    return out.astype(x.dtype)


def _float_check(x, *args, **kwargs):
    if not is_floating(x.dtype):
        return f"interpolation of {np.dtype(x.dtype).name} (PyTorch takes floating point only)"
    return None


@lower(aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec)
def _upsample_nearest_vec(x, output_size, scale_factors):
    nd = len(output_size) if output_size is not None else len(scale_factors)
    return _upsample_nearest(
        x, _output_size(x, nd, output_size, scale_factors), _scales(nd, scale_factors)
    )


@lower(
    aten.upsample_linear1d.vec,
    aten.upsample_bilinear2d.vec,
    aten.upsample_trilinear3d.vec,
    check=_float_check,
)
def _upsample_linear_vec(x, output_size, align_corners, scale_factors):
    nd = len(output_size) if output_size is not None else len(scale_factors)
    return _upsample_linear(
        x,
        _output_size(x, nd, output_size, scale_factors),
        align_corners,
        _scales(nd, scale_factors),
    )


# ---------------------------------------------------------------------------------
# Grid sampling
# ---------------------------------------------------------------------------------

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _grid_sampler_check(x, grid, interpolation_mode, padding_mode, align_corners):
    if interpolation_mode not in (_BILINEAR, _NEAREST):
        return "grid_sampler with bicubic interpolation"
    return _float_check(x)


def _reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    lo = twice_low / 2
    span = (twice_high - twice_low) / 2
    coord = jnp.abs(coord - lo)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _source_coord(coord, size, padding_mode, align_corners):
    """GridSampler.h: grid_sampler_compute_source_index."""
    if align_corners:
        coord = (coord + 1) / 2 * (size - 1)
    else:
        coord = ((coord + 1) * size - 1) / 2
    if padding_mode == _BORDER:
        coord = jnp.clip(coord, 0, size - 1)
    elif padding_mode == _REFLECTION:
        coord = (
            _reflect(coord, 0, 2 * (size - 1))
            if align_corners
            else _reflect(coord, -1, 2 * size - 1)
        )
        coord = jnp.clip(coord, 0, size - 1)
    return coord


@lower(aten.grid_sampler_2d.default, check=_grid_sampler_check)
def _grid_sampler_2d(x, grid, interpolation_mode, padding_mode, align_corners):
    n, c, h, w = x.shape
    acc = _opmath(x.dtype)
    ix = _source_coord(grid[..., 0].astype(acc), w, padding_mode, align_corners)
    iy = _source_coord(grid[..., 1].astype(acc), h, padding_mode, align_corners)

    def tap(yi, xi):
        """x[n, :, yi, xi] for every output position; zero outside the input."""
        inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
        yc, xc = jnp.clip(yi, 0, h - 1), jnp.clip(xi, 0, w - 1)
        vals = jax.vmap(lambda img, yy, xx: img[:, yy, xx])(x.astype(acc), yc, xc)  # (n, c, ho, wo)
        return vals * inside[:, None].astype(acc)

    if interpolation_mode == _NEAREST:
        # nearbyint: round half to even, like jnp.round.
        out = tap(jnp.round(iy).astype(np.int64), jnp.round(ix).astype(np.int64))
        return out.astype(x.dtype)
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    x1, y1 = x0 + 1, y0 + 1
    wx1, wy1 = ix - x0, iy - y0
    wx0, wy0 = x1 - ix, y1 - iy
    x0i, x1i, y0i, y1i = (v.astype(np.int64) for v in (x0, x1, y0, y1))
    out = (
        tap(y0i, x0i) * (wy0 * wx0)[:, None]
        + tap(y0i, x1i) * (wy0 * wx1)[:, None]
        + tap(y1i, x0i) * (wy1 * wx0)[:, None]
        + tap(y1i, x1i) * (wy1 * wx1)[:, None]
    )
    return out.astype(x.dtype)
