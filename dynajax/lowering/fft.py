"""Discrete Fourier transforms: the three primitives every ``torch.fft`` call reaches.

``normalization`` is ATen's ``fft_norm_mode``: 0 leaves the transform unscaled, 1
scales by 1/sqrt(n), 2 by 1/n, where n is the product of the signal sizes along
``dim``. The JAX calls below are unnormalized in both directions, and the scale is
applied once at the end.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.registry import lower

aten = torch.ops.aten

_FFT_DTYPES = {
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.complex64),
    np.dtype(np.complex128),
}


def _fft_check(x, dim, *args, **kwargs):
    if np.dtype(x.dtype) not in _FFT_DTYPES:
        return f"FFT of {np.dtype(x.dtype).name} (PyTorch's CPU FFT takes float32/64 and complex)"
    if x.size == 0:
        return "FFT of an empty tensor (PyTorch's CPU FFT raises)"
    return None


def _scale(out, n, normalization):
    if normalization == 0 or n == 0:
        return out
    factor = 1 / math.sqrt(n) if normalization == 1 else 1 / n
    return out * jnp.asarray(factor, out.real.dtype)


def _axes(x, dim):
    return tuple(d % x.ndim for d in dim)


@lower(aten._fft_r2c.default, check=_fft_check)
def _fft_r2c(x, dim, normalization, onesided):
    ax = _axes(x, dim)
    n = math.prod(x.shape[a] for a in ax)
    if onesided:
        out = jnp.fft.rfftn(x, axes=ax)
    else:
        cdt = jnp.result_type(x.dtype, np.complex64)
        out = jnp.fft.fftn(x.astype(cdt), axes=ax)
    return _scale(out, n, normalization)


@lower(aten._fft_c2c.default, check=_fft_check)
def _fft_c2c(x, dim, normalization, forward):
    ax = _axes(x, dim)
    if not ax:
        return x
    n = math.prod(x.shape[a] for a in ax)
    if forward:
        out = jnp.fft.fftn(x, axes=ax)
    else:
        out = jnp.fft.ifftn(x, axes=ax, norm="forward")  # "forward" leaves the inverse unscaled
    return _scale(out, n, normalization)


@lower(aten._fft_c2r.default, check=_fft_check)
def _fft_c2r(x, dim, normalization, last_dim_size):
    ax = _axes(x, dim)
    sizes = [x.shape[a] for a in ax[:-1]] + [last_dim_size]
    out = jnp.fft.irfftn(x, s=sizes, axes=ax, norm="forward")
    return _scale(out, math.prod(sizes), normalization)
