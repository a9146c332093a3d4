"""Reductions: sum, mean, prod, amax/amin, max/min with indices, argmax, var, any/all,
cumulative ops, softmax."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering import checks, eager_cpu
from dynajax.lowering.dtypes import as_dtype, divide, is_floating, is_integral, opmath, promote
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def axes(x, dim):
    """PyTorch's dim argument (None, [] or ints, negative allowed) as a tuple of axes."""
    if dim is None or (isinstance(dim, list | tuple) and len(dim) == 0):
        return tuple(range(x.ndim))
    dims = dim if isinstance(dim, list | tuple) else (dim,)
    if x.ndim == 0:
        return ()
    return tuple(sorted({d % x.ndim for d in dims}))


def _sum_dtype(x, dtype):
    if dtype is not None:
        return dtype
    # Integer and bool sums accumulate in int64, as in PyTorch.
    return np.dtype(np.int64) if is_integral(x.dtype) else x.dtype


def _eager_input(x, dtype):
    """The input of a reduction with ``dtype=``: eager converts a float input to an
    integer dtype element by element first, as ``.to(dtype)`` does
    (``dtypes.float_to_int``: NaN to the minimum on x86), where ``jnp``'s ``dtype=``
    would take XLA's conversion."""
    if dtype is not None and is_floating(x.dtype) and is_integral(dtype, include_bool=False):
        return as_dtype(x, dtype)
    return x


def _summed(x, dtype, **kw):
    # PyTorch's CPU sum accumulates half types in float32 and rounds once; jnp.sum
    # with an explicit bfloat16 dtype would round after every addition.
    x = _eager_input(x, dtype)
    out = _sum_dtype(x, dtype)
    half = np.dtype(out) in (np.dtype(jnp.bfloat16), np.dtype(np.float16))
    total = jnp.sum(x, dtype=np.float32 if half else out, **kw).astype(out)
    return as_eager_sum(total, x, kw.get("axis"))


def static_size(d) -> bool:
    """Whether a size is a number (not a ``jax.export`` symbolic dimension, on which no
    rule may branch)."""
    return isinstance(d, int | np.integer)


def as_eager_sum(total, x, axis=None):
    """``total``, a sum of ``x`` over ``axis`` (all of it if None), as eager's
    accumulator gives it where that is one element: +0.0 + x, so -0.0 sums to +0.0.
    XLA reads the element through (``sum([-0.0])`` was -0.0; the decompositions of
    ``mv`` and ``dot`` sum products this way; fuzz seed 4, program 3313)."""
    dims = x.shape if axis is None else [x.shape[a] for a in axis]
    if not jnp.issubdtype(total.dtype, jnp.floating):
        return total
    if not all(static_size(d) and d == 1 for d in dims):
        return total
    return jnp.where(total == 0, jnp.zeros((), total.dtype), total)


@lower(aten.sum.default)
def _sum(x, *, dtype=None):
    return _summed(x, dtype)


@lower(aten.sum.dim_IntList)
def _sum_dim(x, dim, keepdim=False, *, dtype=None):
    return _summed(x, dtype, axis=axes(x, dim), keepdims=keepdim)


@lower(aten.prod.default)
def _prod(x, *, dtype=None):
    return jnp.prod(_eager_input(x, dtype), dtype=_sum_dtype(x, dtype))


@lower(aten.prod.dim_int)
def _prod_dim(x, dim, keepdim=False, *, dtype=None):
    x, out = _eager_input(x, dtype), _sum_dtype(x, dtype)
    return jnp.prod(x, axis=axes(x, dim), keepdims=keepdim, dtype=out)


def _mean_check(x, *args, dtype=None, **_):
    if is_integral(x.dtype) and dtype is None:
        return "mean of an integer tensor (PyTorch raises)"
    return None


@lower(aten.mean.default, check=_mean_check)
def _mean(x, *, dtype=None):
    x = as_dtype(x, dtype) if dtype is not None else x
    return as_eager_sum(jnp.mean(x), x)


@lower(aten.mean.dim, check=_mean_check)
def _mean_dim(x, dim, keepdim=False, *, dtype=None):
    x = as_dtype(x, dtype) if dtype is not None else x
    ax = axes(x, dim)
    return as_eager_sum(jnp.mean(x, axis=ax, keepdims=keepdim), x, ax)


