"""How a convolution is computed: the algorithm is chosen per call from its shapes.

XLA's CPU convolution is slow or pathological on shapes real networks reach, measured
against PyTorch's oneDNN kernels (numbers in benchmarks/RECORD.md):

* an output extent smaller than the kernel's (a 3x3 kernel over ResNet's 2x2 last
  stage) runs 40-90x slower than the same product written as a matmul;
* grouped and depthwise convolutions (MobileNet, ConvNeXt) run 10-45x slower than a
  sum of shifted, scaled windows;
* transposed convolutions of small inputs (a decoder's first upsampling) run ~9x
  slower than a matmul followed by col2im, and 3-D transposed ones 27-80x.

Each function here lowers one ``aten.convolution`` to the fastest of these forms. All
are linear in input and weight, so ``jax.vjp`` of them is the exact backward. Every
form accumulates in ``acc`` (float32 for half-precision inputs). The forms are public
(``xla_convolution``, ``matmul_convolution``, ``tap_sum_convolution``, ``xla_transposed``,
``col2im_transposed``) so that tests and ``benchmarks/convolutions.py`` compare them.

Their products take the precision of eager's convolutions on the partition's tensors
(``for_convolutions``, set per compile by ``runtime/executables.py``): for CUDA tensors,
eager's float32 convolutions follow ``torch.backends.cudnn.allow_tf32`` (TF32 by
default), not ``torch.get_float32_matmul_precision()``, which governs matrix products.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

# Patch matrices up to this many elements (4 MiB of float32) make the matmul form the
# faster one; past it, writing them out costs more than XLA's convolution. XLA's 3-D
# convolution is slower still (2-6x the matmul form at 2-4M patch elements).
MATMUL_ELEMENTS = 1 << 20
MATMUL_ELEMENTS_3D = 1 << 22
# Transposed convolutions: col2im while its column buffer is this small (XLA's
# input-dilated convolution wins past it in 2-D), and always in 3-D, where XLA's is
# 27-80x slower than col2im (2x2x2 to 4x4x4 kernels over 8^3-16^3 inputs).
COL2IM_ELEMENTS = 1 << 17
# Grouped convolutions with at most this many input channels per group times kernel
# taps are summed tap by tap (one fused loop, no patch matrix).
TAP_SUM_TERMS = 128


# JAX's precision name for the convolutions being lowered; None: the ambient default
# (``jax.default_matmul_precision``, which the matrix products follow).
_PRECISION: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dynajax_conv_precision", default=None
)


@contextlib.contextmanager
def for_convolutions(precision: str | None) -> Iterator[None]:
    """Convolutions lowered inside take ``precision`` (a JAX precision name)."""
    token = _PRECISION.set(precision)
    try:
        yield
    finally:
        _PRECISION.reset(token)


def _spec(nd: int) -> tuple[str, str, str]:
    spatial = "DHW"[-nd:]
    return (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")


def _out_sizes(spatial, k, stride, padding, dilation):
    return [
        (spatial[i] + 2 * padding[i] - dilation[i] * (k[i] - 1) - 1) // stride[i] + 1
        for i in range(len(k))
    ]


def _transposed_out_sizes(spatial, k, stride, padding, dilation, output_padding):
    return [
        (spatial[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k[i] - 1)
        + output_padding[i] + 1
        for i in range(len(k))
    ]  # fmt: skip


def _windows(x, k, stride, padding, dilation, out):
    """The strided window of the zero-padded input each kernel tap reads, in the
    kernel's row-major tap order: a list of (N, C, *out) arrays."""
    n, c = x.shape[:2]
    x = jnp.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    windows = []
    for tap in itertools.product(*(range(ki) for ki in k)):
        start = [0, 0] + [t * d for t, d in zip(tap, dilation, strict=True)]
        ends = zip(start[2:], stride, out, strict=True)
        limit = [n, c] + [b + s * (m - 1) + 1 for b, s, m in ends]
        windows.append(jax.lax.slice(x, start, limit, [1, 1] + list(stride)))
    return windows


def _surely(predicate: Callable[[], bool]) -> bool:
    """``predicate()`` of sizes. Sizes may be symbolic (``jax.export``'s shape
    polymorphism, e.g. a batch dimension ``b``): where the answer depends on their
    values, it is False, so a form is picked only if it suits every size they may take
    (within their declared bounds)."""
    try:
        return bool(predicate())
    except jax.errors.InconclusiveDimensionOperation:
        return False


