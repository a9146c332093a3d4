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


def _area_scale(n_in, n_out, align_corners, scale, acc):
    """UpSample.h: area_pixel_compute_scale, in the kernel's scalar type."""
    if align_corners:
        return acc.type(n_in - 1) / acc.type(n_out - 1) if n_out > 1 else acc.type(0)
    if scale is not None and scale > 0:
        return acc.type(1.0 / scale)
    return acc.type(n_in) / acc.type(n_out)


def _aa_weights(n_in, n_out, align_corners, scale, acc):
    """Source indices, weights and tap mask, each (n_out, K), of antialiased linear resampling.

    As the CPU kernel (``_compute_weights_aa``): a triangle filter stretched by the
    scale when downsampling (support scale instead of 1), centred on each output pixel
    centre; the taps inside the input are renormalized to sum to one. Float32 inputs
    keep the kernel's float32 scalars, with its double-precision steps in between.
    """
    s = _area_scale(n_in, n_out, align_corners, scale, acc)
    support = acc.type(s) if s >= 1.0 else acc.type(1.0)  # interp_size 2 -> 1 * scale
    width = int(math.ceil(support)) * 2 + 1
    invscale = float(acc.type(1.0 / float(s))) if s >= 1.0 else 1.0
    idx = np.zeros((n_out, width), np.int64)
    wts = np.zeros((n_out, width), acc)
    used = np.zeros((n_out, width), bool)
    for i in range(n_out):
        center = acc.type(float(s) * (i + 0.5))
        lo = max(int(float(center - support) + 0.5), 0)
        size = min(int(float(center + support) + 0.5), n_in) - lo
        size = min(max(size, 0), width)
        w = np.zeros(width, acc)
        for j in range(size):
            t = float(acc.type(j + lo) - center) + 0.5
            w[j] = acc.type(max(0.0, 1.0 - abs(float(acc.type(t * invscale)))))
        total = acc.type(0)
        for j in range(size):
            total = acc.type(total + w[j])
        if total != 0:
            w[:size] = (w[:size] / total).astype(acc)
        idx[i, :size] = lo + np.arange(size)
        idx[i, size:] = lo  # past the window: any valid index, masked out
        used[i, :size] = True
        wts[i] = w
    return np.minimum(idx, n_in - 1), wts, used


def _upsample_aa_check(x, output_size, align_corners, scales_h=None, scales_w=None):
    if x.dtype not in (np.float32, np.float64):
        return (
            f"antialiased interpolation of {np.dtype(x.dtype).name} "
            "(the CPU kernel's float32/float64 paths only)"
        )
    if x.ndim == 4 and output_size[1] == 1 and x.shape[2] != output_size[0]:
        # PyTorch's CPU kernel then fills every output row with the first row of the
        # width-resized image (its vertical pass misreads a width-1 image); left to
        # eager, so the compiled answer stays eager's.
        return "antialiased resize to width 1 and a new height (PyTorch's CPU kernel misreads it)"
    return None


@lower(aten._upsample_bilinear2d_aa.default, check=_upsample_aa_check)
def _upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    """Antialiased bilinear resize (``antialias=True``), separable as the CPU kernel:
    width first, then height; an axis whose size does not change is left as is."""
    acc = np.dtype(x.dtype)
    out = x
    for axis, n_out, scale in ((3, output_size[1], scales_w), (2, output_size[0], scales_h)):
        n_in = x.shape[axis]
        if n_out == n_in:
            continue
        idx, wts, used = _aa_weights(n_in, n_out, align_corners, scale, acc)
        taps = jnp.take(out, jnp.asarray(idx.reshape(-1)), axis=axis)
        shape = list(out.shape)
        shape[axis : axis + 1] = list(idx.shape)
        taps = taps.reshape(shape)
        bshape = [1] * len(shape)
        bshape[axis : axis + 2] = list(wts.shape)
        # Taps past a window are not read (an infinity there must not make NaN).
        terms = jnp.where(
            jnp.asarray(used).reshape(bshape), taps * jnp.asarray(wts).reshape(bshape), 0
        )
        out = jnp.sum(terms, axis=axis + 1)
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------------
# Grid sampling
# ---------------------------------------------------------------------------------

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _rounding(dtype):
    """(compute dtype, rounding): float32 values rounded to ``dtype``'s precision after
    each step, as C++ arithmetic on c10::Half / c10::BFloat16 (scalar or vectorized)
    does; an explicit XLA op, so the compiler keeps no excess precision."""
    if dtype == np.float16:
        return np.dtype(np.float32), lambda v: jax.lax.reduce_precision(v, 5, 10)
    if dtype == jnp.bfloat16:
        return np.dtype(np.float32), lambda v: jax.lax.reduce_precision(v, 8, 7)
    return np.dtype(dtype), lambda v: v