@lower(aten.amax.default)
def _amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=axes(x, dim), keepdims=keepdim)


@lower(aten.amin.default)
def _amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=axes(x, dim), keepdims=keepdim)


@lower(aten.max.default)
def _max(x):
    return jnp.max(x)


@lower(aten.min.default)
def _min(x):
    return jnp.min(x)


def _arg_extreme(x, dim, keepdim, largest):
    """Index of the first max/min along dim; NaN counts as the extreme, as in PyTorch."""
    if x.ndim == 0:
        return jnp.zeros((), np.int64)
    fn = jnp.argmax if largest else jnp.argmin  # both return the first NaN
    out = fn(x, axis=dim, keepdims=keepdim)
    return out.astype(np.int64)


def _extreme_dim(x, dim, keepdim, largest):
    """``max.dim``/``min.dim``: the index, and the value read at it. A reduction's own
    max/min may take another of equal elements: of +0.0 and -0.0 eager's value is the
    first one's, XLA's min was -0.0 (fuzz seed 4, program 1537)."""
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    d = dim % x.ndim
    index = _arg_extreme(x, d, True, largest)
    value = jnp.take_along_axis(x, index, axis=d)
    if not keepdim:
        value, index = jnp.squeeze(value, d), jnp.squeeze(index, d)
    return value, index


@lower(aten.argmax.default)
def _argmax(x, dim=None, keepdim=False):
    if dim is None:
        out = _arg_extreme(x.reshape(-1), 0, False, True)
        return out.reshape((1,) * x.ndim) if keepdim else out
    return _arg_extreme(x, dim % max(x.ndim, 1), keepdim, True)


@lower(aten.argmin.default)
def _argmin(x, dim=None, keepdim=False):
    if dim is None:
        out = _arg_extreme(x.reshape(-1), 0, False, False)
        return out.reshape((1,) * x.ndim) if keepdim else out
    return _arg_extreme(x, dim % max(x.ndim, 1), keepdim, False)


@lower(aten.max.dim)
def _max_dim(x, dim, keepdim=False):
    return _extreme_dim(x, dim, keepdim, True)


@lower(aten.min.dim)
def _min_dim(x, dim, keepdim=False):
    return _extreme_dim(x, dim, keepdim, False)


def _correction(correction, unbiased=True):
    if correction is None:
        return 1 if unbiased else 0
    return correction


def _variance(x, ax, ddof, keepdim):
    # PyTorch divides by max(N - correction, 0): inf or NaN once the correction reaches
    # N, where jnp.var's negative divisor would flip the sign.
    # Around the first element along the reduced dims: a constant slice's variance is
    # then exactly 0, as eager's is. (Around the rounded mean it was not: 3e-14 for three
    # copies of 1.7, and std's gradient, which eager zeroes where std is 0, was 1e5.)
    # Half types are computed in float32 and rounded once, correction included, as
    # eager's kernel does: var * N in float16 overflowed to inf where the variance itself
    # fits (six float16 values of ~200, correction 2; fuzz seed 11, program 981).
    half = opmath(x.dtype) != x.dtype
    out_dtype = x.dtype
    if half:
        x = x.astype(opmath(x.dtype))
    n = int(np.prod([x.shape[a] for a in ax]))
    first = x[tuple(slice(0, 1) if a in ax else slice(None) for a in range(x.ndim))]
    var = jnp.var(x - first, axis=ax, ddof=0, keepdims=keepdim)
    if ddof != 0:
        var = (var * n / jnp.asarray(max(n - ddof, 0), var.dtype)).astype(var.dtype)
    return var.astype(out_dtype) if half else var


@lower(aten.var.correction)
def _var(x, dim=None, *, correction=None, keepdim=False):
    return _variance(x, axes(x, dim), _correction(correction), keepdim)


@lower(aten.var.dim)
def _var_dim(x, dim=None, unbiased=True, keepdim=False):
    return _variance(x, axes(x, dim), 1 if unbiased else 0, keepdim)


@lower(aten.var_mean.correction)
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    ax = axes(x, dim)
    return (
        _variance(x, ax, _correction(correction), keepdim),
        jnp.mean(x, axis=ax, keepdims=keepdim),
    )


