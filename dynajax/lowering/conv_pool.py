"""Convolution and pooling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering import conv_algorithms
from dynajax.lowering.dtypes import is_floating, is_integral, opmath
from dynajax.lowering.registry import lower

aten = torch.ops.aten

# ---------------------------------------------------------------------------------
# Convolution
# ---------------------------------------------------------------------------------

# Half-precision dtypes whose eager CPU convolutions go to oneDNN on this machine: it
# takes bfloat16 where the CPU has bfloat16 instructions (AVX512-BF16, AMX) and float16
# where it has float16 ones (AVX512-FP16, AMX-FP16). oneDNN's transposed convolution
# adds the bias before rounding; PyTorch's own (col2im, then add) rounds the sum first.
# A property of the host, read once, like the kernels eager itself picks at startup.
_ONEDNN_HALF = frozenset(
    jnp.dtype(dtype)
    for dtype, supported in (
        (jnp.bfloat16, torch.ops.mkldnn._is_mkldnn_bf16_supported),
        (jnp.float16, torch.ops.mkldnn._is_mkldnn_fp16_supported),
    )
    if torch.backends.mkldnn.is_available() and supported()
)


def _transposed_rounds_before_bias(dtype, stride, output_padding) -> bool:
    """Whether eager's transposed convolution of ``dtype`` rounds the sum before adding
    the bias: not under oneDNN, which PyTorch skips when an output padding is not
    smaller than its stride."""
    onednn = jnp.dtype(dtype) in _ONEDNN_HALF and torch.backends.mkldnn.enabled
    return not onednn or any(p >= s for p, s in zip(output_padding, stride, strict=True))


def _conv_check(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if is_integral(x.dtype):
        return "integer convolution (PyTorch has no CPU kernel for it)"
    if x.shape[0 if x.ndim == weight.ndim - 1 else 1] == 0:
        # conv1d of (3, 0, 2) by a (2, 0, 1) weight is (3, 0, 2) in eager, not (3, 2, 2).
        return "convolution over zero input channels (PyTorch's result has no channels)"
    return None


def _per_dim(nd, *values):
    """Each size argument as one entry per spatial dimension (ATen may pass one for all)."""
    return [list(v) * nd if len(v) == 1 else list(v) for v in values]


@lower(aten.convolution.default, check=_conv_check)
def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = weight.ndim - 2
    unbatched = x.ndim == nd + 1
    if unbatched:
        x = x[None]
    stride, padding, dilation, output_padding = _per_dim(
        nd, stride, padding, dilation, output_padding
    )
    # Half-precision inputs accumulate in float32, as PyTorch's CPU kernels do. Its
    # convolutions round once, bias included (oneDNN, or a GEMM into the bias); its
    # transposed convolutions round the sum before adding the bias (col2im, then add)
    # unless oneDNN runs them (_ONEDNN_HALF).
    acc = opmath(x.dtype)
    if not transposed:
        out = conv_algorithms.convolution(x, weight, stride, padding, dilation, groups, acc)
    else:
        out = conv_algorithms.transposed(
            x, weight, stride, padding, dilation, output_padding, groups, acc
        )
        if _transposed_rounds_before_bias(x.dtype, stride, output_padding):
            out = out.astype(x.dtype)
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * nd).astype(out.dtype)
    out = out.astype(x.dtype)
    return out[0] if unbatched else out


# ---------------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------------


def _pool_params(nd, kernel_size, stride, padding, dilation=None):
    def expand(v, default):
        if v is None or len(v) == 0:
            v = default
        return list(v) * nd if len(v) == 1 else list(v)

    kernel = expand(kernel_size, None)
    return kernel, expand(stride, kernel), expand(padding, [0]), expand(dilation, [1])


def _pool_out_size(n, k, s, p, d, ceil_mode):
    eff = d * (k - 1) + 1
    num = n + 2 * p - eff
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def _window_pads(x, nd, kernel, stride, padding, dilation, ceil_mode):
    # Without ceil_mode, the explicit padding on both sides gives PyTorch's output size
    # (floor division: a window that would end past the padding is not formed) with no
    # arithmetic on the input size, so symbolic sizes (dynajax.export) pass.
    if not ceil_mode:
        return [(p, p) for p in padding]
    pads = []
    for i in range(nd):
        n = x.shape[x.ndim - nd + i]
        out = _pool_out_size(n, kernel[i], stride[i], padding[i], dilation[i], ceil_mode)
        needed = (out - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1
        pads.append((padding[i], max(needed - n - padding[i], 0)))
    return pads


def _max_pool_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode, nd):
    kernel, stride, padding, dilation = _pool_params(nd, kernel_size, stride, padding, dilation)
    lead = x.ndim - nd
    pads = _window_pads(x, nd, kernel, stride, padding, dilation, ceil_mode)
    lowest = -jnp.inf if is_floating(x.dtype) else jnp.iinfo(x.dtype).min
    spatial = x.shape[lead:]
    # Flat spatial index of each input element, pooled alongside the values; ties keep
    # the first index and NaN wins, as in PyTorch.
    idx = jnp.arange(math.prod(spatial), dtype=np.int64).reshape(spatial)  # sizes may be symbolic
    idx = jnp.broadcast_to(idx, x.shape)
    window = (1,) * lead + tuple(kernel)
    strides = (1,) * lead + tuple(stride)
    dil = (1,) * lead + tuple(dilation)
    full_pads = [(0, 0)] * lead + pads

    def select(a, b):
        av, ai = a
        bv, bi = b
        take_b = (bv > av) | (jnp.isnan(bv) & ~jnp.isnan(av)) | ((bv == av) & (bi < ai))
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    # The values come from a plain max window (NaN propagates through XLA's max), the
    # indices from the variadic one: an inference graph drops the indices, and XLA then
    # drops their (twice as costly) reduction. JAX cannot differentiate a variadic
    # window reduction, and the integer indices have no gradient: it reads x through
    # stop_gradient, so that jax.grad of a jax_function differentiates the values only.
    vals = jax.lax.reduce_window(
        x,
        np.asarray(lowest, x.dtype),  # concrete: the differentiable max window
        jax.lax.max,
        window,
        strides,
        full_pads,
        window_dilation=dil,
    )
    _, inds = jax.lax.reduce_window(
        (jax.lax.stop_gradient(x), idx),
        (jnp.asarray(lowest, x.dtype), jnp.asarray(-1, np.int64)),
        select,
        window,
        strides,
        full_pads,
        window_dilation=dil,
    )
    return vals, inds


@lower(aten.max_pool2d_with_indices.default)
def _max_pool2d_with_indices(
    x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False
):
    return _max_pool_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode, 2)


@lower(aten.max_pool3d_with_indices.default)
def _max_pool3d_with_indices(
    x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False
):
    return _max_pool_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode, 3)


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd):
    kernel, stride, padding, _ = _pool_params(nd, kernel_size, stride, padding)
    lead = x.ndim - nd
    pads = _window_pads(x, nd, kernel, stride, padding, [1] * nd, ceil_mode)
    window = (1,) * lead + tuple(kernel)
    strides = (1,) * lead + tuple(stride)
    full_pads = [(0, 0)] * lead + pads
    acc = x.astype(np.float32) if x.dtype in (np.float16, jnp.bfloat16) else x
    # A concrete (NumPy) zero lets JAX pick its differentiable windowed-sum primitive,
    # which the backward rules below take the VJP of.
    zero = np.zeros((), acc.dtype)
    sums = jax.lax.reduce_window(acc, zero, jax.lax.add, window, strides, full_pads)
    if divisor_override:
        return (sums / divisor_override).astype(x.dtype)
    # Divisor per window: elements inside the input (+ explicit padding when
    # count_include_pad), never the extra ceil_mode padding.
    ones = jnp.ones(x.shape[lead:], acc.dtype)
    if count_include_pad:
        ones = jnp.pad(ones, [(p, p) for p in padding], constant_values=1)
        extra = [(0, max(hi - p, 0)) for (lo, hi), p in zip(pads, padding, strict=True)]
        counts = jax.lax.reduce_window(
            ones, jnp.zeros((), acc.dtype), jax.lax.add, tuple(kernel), tuple(stride), extra
        )
    else:
        counts = jax.lax.reduce_window(
            ones, jnp.zeros((), acc.dtype), jax.lax.add, tuple(kernel), tuple(stride), pads
        )
    return (sums / counts).astype(x.dtype)


@lower(aten.avg_pool2d.default)
def _avg_pool2d(
    x,
    kernel_size,
    stride=(),
    padding=(0,),
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    return _avg_pool(
        x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2
    )


@lower(aten.avg_pool3d.default)
def _avg_pool3d(
    x,
    kernel_size,
    stride=(),
    padding=(0,),
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    return _avg_pool(
        x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3
    )


def _adaptive_avg_pool(x, output_size, nd):
    lead = x.ndim - nd
    out = x
    for i in range(nd):
        axis = lead + i
        n, m = x.shape[axis], output_size[i]
        if n % m == 0:
            shape = out.shape[:axis] + (m, n // m) + out.shape[axis + 1 :]
            out = jnp.mean(out.reshape(shape), axis=axis + 1)
        else:
            starts = [(j * n) // m for j in range(m)]
            ends = [-(-((j + 1) * n) // m) for j in range(m)]
            parts = [
                jnp.mean(jax.lax.slice_in_dim(out, s, e, axis=axis), axis=axis, keepdims=True)
                for s, e in zip(starts, ends, strict=True)
            ]
            out = jnp.concatenate(parts, axis=axis)
    return out.astype(x.dtype)


@lower(aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(x, output_size):
    return _adaptive_avg_pool(x, output_size, 2)


@lower(aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool3d(x, output_size):
    return _adaptive_avg_pool(x, output_size, 3)


# ---------------------------------------------------------------------------------
# Gradients (the backward graphs of training)
# ---------------------------------------------------------------------------------


def _conv_backward_check(
    grad,
    x,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
):
    return _conv_check(
        x, weight, None, stride, padding, dilation, transposed, output_padding, groups
    )


@lower(aten.convolution_backward.default, check=_conv_backward_check)
def _convolution_backward(
    grad,
    x,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
):
    # The forward rule is linear in input and weight, so its VJP is the exact gradient.
    def forward(x_, w_):
        return _convolution(
            x_, w_, None, stride, padding, dilation, transposed, output_padding, groups
        )

    _, vjp = jax.vjp(forward, x, weight)
    grad_input, grad_weight = vjp(grad.astype(x.dtype))
    if output_mask[0] and not transposed:
        direct = _input_gradient(grad, x, weight, stride, padding, dilation, groups)
        if direct is not None:  # XLA drops the VJP's unused input gradient
            grad_input = direct
    grad_bias = None
    if output_mask[2]:
        channel = grad.ndim - weight.ndim + 1
        grad_bias = jnp.sum(grad, axis=tuple(i for i in range(grad.ndim) if i != channel))
    return (
        grad_input if output_mask[0] else None,
        grad_weight if output_mask[1] else None,
        grad_bias,
    )


def _input_gradient(grad, x, weight, stride, padding, dilation, groups):
    nd = weight.ndim - 2
    stride, padding, dilation = _per_dim(nd, stride, padding, dilation)
    unbatched = x.ndim == nd + 1
    g, shape = (grad[None], (1,) + x.shape) if unbatched else (grad, x.shape)
    out = conv_algorithms.input_gradient(
        g.astype(x.dtype), weight, shape, stride, padding, dilation, groups, opmath(x.dtype)
    )
    if out is None:
        return None
    out = out.astype(x.dtype)
    return out[0] if unbatched else out


def _max_pool_backward(grad, x, indices, nd):
    # Each output cell sends its gradient to the flat spatial position it took its max
    # from; overlapping windows add up.
    lead = x.shape[: x.ndim - nd]
    rows = int(np.prod(lead, dtype=np.int64))
    spatial = int(np.prod(x.shape[x.ndim - nd :], dtype=np.int64))
    cells = int(np.prod(grad.shape[grad.ndim - nd :], dtype=np.int64))
    g = grad.reshape(rows, cells)  # explicit sizes: an empty batch reshapes too
    idx = indices.reshape(rows, cells)
    out = jnp.zeros((rows, spatial), grad.dtype).at[jnp.arange(rows)[:, None], idx].add(g)
    return out.reshape(x.shape)


@lower(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_with_indices_backward(
    grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices
):
    return _max_pool_backward(grad, x, indices, 2)


@lower(aten.max_pool3d_with_indices_backward.default)
def _max_pool3d_with_indices_backward(
    grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices
):
    return _max_pool_backward(grad, x, indices, 3)


def _linear_vjp(forward, x, grad):
    """Gradient of a function linear in x (average pooling), by its exact VJP."""
    _, vjp = jax.vjp(forward, x)
    return vjp(grad.astype(x.dtype))[0]


@lower(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(
    grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    def forward(x_):
        return _avg_pool(
            x_, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2
        )

    return _linear_vjp(forward, x, grad)


@lower(aten.avg_pool3d_backward.default)
def _avg_pool3d_backward(
    grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    def forward(x_):
        return _avg_pool(
            x_, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3
        )

    return _linear_vjp(forward, x, grad)


@lower(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(grad, x):
    return _linear_vjp(lambda x_: _adaptive_avg_pool(x_, grad.shape[-2:], 2), x, grad)


@lower(aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool3d_backward(grad, x):
    return _linear_vjp(lambda x_: _adaptive_avg_pool(x_, grad.shape[-3:], 3), x, grad)


# ---------------------------------------------------------------------------------
# Adaptive max pooling
# ---------------------------------------------------------------------------------


def _adaptive_windows(spatial, output_size):
    """Flat input indices of every adaptive window, (*output_size, K), and their mask.

    Window i of an axis spans [floor(i*n/m), ceil((i+1)*n/m)); windows of one axis differ
    in length, so each is padded to the longest and the padding masked out.
    """
    per_axis = []
    for n, m in zip(spatial, output_size, strict=True):
        starts = np.array([(i * n) // m for i in range(m)], dtype=np.int64)
        ends = np.array([-(-((i + 1) * n) // m) for i in range(m)], dtype=np.int64)
        idx = starts[:, None] + np.arange(int((ends - starts).max(initial=1)))[None, :]
        per_axis.append((np.minimum(idx, n - 1), idx < ends[:, None]))
    nd = len(spatial)
    flat = np.arange(int(np.prod(spatial)), dtype=np.int64).reshape(spatial)
    valid = np.ones([d for idx, _ in per_axis for d in idx.shape], bool)
    for a, (idx, ok) in enumerate(per_axis):
        flat = np.take(flat, idx, axis=2 * a)  # axis a -> (m_a, k_a)
        shape = [1] * (2 * nd)
        shape[2 * a : 2 * a + 2] = ok.shape
        valid &= ok.reshape(shape)
    order = [2 * a for a in range(nd)] + [2 * a + 1 for a in range(nd)]
    flat = flat.transpose(order).reshape(*output_size, -1)
    return flat, valid.transpose(order).reshape(*output_size, -1)


def _adaptive_max_pool(x, output_size, nd):
    lead = x.shape[: x.ndim - nd]
    spatial = x.shape[x.ndim - nd :]
    win, ok = _adaptive_windows(spatial, list(output_size))
    vals = jnp.take(x.reshape(*lead, -1), jnp.asarray(win.reshape(-1)), axis=-1)
    vals = vals.reshape(*lead, *win.shape)
    ok = jnp.asarray(ok)
    lowest = -jnp.inf if is_floating(x.dtype) else jnp.iinfo(x.dtype).min
    peak = jnp.max(jnp.where(ok, vals, jnp.asarray(lowest, x.dtype)), axis=-1, keepdims=True)
    pos = jnp.argmax(ok & (vals == peak), axis=-1)  # the first maximum, as in PyTorch
    if is_floating(x.dtype):
        # The CPU kernel takes every NaN it meets ("val > max || isnan(val)"): the last.
        nan = ok & jnp.isnan(vals)
        last_nan = nan.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
        pos = jnp.where(jnp.any(nan, axis=-1), last_nan, pos)
    values = jnp.take_along_axis(vals, pos[..., None], axis=-1)[..., 0]
    win = jnp.broadcast_to(jnp.asarray(win), vals.shape)
    indices = jnp.take_along_axis(win, pos[..., None], axis=-1)
    return values, indices[..., 0]


def _adaptive_max_pool_check(x, output_size):
    if not is_floating(x.dtype):
        return f"adaptive max pooling of {np.dtype(x.dtype).name} (PyTorch's CPU kernel raises)"
    return None


@lower(aten.adaptive_max_pool2d.default, check=_adaptive_max_pool_check)
def _adaptive_max_pool2d(x, output_size):
    return _adaptive_max_pool(x, output_size, 2)


@lower(aten.adaptive_max_pool3d.default, check=_adaptive_max_pool_check)
def _adaptive_max_pool3d(x, output_size):
    return _adaptive_max_pool(x, output_size, 3)


@lower(aten.adaptive_max_pool2d_backward.default)
def _adaptive_max_pool2d_backward(grad, x, indices):
    return _max_pool_backward(grad, x, indices, 2)


@lower(aten.adaptive_max_pool3d_backward.default)
def _adaptive_max_pool3d_backward(grad, x, indices):
    return _max_pool_backward(grad, x, indices, 3)


@lower(aten.conv_tbc.default, check=lambda x, w, b, pad=0: _conv_check(x, w, b, *[None] * 6))
def _conv_tbc(x, weight, bias, pad=0):
    # (time, batch, channels) layout: a 1-D convolution with a (K, Cin, Cout) kernel.
    out = _convolution(
        jnp.transpose(x, (1, 2, 0)),
        jnp.transpose(weight, (2, 1, 0)),
        bias,
        [1],
        [pad],
        [1],
        False,
        [0],
        1,
    )
    return jnp.transpose(out, (2, 0, 1))


# ---------------------------------------------------------------------------------
# Fractional max pooling
# ---------------------------------------------------------------------------------


def _fractional_check(nd):
    def check(x, kernel_size, output_size, random_samples):
        if not is_floating(x.dtype):
            return f"fractional max pooling of {np.dtype(x.dtype).name} (no CPU kernel)"
        if x.ndim not in (nd + 1, nd + 2):
            return f"fractional_max_pool{nd}d of a {x.ndim}-D input (eager raises)"
        spatial = x.shape[x.ndim - nd :]
        # The 3-D kernel demands a strictly smaller span than the input, the 2-D one not.
        limit = [n - 1 if nd == 3 else n for n in spatial]
        for n, m, k in zip(limit, output_size, kernel_size, strict=True):
            if m + k - 1 > n or m < 1 or k < 1:
                return "fractional max pooling window too large for the input (eager raises)"
        return None

    return check


def _fractional_starts(sample, n, m, k):
    """Window starts along one axis, (N, C, m), as PyTorch's generate_intervals:
    floor((i + u) * alpha) - floor(u * alpha) with alpha = (n - k) / (m - 1), and the
    last window flush with the end of the input. Computed in the sample's dtype, as the
    kernel does (its scalar_t)."""
    dtype = sample.dtype
    last = jnp.full((*sample.shape, 1), n - k, np.int64)
    if m == 1:
        return last
    alpha = jnp.asarray(np.float64(n - k) / np.float64(m - 1), dtype)
    i = jnp.arange(m - 1, dtype=dtype)
    u = sample[..., None]
    first = ((i + u) * alpha).astype(np.int64) - (u * alpha).astype(np.int64)
    return jnp.concatenate([first, last], axis=-1)


def _fractional_max_pool(x, kernel_size, output_size, random_samples, nd):
    """(values, flat spatial indices) of max pooling over pseudo-random windows.

    ``random_samples`` (N, C, nd) in [0, 1) places the windows of each plane (the
    functional form draws it with torch.rand; here it is an input). Sample j drives
    axis nd-1-j for 2-D (width first) and axis j for 3-D (time first), as the CPU
    kernels read them. Within a window the first maximum wins, and any NaN wins (the
    last one), as the kernels compare ``val > max || isnan(val)``.
    """
    unbatched = x.ndim == nd + 1
    if unbatched:
        x = x[None]
    n, c = x.shape[:2]
    spatial = x.shape[2:]
    samples = random_samples.astype(x.dtype)
    order = [nd - 1 - a for a in range(nd)] if nd == 2 else list(range(nd))
    flat = jnp.zeros((n, c) + (1,) * (2 * nd), np.int64)
    stride = 1
    for a in reversed(range(nd)):
        starts = _fractional_starts(
            samples[:, :, order[a]], spatial[a], output_size[a], kernel_size[a]
        )
        pos = starts[..., None] + jnp.arange(kernel_size[a])  # (N, C, m_a, k_a)
        shape = [n, c] + [1] * (2 * nd)
        shape[2 + a] = output_size[a]
        shape[2 + nd + a] = kernel_size[a]
        flat = flat + (pos * stride).reshape(shape)
        stride *= spatial[a]
    window = int(np.prod(kernel_size))
    flat = jnp.broadcast_to(flat, (n, c, *output_size, *kernel_size)).reshape(
        n, c, *output_size, window
    )
    # Explicit sizes (no -1): an empty batch must reshape too.
    vals = jnp.take_along_axis(
        x.reshape(n, c, int(np.prod(spatial))),
        flat.reshape(n, c, int(np.prod(output_size)) * window),
        axis=-1,
    ).reshape(flat.shape)
    peak = jnp.max(vals, axis=-1, keepdims=True)
    pos = jnp.argmax(vals == peak, axis=-1)
    nan = jnp.isnan(vals)
    last_nan = window - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
    pos = jnp.where(jnp.any(nan, axis=-1), last_nan, pos)
    values = jnp.take_along_axis(vals, pos[..., None], axis=-1)[..., 0]
    indices = jnp.take_along_axis(flat, pos[..., None], axis=-1)[..., 0]
    if unbatched:
        values, indices = values[0], indices[0]
    return values, indices


@lower(aten.fractional_max_pool2d.default, check=_fractional_check(2))
def _fractional_max_pool2d(x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(x, kernel_size, output_size, random_samples, 2)


@lower(aten.fractional_max_pool3d.default, check=_fractional_check(3))
def _fractional_max_pool3d(x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(x, kernel_size, output_size, random_samples, 3)


@lower(aten.fractional_max_pool2d_backward.default)
def _fractional_max_pool2d_backward(grad, x, kernel_size, output_size, indices):
    return _max_pool_backward(grad, x, indices, 2)


@lower(aten.fractional_max_pool3d_backward.default)
def _fractional_max_pool3d_backward(grad, x, kernel_size, output_size, indices):
    return _max_pool_backward(grad, x, indices, 3)