def choose(x_shape, w_shape, stride, padding, dilation, groups) -> str:
    """The form for a convolution of these shapes: "tap_sum", "matmul" or "xla"."""
    k = w_shape[2:]
    n, c = x_shape[:2]
    out = _out_sizes(x_shape[2:], k, stride, padding, dilation)
    taps = int(np.prod(k))
    if _surely(lambda: min(out, default=1) <= 0) or 0 in x_shape or 0 in w_shape:
        return "xla"
    if groups > 1 and _surely(lambda: c // groups * taps <= TAP_SUM_TERMS):
        return "tap_sum"
    kernel_wider = _surely(lambda: any(o < ki for o, ki in zip(out, k, strict=True)))
    limit = MATMUL_ELEMENTS_3D if len(k) == 3 else MATMUL_ELEMENTS
    if kernel_wider or _surely(lambda: n * c * taps * math.prod(out) <= limit):
        return "matmul"
    return "xla"


def choose_transposed(x_shape, w_shape, stride, groups) -> str:
    """The form for a transposed convolution: "col2im" or "xla".

    col2im is PyTorch's own algorithm (its CPU kernel for unbatched or batch-1 inputs
    sums in the same order: bit for bit in float32 on OpInfo's samples, where XLA's
    input-dilated convolution is up to 1.4e-4 off). XLA's slow case again is a kernel
    wider than the (stride-dilated) input, and any 3-D transposed convolution."""
    if 0 in x_shape or 0 in w_shape:
        return "xla"
    dilated = [(s - 1) * st + 1 for s, st in zip(x_shape[2:], stride, strict=True)]
    kernel_wider = _surely(lambda: any(d < k for d, k in zip(dilated, w_shape[2:], strict=True)))
    cout = w_shape[1] * groups
    cols = x_shape[0] * cout * int(np.prod(w_shape[2:])) * math.prod(x_shape[2:])
    small = _surely(lambda: cols <= COL2IM_ELEMENTS)
    return "col2im" if kernel_wider or small or len(w_shape) == 5 else "xla"


def convolution(x, weight, stride, padding, dilation, groups, acc):
    """A (batched, N C *spatial) convolution with symmetric padding, in ``acc``."""
    form = choose(x.shape, weight.shape, stride, padding, dilation, groups)
    if form == "xla":
        return xla_convolution(x, weight, stride, padding, dilation, groups, acc)
    out = _out_sizes(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    fn = tap_sum_convolution if form == "tap_sum" else matmul_convolution
    return fn(x, weight, stride, padding, dilation, groups, out, acc)


def xla_convolution(x, weight, stride, padding, dilation, groups, acc):
    return jax.lax.conv_general_dilated(
        x,
        weight,
        window_strides=stride,
        padding=[(p, p) for p in padding],
        rhs_dilation=dilation,
        dimension_numbers=_spec(weight.ndim - 2),
        feature_group_count=groups,
        preferred_element_type=acc,
        precision=_PRECISION.get(),
    )


def matmul_convolution(x, weight, stride, padding, dilation, groups, out, acc):
    # im2col: the windows stacked as (N, C, taps, *out) and contracted with the weight
    # over (C/groups, taps), a matmul batched over the groups.
    n, c = x.shape[:2]
    o = weight.shape[0]
    windows = _windows(x, weight.shape[2:], stride, padding, dilation, out)
    per_group = c // groups * len(windows)
    patches = jnp.stack(windows, axis=2).reshape((n, groups, per_group) + tuple(out))
    w = weight.reshape(groups, o // groups, per_group)
    res = jax.lax.dot_general(
        w,
        patches,
        (((2,), (2,)), ((0,), (1,))),
        preferred_element_type=acc,
        precision=_PRECISION.get(),
    )  # (groups, O/groups, N, *out)
    return jnp.moveaxis(res, 2, 0).reshape((n, o) + tuple(out))


def tap_sum_convolution(x, weight, stride, padding, dilation, groups, out, acc):
    # out[n, g, j] = sum over input channel i of the group and tap t of
    # weight[g, j, i, t] * window_t[n, g, i]: broadcast products XLA fuses into one loop.
    n, c = x.shape[:2]
    o = weight.shape[0]
    per_group, out_group = c // groups, o // groups
    w = weight.reshape(groups, out_group, per_group, -1).astype(acc)
    w = w.reshape((1, groups, out_group, per_group, -1) + (1,) * len(out))
    windows = _windows(x, weight.shape[2:], stride, padding, dilation, out)
    total = None
    for t, window in enumerate(windows):
        window = window.astype(acc).reshape((n, groups, 1, per_group) + tuple(out))
        for i in range(per_group):
            term = window[:, :, :, i] * w[:, :, :, i, t]
            total = term if total is None else total + term
    return total.reshape((n, o) + tuple(out))


def input_gradient(grad, weight, x_shape, stride, padding, dilation, groups, acc):
    """The input gradient of a (batched) convolution as a transposed convolution by
    col2im, or None where the VJP of the forward's own form is the better one.

    That is where a strided forward stays on XLA's convolution but col2im suits the
    transposed one (every 3-D case, small inputs): the VJP would be XLA's input-dilated
    convolution (a stride-2 3x3x3 convolution of 16x48^3: training step 958 ms by the
    VJP, 238 ms by col2im; eager 36 ms)."""
    k = weight.shape[2:]
    if all(st == 1 for st in stride):
        return None  # no input dilation: the VJP is a plain convolution
    if choose(x_shape, weight.shape, stride, padding, dilation, groups) != "xla":
        return None
    if choose_transposed(grad.shape, weight.shape, stride, groups) != "col2im":
        return None
    # The output padding that gives back the input's extent (a strided convolution
    # drops up to stride - 1 trailing rows).
    bare = _transposed_out_sizes(grad.shape[2:], k, stride, padding, dilation, [0] * len(k))
    output_padding = [x - b for x, b in zip(x_shape[2:], bare, strict=True)]
    return col2im_transposed(grad, weight, stride, padding, dilation, output_padding, groups, acc)


def transposed(x, weight, stride, padding, dilation, output_padding, groups, acc):
    """A (batched) transposed convolution, in ``acc``: the gradient of a convolution."""
    form = choose_transposed(x.shape, weight.shape, stride, groups)
    fn = col2im_transposed if form == "col2im" else xla_transposed
    return fn(x, weight, stride, padding, dilation, output_padding, groups, acc)


def xla_transposed(x, weight, stride, padding, dilation, output_padding, groups, acc):
    # Dilate the input by the stride, pad by dilation*(k-1)-padding, and convolve with
    # the flipped kernel whose in/out channels are swapped (per group).
    k = weight.shape[2:]
    nd = len(k)
    cin, cout_g = weight.shape[0], weight.shape[1]
    w = weight.reshape((groups, cin // groups, cout_g) + k)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + k)
    w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
    pads = [
        (
            dilation[i] * (k[i] - 1) - padding[i],
            dilation[i] * (k[i] - 1) - padding[i] + output_padding[i],
        )
        for i in range(nd)
    ]
    return jax.lax.conv_general_dilated(
        x,
        w,
        window_strides=[1] * nd,
        padding=pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=_spec(nd),
        feature_group_count=groups,
        preferred_element_type=acc,
        precision=_PRECISION.get(),
    )


def col2im_transposed(x, weight, stride, padding, dilation, output_padding, groups, acc):
    # PyTorch's own algorithm: one matmul gives every tap's contribution per input
    # position, then each tap's slab is added at its strided place in the output.
    n, cin = x.shape[:2]
    spatial = x.shape[2:]
    k = weight.shape[2:]
    cout_g = weight.shape[1]
    in_group = cin // groups
    xs = x.reshape((n, groups, in_group) + tuple(spatial))
    w = weight.reshape(groups, in_group, cout_g * int(np.prod(k)))
    cols = jax.lax.dot_general(
        w,
        xs,
        (((1,), (2,)), ((0,), (1,))),
        preferred_element_type=acc,
        precision=_PRECISION.get(),
    )  # (groups, cout_g * taps, N, *spatial)
    cols = jnp.moveaxis(cols, 2, 0).reshape((n, groups * cout_g, -1) + tuple(spatial))
    out = _transposed_out_sizes(spatial, k, stride, padding, dilation, output_padding)
    extent = [
        max((spatial[i] - 1) * stride[i] + dilation[i] * (k[i] - 1) + 1, padding[i] + out[i])
        for i in range(len(k))
    ]
    total = None
    zero = jnp.zeros((), acc)
    for t, tap in enumerate(itertools.product(*(range(ki) for ki in k))):
        config = [(0, 0, 0), (0, 0, 0)]
        for i, ti in enumerate(tap):
            low = ti * dilation[i]
            high = extent[i] - (low + (spatial[i] - 1) * stride[i] + 1)
            config.append((low, high, stride[i] - 1))
        slab = jax.lax.pad(cols[:, :, t], zero, config)
        total = slab if total is None else total + slab
    limit = [n, groups * cout_g] + [p + o for p, o in zip(padding, out, strict=True)]
    return jax.lax.slice(total, [0, 0] + list(padding), limit)