def _logical_reduction_dtype(x):
    # any/all of a uint8 tensor are uint8 in PyTorch (a legacy rule); bool otherwise.
    return np.dtype(np.uint8) if x.dtype == np.uint8 else np.dtype(np.bool_)


@lower(aten.any.default)
def _any(x):
    return jnp.any(x).astype(_logical_reduction_dtype(x))


@lower(aten.any.dim, aten.any.dims)
def _any_dim(x, dim=None, keepdim=False):
    return jnp.any(x, axis=axes(x, dim), keepdims=keepdim).astype(_logical_reduction_dtype(x))


@lower(aten.all.default)
def _all(x):
    return jnp.all(x).astype(_logical_reduction_dtype(x))


@lower(aten.all.dim)
def _all_dim(x, dim, keepdim=False):
    return jnp.all(x, axis=axes(x, dim), keepdims=keepdim).astype(_logical_reduction_dtype(x))


@lower(aten.cumsum.default)
def _cumsum(x, dim, *, dtype=None):
    x = _eager_input(x, dtype)
    if x.ndim == 0:
        return x.astype(_sum_dtype(x, dtype))
    out = _sum_dtype(x, dtype)
    acc = _scan_dtype(out)
    v = x.astype(acc)
    if x.dtype != acc:
        # jaxlib 0.10.2's algebraic simplifier aborts the process (Check failed in
        # HandleReduceWindow) on the reduce-window of a converted gathered constant
        # (torch.cumsum(torch.full((1, 1), 2, dtype=torch.bfloat16)[:, idx], 1)); the
        # barrier keeps the conversion out of its sight.
        v = jax.lax.optimization_barrier(v)
    return jnp.cumsum(v, axis=dim % x.ndim, dtype=acc).astype(out)


def _scan_dtype(dtype):
    # PyTorch's CPU scans accumulate half types in float32 and round each output once.
    return np.dtype(np.float32) if dtype in (np.float16, jnp.bfloat16) else dtype


@lower(aten.cumprod.default)
def _cumprod(x, dim, *, dtype=None):
    x = _eager_input(x, dtype)
    if x.ndim == 0:
        return x.astype(_sum_dtype(x, dtype))
    out = _sum_dtype(x, dtype)
    acc = _scan_dtype(out)
    return jnp.cumprod(x.astype(acc), axis=dim % x.ndim, dtype=acc).astype(out)


# ---------------------------------------------------------------------------------
# Softmax
# ---------------------------------------------------------------------------------


@lower(aten._softmax.default)
def _softmax(x, dim, half_to_float):
    out_dtype = np.float32 if half_to_float else x.dtype
    if x.ndim == 0:
        # Eager's one-element softmax: exp(x - max) / 1, NaN for NaN and +-inf.
        x = x.astype(out_dtype)
        return jnp.exp(x - x)
    axis = dim % x.ndim
    if opmath(out_dtype) != out_dtype:
        return _half_softmax(x, axis)
    return jax.nn.softmax(x.astype(out_dtype), axis=axis)


def _half_softmax(x, axis):
    """Eager's CPU softmax of bfloat16 or float16, bit for bit. Along the last dim, in
    float32 and rounded once. Along another dim, eager's kernel (``_vec_softmax``) walks
    the flattened (outer, inner) positions in equal chunks, one per thread of its pool;
    in each chunk a whole vector of positions (``eager_cpu.vector_bytes()`` wide) that
    lies within one row of the inner dims is computed in float32 and rounded once, and
    the rest, its scalar tail, stores ``exp(x - max)`` rounded to the dtype and divides
    that (in float32) by the float32 sum of the unrounded exponentials. Which positions
    are vectorized therefore depends on the CPU capability and the thread count, and
    ``_vectorized_positions`` follows both. ``jax.nn.softmax`` in the dtype itself
    rounds every step: a bfloat16 softmax of two elements was an ulp off, and the
    gradient that reads it 6% off."""
    wide = x.astype(np.float32)
    e = jnp.exp(wide - jnp.max(wide, axis=axis, keepdims=True))
    total = jnp.sum(e, axis=axis, keepdims=True)
    rounded_once = (e / total).astype(x.dtype)
    if axis == x.ndim - 1:
        return rounded_once
    tail = (e.astype(x.dtype).astype(np.float32) / total).astype(x.dtype)
    outer = math.prod(x.shape[:axis])
    inner = math.prod(x.shape[axis + 1 :])
    step = eager_cpu.vector_bytes() // x.dtype.itemsize
    vectorized = _vectorized_positions(outer, inner, step, eager_cpu.threads())
    keep = x.shape[:axis] + (1,) + x.shape[axis + 1 :]
    return jnp.where(vectorized.reshape(keep), rounded_once, tail)