def _reflect(coord, twice_low, twice_high, r):
    """GridSampler.h: reflect_coordinates, every step rounded by ``r``."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    lo = twice_low / 2
    span = (twice_high - twice_low) / 2
    coord = r(jnp.abs(r(coord - lo)))
    extra = r(jnp.fmod(coord, span))
    flips = jnp.floor(r(coord / span))
    return jnp.where(jnp.fmod(flips, 2) == 0, r(extra + lo), r(r(span - extra) + lo))


def _reflect_bounds(size, align_corners):
    return (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)


def _vector_source_coord(coord, size, padding_mode, align_corners, r):
    """GridSamplerKernel.cpp's vectorized ComputeLocation.apply: unnormalize, then clip
    or reflect."""
    coord = _vector_unnormalize(coord, size, align_corners, r)
    return _vector_padded_coord(coord, size, padding_mode, align_corners, r)


def _vector_unnormalize(coord, size, align_corners, r):
    """ComputeLocation.unnormalize, every step rounded by ``r``: (coord + 1) * scale
    (- 0.5 without align_corners), scale = (size - 1) / 2 or size / 2."""
    scale = r(jnp.asarray((size - 1) / 2 if align_corners else size / 2, coord.dtype))
    coord = r(r(coord + 1) * scale)
    if not align_corners:
        coord = r(coord - 0.5)
    return coord


def _vector_padded_coord(coord, size, padding_mode, align_corners, r):
    """ComputeLocation.compute_coordinates: the padding mode's clip or reflection."""
    if padding_mode == _BORDER:
        coord = jnp.clip(coord, 0, size - 1)
    elif padding_mode == _REFLECTION:
        coord = jnp.clip(_reflect(coord, *_reflect_bounds(size, align_corners), r), 0, size - 1)
    return coord


@lower(aten.grid_sampler_2d.default, check=_float_check)
def _grid_sampler_2d(x, grid, interpolation_mode, padding_mode, align_corners):
    """Bilinear or nearest sampling of x at grid[..., (x, y)] (GridSamplerKernel.cpp's
    vectorized kernel): half-precision inputs round after every step as its
    Vectorized<Half/BFloat16> arithmetic does, in its order (weights s*e, s*w, n*e,
    n*w; taps summed nw, ne, sw, se)."""
    n, c, h, w = x.shape
    acc, r = _rounding(x.dtype)
    xa = x.astype(acc)

    def tap(yi, xi):
        """x[n, :, yi, xi] for every output position; zero outside the input."""
        inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
        yc, xc = jnp.clip(yi, 0, h - 1), jnp.clip(xi, 0, w - 1)
        vals = jax.vmap(lambda img, yy, xx: img[:, yy, xx])(xa, yc, xc)  # (n, c, ho, wo)
        return jnp.where(inside[:, None], vals, jnp.zeros((), acc))

    if interpolation_mode == _BICUBIC:
        out = _grid_bicubic(grid.astype(acc), h, w, padding_mode, align_corners, r, tap)
        return out.astype(x.dtype)
    ix = _vector_source_coord(grid[..., 0].astype(acc), w, padding_mode, align_corners, r)
    iy = _vector_source_coord(grid[..., 1].astype(acc), h, padding_mode, align_corners, r)
    if interpolation_mode == _NEAREST:
        # nearbyint: round half to even, like jnp.round.
        out = tap(jnp.round(iy).astype(np.int64), jnp.round(ix).astype(np.int64))
        return out.astype(x.dtype)
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    tw, tn = r(ix - x0), r(iy - y0)  # distances to the west and north neighbours
    te, ts = r(1 - tw), r(1 - tn)
    x0i, y0i = x0.astype(np.int64), y0.astype(np.int64)
    out = r(tap(y0i, x0i) * r(ts * te)[:, None])
    out = r(out + r(tap(y0i, x0i + 1) * r(ts * tw)[:, None]))
    out = r(out + r(tap(y0i + 1, x0i) * r(tn * te)[:, None]))
    out = r(out + r(tap(y0i + 1, x0i + 1) * r(tn * tw)[:, None]))
    return out.astype(x.dtype)


def _cubic_coefficients(t, r):
    """ApplyGridSample<Bicubic>.get_cubic_coefficients (A = -0.75) for the distance t
    past the floor, in the kernel's operation order, every step rounded by ``r``."""
    a = -0.75

    def outer(x):  # ((A x - 5A) x + 8A) x - 4A, for 1 < x < 2
        return r(r(r(r(r(r(a * x) - 5 * a) * x) + 8 * a) * x) - 4 * a)

    def inner(x):  # ((A + 2) x - (A + 3)) x x + 1, for x <= 1
        return r(r(r(r(r((a + 2) * x) - (a + 3)) * x) * x) + 1)

    return outer(r(t + 1)), inner(t), inner(r(1 - t)), outer(r(2 - t))


def _grid_bicubic(grid, h, w, padding_mode, align_corners, r, tap):
    """GridSamplerKernel.cpp's bicubic convolution: 4 taps along x for each of 4 rows,
    then 4 along y, each tap's coordinate clipped or reflected by the padding mode (zero
    outside the input with zeros padding), summed left to right as the kernel does."""
    x = _vector_unnormalize(grid[..., 0], w, align_corners, r)
    y = _vector_unnormalize(grid[..., 1], h, align_corners, r)
    x0, y0 = jnp.floor(x), jnp.floor(y)
    cx = _cubic_coefficients(r(x - x0), r)
    cy = _cubic_coefficients(r(y - y0), r)

    def index(coord, size):
        coord = _vector_padded_coord(coord, size, padding_mode, align_corners, r)
        # A non-finite or huge coordinate is outside (the kernel's int conversion gives
        # INT_MIN there); finite ones truncate toward zero, as it converts.
        ok = jnp.isfinite(coord) & (jnp.abs(coord) < 2.0**31)
        return jnp.where(ok, coord, -1).astype(np.int64)

    def weighted_sum(coeffs, values):
        total = r(coeffs[0][:, None] * values[0])
        for c, v in zip(coeffs[1:], values[1:], strict=True):
            total = r(total + r(c[:, None] * v))
        return total

    cols = [index(x0 + d, w) for d in (-1, 0, 1, 2)]
    rows = []
    for d in (-1, 0, 1, 2):
        yi = index(y0 + d, h)
        rows.append(weighted_sum(cx, [tap(yi, xi) for xi in cols]))
    return weighted_sum(cy, rows)


def _grid_sampler_3d_check(x, grid, interpolation_mode, padding_mode, align_corners):
    if interpolation_mode not in (_BILINEAR, _NEAREST):
        return "grid_sampler_3d with bicubic interpolation (eager raises)"
    return _float_check(x)


def _scalar_source_coord(coord, size, padding_mode, align_corners, r):
    """GridSampler.h's scalar compute_coordinates, every step rounded by ``r``: unnormalize,
    clip or reflect (a NaN clips to size - 1, as std::min/max order it), then
    safe_downgrade_to_int_range (non-finite or huge -> -100, outside)."""
    if align_corners:
        coord = r(r(r(coord + 1) / 2) * (size - 1))
    else:
        coord = r(r(r(r(coord + 1) * size) - 1) / 2)

    def clip(v):
        return jnp.where(jnp.isnan(v), size - 1, jnp.clip(v, 0, size - 1)).astype(v.dtype)

    if padding_mode == _BORDER:
        coord = clip(coord)
    elif padding_mode == _REFLECTION:
        coord = clip(_reflect(coord, *_reflect_bounds(size, align_corners), r))
    ok = jnp.isfinite(coord) & (jnp.abs(coord) < 2.0**31 - 1)
    return jnp.where(ok, coord, jnp.asarray(-100, coord.dtype))


@lower(aten.grid_sampler_3d.default, check=_grid_sampler_3d_check)
def _grid_sampler_3d(x, grid, interpolation_mode, padding_mode, align_corners):
    """Volumetric grid sampling (GridSampler.cpp's 3-D kernel): grid[..., (x, y, z)]
    address (W, H, D); trilinear weights over the 8 neighbours, or the nearest voxel
    (round half to even); zeros outside the input unless padding clamps or reflects.

    The kernel is scalar code in the input's own type: half-precision inputs round
    after every operation, so here every step is rounded to the input's precision
    too, in the kernel's order (weights as x * y * z products, taps summed tnw, tne,
    ..., bse).
    """
    n, c, d, h, w = x.shape
    acc, r = _rounding(x.dtype)
    xa = x.astype(acc)
    ix, iy, iz = (
        _scalar_source_coord(grid[..., k].astype(acc), size, padding_mode, align_corners, r)
        for k, size in enumerate((w, h, d))
    )

    def tap(zi, yi, xi):
        """x[n, :, zi, yi, xi] for every output position, and whether it is inside."""
        inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h) & (zi >= 0) & (zi < d)
        zc, yc, xc = jnp.clip(zi, 0, d - 1), jnp.clip(yi, 0, h - 1), jnp.clip(xi, 0, w - 1)
        vals = jax.vmap(lambda img, zz, yy, xx: img[:, zz, yy, xx])(xa, zc, yc, xc)
        return vals, inside[:, None]

    if interpolation_mode == _NEAREST:
        vals, inside = tap(*(jnp.round(v).astype(np.int64) for v in (iz, iy, ix)))
        return jnp.where(inside, vals, 0).astype(x.dtype)
    x0, y0, z0 = jnp.floor(ix), jnp.floor(iy), jnp.floor(iz)
    wx = (r(x0 + 1 - ix), r(ix - x0))
    wy = (r(y0 + 1 - iy), r(iy - y0))
    wz = (r(z0 + 1 - iz), r(iz - z0))
    xi = (x0.astype(np.int64), x0.astype(np.int64) + 1)
    yi = (y0.astype(np.int64), y0.astype(np.int64) + 1)
    zi = (z0.astype(np.int64), z0.astype(np.int64) + 1)
    out = jnp.zeros((n, c, *grid.shape[1:4]), acc)
    for a in (0, 1):
        for b in (0, 1):
            for e in (0, 1):
                weight = r(r(wx[e] * wy[b]) * wz[a])[:, None]
                vals, inside = tap(zi[a], yi[b], xi[e])
                # Taps outside add nothing (the kernel skips them: no inf * 0).
                out = jnp.where(inside, r(out + r(vals * weight)), out)
    return out.astype(x.dtype)