def _vectorized_positions(outer: int, inner: int, step: int, threads: int):
    """Which of the ``outer * inner`` flattened positions eager's ``_vec_softmax``
    computes in its vectorized body. ``at::parallel_for(0, n, 0, f)`` runs ``f`` on
    chunks of ``ceil(n / threads)`` positions (one chunk when ``n`` is 1 or the pool has
    one thread); within a chunk, from its start and from each row start after it, whole
    vectors are taken while they fit both the chunk and the row."""
    n = outer * inner
    chunk = n if threads <= 1 or n <= 1 else -(-n // threads)
    index = jnp.int64 if n >= 2**31 - 2 * step else jnp.int32
    p = jnp.arange(n, dtype=index)
    begin = (p // chunk) * chunk
    end = jnp.minimum(begin + chunk, n)
    row = (p // inner) * inner
    start = jnp.maximum(begin, row)
    stop = jnp.minimum(row + inner, end)
    return p < start + (stop - start) // step * step


@lower(aten._log_softmax.default)
def _log_softmax(x, dim, half_to_float):
    out_dtype = np.float32 if half_to_float else x.dtype
    if x.ndim == 0:
        # Eager's one-element log_softmax: x - max - log(1), NaN for NaN and +-inf.
        x = x.astype(out_dtype)
        return x - x
    if opmath(out_dtype) != out_dtype:
        # As eager's kernel: in float32, rounded once (bit-equal along a dim other than
        # the last; along the last, eager's kernel rounds otherwise, an ulp apart on
        # some elements).
        wide = jax.nn.log_softmax(x.astype(np.float32), axis=dim % x.ndim)
        return wide.astype(out_dtype)
    return jax.nn.log_softmax(x.astype(out_dtype), axis=dim % x.ndim)


@lower(aten.logsumexp.default)
def _logsumexp(x, dim, keepdim=False):
    return jax.scipy.special.logsumexp(x, axis=axes(x, dim), keepdims=keepdim)


# ---------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------


def _vector_norm_check(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if is_integral(x.dtype) and (dtype is None or is_integral(dtype)):
        return "vector_norm of an integer tensor (PyTorch raises)"
    return None


@lower(aten.linalg_vector_norm.default, check=_vector_norm_check)
def _linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dtype is not None:
        x = x.astype(dtype)
    out_dtype = jnp.real(jnp.zeros((), x.dtype)).dtype
    a = jnp.abs(x)
    # Half precision accumulates in float32, as PyTorch's CPU reduction does.
    if a.dtype in (np.float16, jnp.bfloat16):
        a = a.astype(np.float32)
    ax = axes(x, dim)
    if ord == float("inf"):
        out = jnp.max(a, axis=ax, keepdims=keepdim)
    elif ord == float("-inf"):
        out = jnp.min(a, axis=ax, keepdims=keepdim)
    elif ord == 0:
        out = jnp.sum(a != 0, axis=ax, keepdims=keepdim).astype(a.dtype)
    elif ord == 1:
        out = jnp.sum(a, axis=ax, keepdims=keepdim)
    elif ord == 2:
        out = jnp.sqrt(jnp.sum(a * a, axis=ax, keepdims=keepdim))
    else:
        out = jnp.sum(a**ord, axis=ax, keepdims=keepdim) ** (1.0 / ord)
    return out.astype(out_dtype)


def _dist_check(x, y, p=2):
    if is_integral(x.dtype) or is_integral(y.dtype):
        return "dist of integer tensors (PyTorch raises)"
    return None


@lower(aten.dist.default, check=_dist_check)
def _dist(x, y, p=2):
    # PyTorch: norm(x - y, p), the difference rounded to the promoted dtype first.
    x, y = promote(x, y)
    return _linalg_vector_norm(x - y, p)


# ---------------------------------------------------------------------------------
# Cumulative extremes and log-sum-exp
# ---------------------------------------------------------------------------------


def _cum_extreme(x, dim, later_wins):
    """PyTorch's cummax/cummin scan: a later element replaces the running extreme when
    it is NaN, or when the running one is not NaN and ``later_wins`` (>= or <=), so ties
    and NaNs report the last index. That is a max under a total order, hence a scan."""
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    d = dim % x.ndim
    idx = jax.lax.broadcasted_iota(np.int64, x.shape, d)

    def combine(a, b):
        (av, ai), (bv, bi) = a, b
        if is_floating(x.dtype):
            take_b = jnp.isnan(bv) | (~jnp.isnan(av) & later_wins(bv, av))
        else:
            take_b = later_wins(bv, av)
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    return jax.lax.associative_scan(combine, (x, idx), axis=d)


@lower(aten.cummax.default)
def _cummax(x, dim):
    return _cum_extreme(x, dim, jnp.greater_equal)


@lower(aten.cummin.default)
def _cummin(x, dim):
    return _cum_extreme(x, dim, jnp.less_equal)


def _log_add_exp_complex(acc, x):
    # PyTorch's complex step: log1p(exp(min - max)) + max, ordered by real part (ties:
    # x is the min); the imaginary part is carried from max, not wrapped to (-pi, pi].
    nan = jnp.isnan(acc.real) | jnp.isnan(acc.imag) | jnp.isnan(x.real) | jnp.isnan(x.imag)
    acc_is_min = acc.real < x.real
    lo, hi = jnp.where(acc_is_min, acc, x), jnp.where(acc_is_min, x, acc)
    general = jnp.log1p(jnp.exp(lo - hi)) + hi
    both_inf = ~jnp.isfinite(lo.real) & (lo.real == hi.real)
    inf_case = jnp.where(lo.real < 0, lo, jnp.log(jnp.exp(lo) + jnp.exp(hi)))
    out = jnp.where(both_inf, inf_case, general)
    return jnp.where(nan, jnp.asarray(complex(np.nan, np.nan), out.dtype), out)


@lower(aten.logcumsumexp.default)
def _logcumsumexp(x, dim):
    if x.ndim == 0:
        return x
    axis = dim % x.ndim
    if not jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jax.lax.cumlogsumexp(x, axis=axis)
    # Complex: PyTorch's sequential scan, whose imaginary parts are not wrapped.
    moved = jnp.moveaxis(x, axis, 0)

    def step(acc, xi):
        acc = _log_add_exp_complex(acc, xi)
        return acc, acc

    init = jnp.full(moved.shape[1:], complex(-np.inf, 0), x.dtype)
    _, out = jax.lax.scan(step, init, moved)
    return jnp.moveaxis(out, 0, axis)


# ---------------------------------------------------------------------------------
# Histograms
# ---------------------------------------------------------------------------------


def _histc_check(x, bins=100, min=0, max=0):
    if not is_floating(x.dtype):
        return f"histc of {np.dtype(x.dtype).name} (PyTorch's CPU kernel takes floating point)"
    return None


@lower(aten.histc.default, check=_histc_check)
def _histc(x, bins=100, min=0, max=0):
    # min == max means "the data's range", widened by 1 on each side if still empty.
    # Values outside the range are not counted; x == max falls in the last bin.
    flat = x.reshape(-1)
    checks.fail_if(min > max, RuntimeError, "torch.histc: max must be larger than min")
    lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    if min == max:
        lo = jnp.min(flat, initial=jnp.inf).astype(x.dtype) if flat.size else lo
        hi = jnp.max(flat, initial=-jnp.inf).astype(x.dtype) if flat.size else hi
    checks.fail_if(
        ~(jnp.isfinite(lo) & jnp.isfinite(hi)),
        RuntimeError,
        "torch.histc: range of [{low}, {high}] is not finite",
        low=lo,
        high=hi,
    )
    if min == max:
        same = lo == hi
        lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    inside = (flat >= lo) & (flat <= hi)
    # (x - lo) * bins / (hi - lo) in the input dtype, each step rounded to it as the
    # kernel computes (executables round every op: no excess precision).
    idx = divide((flat - lo) * jnp.asarray(bins, x.dtype), hi - lo).astype(np.int64)
    idx = jnp.clip(jnp.where(flat == hi, bins - 1, idx), 0, bins - 1)
    return jnp.zeros((bins,), x.dtype).at[idx].add(inside.astype(x.dtype))
