"""Sorting and selection: sort, argsort, topk.

PyTorch orders NaN above every number (last ascending, first descending) and treats
-0.0 and 0.0 as equal; ``jax.lax.sort`` already does both for ascending keys, so a
descending sort sorts on an order-reversing key instead of flipping the result (which
would also reverse the order of ties).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering import checks, eager_sorting
from dynajax.lowering.dtypes import eager_is_on_cuda, is_floating, result_type
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _sort_check(x, *args, **kwargs):
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return "sorting complex numbers (PyTorch raises)"
    return None


def _descending_keys(x):
    """Keys whose ascending order is x's descending order, NaN first."""
    if is_floating(x.dtype):
        return [~jnp.isnan(x), -x]
    if x.dtype == np.bool_:
        return [jnp.logical_not(x)]
    return [jnp.bitwise_not(x)]  # ~x reverses the order of any integer, without overflow


def sort_along(x, dim, descending):
    """(values, int64 indices) of a stable sort of ``x`` along ``dim``."""
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    d = dim % x.ndim
    iota = jax.lax.broadcasted_iota(np.int64, x.shape, d)
    keys = _descending_keys(x) if descending else [x]
    *_, values, indices = jax.lax.sort(
        (*keys, x, iota), dimension=d, is_stable=True, num_keys=len(keys)
    )
    return values, indices


def _on_rows(x, d, fn):
    """``fn`` on the 2-D rows of ``x`` along ``d`` (a (values, indices) pair back in
    ``x``'s layout; ``fn`` may return fewer columns)."""
    moved = jnp.moveaxis(x, d, -1)
    lead = moved.shape[:-1]
    v, i = fn(moved.reshape(math.prod(lead), moved.shape[-1]))
    v, i = v.reshape(*lead, v.shape[-1]), i.reshape(*lead, i.shape[-1]).astype(np.int64)
    return jnp.moveaxis(v, -1, d), jnp.moveaxis(i, -1, d)


def eager_sort_along(x, dim, descending):
    """(values, int64 indices) of eager's CPU ``sort(stable=False)`` along ``dim``:
    where values tie, the indices ``std::sort`` leaves (``eager_sorting``); the stable
    sort's otherwise (the same answer without ties), and for rows of at most
    ``eager_sorting.STABLE_UPTO`` values, which ``std::sort`` orders by insertion sort
    alone (stable)."""
    values, indices = sort_along(x, dim, descending)
    if (
        x.ndim == 0
        or x.size == 0
        or eager_is_on_cuda()  # (CUDA's kernels are not libstdc++'s: the stable order)
        or x.shape[dim % x.ndim] <= eager_sorting.STABLE_UPTO
    ):
        return values, indices
    d = dim % x.ndim
    comp = eager_sorting.comparator(x.dtype, descending)
    return jax.lax.cond(
        eager_sorting.ties(values, d, comp),
        lambda: _on_rows(x, d, lambda rows: eager_sorting.sort_rows(rows, descending)),
        lambda: (values, indices),
    )


@lower(aten.sort.default, check=_sort_check)
def _sort(x, dim=-1, descending=False):
    return eager_sort_along(x, dim, descending)


@lower(aten.sort.stable, check=_sort_check)
def _sort_stable(x, *, stable=None, dim=-1, descending=False):
    return sort_along(x, dim, descending) if stable else eager_sort_along(x, dim, descending)


@lower(aten.argsort.default, check=_sort_check)
def _argsort(x, dim=-1, descending=False):
    return eager_sort_along(x, dim, descending)[1]


@lower(aten.argsort.stable, check=_sort_check)
def _argsort_stable(x, *, stable, dim=-1, descending=False):
    return _sort_stable(x, stable=stable, dim=dim, descending=descending)[1]


def _topk_keys(x, largest):
    """float32 keys whose ``lax.top_k`` order is eager's (``largest``) order of ``x``
    wherever the keys differ: -0.0 as 0.0 (eager's comparator has them equal), and for
    the smallest the negation with NaN as -inf (last). Distinct values may share a key
    (float64 and 64-bit integers rounded, NaN and -inf): such ties are looked for where
    they matter, as ties of the values are."""
    if x.dtype == np.bool_:
        x = x.astype(np.float32)
    key = x.astype(np.float32)
    key = jnp.where(key == 0, jnp.zeros_like(key), key)
    if largest:
        return key  # NaN first, as top_k ranks it
    return jnp.where(jnp.isnan(key), -jnp.inf, -key)


def _top_k_along(x, k, d, largest):
    """(key values, int64 indices) of ``lax.top_k`` of ``_topk_keys`` along ``d``:
    ``k`` entries in eager's order, equal keys by index (as the stable sort's); XLA's
    TopK, where a full sort of the row would be 10-300x slower on the CPU."""
    moved = jnp.moveaxis(_topk_keys(x, largest), d, -1)
    # The barrier keeps XLA's TopK: the tie check's two slices of its values, merged
    # into the sort that TopK is first written as, stop XLA:CPU from rewriting that
    # sort back into TopK (a (64, 32000) row set: 570 ms, against 5 ms).
    keys, indices = jax.lax.optimization_barrier(jax.lax.top_k(moved, k))
    return jnp.moveaxis(keys, -1, d), jnp.moveaxis(indices.astype(np.int64), -1, d)


@lower(aten.topk.default, check=_sort_check)
def _topk(x, k, dim=-1, largest=True, sorted=True):
    """Eager's CPU topk: XLA's TopK (``_top_k_along``) where no two of the first k + 1
    keys tie; where some do (or with ``sorted=False``, whose order is the
    introselect's), the indices ``eager_sorting`` computes as the kernel does."""
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    d = dim % x.ndim
    n = x.shape[d]
    if k == 0 or x.size == 0:
        values, indices = sort_along(x, d, largest)
        return (
            jax.lax.slice_in_dim(values, 0, k, axis=d),
            jax.lax.slice_in_dim(indices, 0, k, axis=d),
        )
    keys, indices = _top_k_along(x, min(k + 1, n), d, largest)
    indices_k = jax.lax.slice_in_dim(indices, 0, k, axis=d)
    fast = (jnp.take_along_axis(x, indices_k, axis=d), indices_k)
    if n < 2 or eager_is_on_cuda():  # CUDA's kernels are not libstdc++'s
        return fast
    exact = lambda: _on_rows(x, d, lambda rows: eager_sorting.topk_rows(rows, k, largest, sorted))  # noqa: E731
    if not sorted:
        return exact()
    tied = jnp.any(
        jax.lax.slice_in_dim(keys, 0, keys.shape[d] - 1, axis=d)
        == jax.lax.slice_in_dim(keys, 1, keys.shape[d], axis=d)
    )
    return jax.lax.cond(tied, exact, lambda: fast)


# ---------------------------------------------------------------------------------
# Order statistics: median, nanmedian, kthvalue
# ---------------------------------------------------------------------------------


def _order_stat(x, dim, keepdim, pick, ordered=None):
    """Values and indices at position ``pick(sorted, nan_count, n)`` of the ascending
    stable sort along ``dim`` (NaN sorts last); ``ordered``: that sort, if made already."""
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    d = dim % x.ndim
    values, indices = sort_along(x, d, False) if ordered is None else ordered
    n = x.shape[d]
    nans = jnp.sum(jnp.isnan(x), axis=d, keepdims=True) if is_floating(x.dtype) else None
    pos = pick(nans, n)
    pos = jnp.broadcast_to(
        jnp.asarray(pos, np.int64), values.shape[:d] + (1,) + values.shape[d + 1 :]
    )
    v = jnp.take_along_axis(values, pos, axis=d)
    i = jnp.take_along_axis(indices, pos, axis=d)
    if not keepdim:
        v, i = jnp.squeeze(v, d), jnp.squeeze(i, d)
    return v, i


def _median_pos(nans, n):
    # The lower median; any NaN makes the result NaN (the first NaN in sorted order).
    k = (n - 1) // 2
    return k if nans is None else jnp.where(nans > 0, n - nans, k)


def _nanmedian_pos(nans, n):
    # The lower median of the non-NaN values; all-NaN gives NaN.
    if nans is None:
        return (n - 1) // 2
    return jnp.maximum((n - nans - 1) // 2, 0)


@lower(aten.median.default, check=_sort_check)
def _median(x):
    return _order_stat(x.reshape(-1), 0, False, _median_pos)[0]


def _nonempty_dim(x, dim, name):
    """Eager's error for an order statistic along a dim of size 0 (a shape check,
    raised by every call)."""
    if x.ndim and x.shape[dim % x.ndim] == 0:
        d = dim % x.ndim
        message = f"{name}(): Expected reduction dim {d} to have non-zero size."
        checks.fail_if(True, IndexError, message)


@lower(aten.median.dim, check=_sort_check)
def _median_dim(x, dim, keepdim=False):
    _nonempty_dim(x, dim, "median")
    return _order_stat(x, dim, keepdim, _median_pos)


@lower(aten.nanmedian.default, check=_sort_check)
def _nanmedian(x):
    return _order_stat(x.reshape(-1), 0, False, _nanmedian_pos)[0]


@lower(aten.nanmedian.dim, check=_sort_check)
def _nanmedian_dim(x, dim, keepdim=False):
    _nonempty_dim(x, dim, "median")  # eager's message says median() here too
    return _order_stat(x, dim, keepdim, _nanmedian_pos)


@lower(aten.kthvalue.default, check=_sort_check)
def _kthvalue(x, k, dim=-1, keepdim=False):
    """The stable sort's pick where the k-th value is unique in its row; where it ties
    with a neighbour (equal values, two NaNs, -0.0 and 0.0), the value and index ATen's
    quickselect leaves (``eager_sorting.kthvalue_rows``), as eager's CPU kernel gives."""
    _nonempty_dim(x, dim, "kthvalue")
    if x.ndim == 0 or x.size == 0 or eager_is_on_cuda() or not 1 <= k <= x.shape[dim % x.ndim]:
        # (a k out of range: eager's meta kernel raises while tracing)
        return _order_stat(x, dim, keepdim, lambda nans, n: k - 1)
    d = dim % x.ndim
    n = x.shape[d]
    ordered = sort_along(x, d, False)
    fast = _order_stat(x, d, keepdim, lambda nans, n: k - 1, ordered)
    values = ordered[0]
    gt = eager_sorting.comparator(x.dtype, True)
    kth = jax.lax.slice_in_dim(values, k - 1, k, axis=d)
    near = [jax.lax.slice_in_dim(values, j, j + 1, axis=d) for j in (k - 2, k) if 0 <= j < n]
    tied = jnp.any(jnp.stack([~gt(kth, b) & ~gt(b, kth) for b in near])) if near else False

    def exact():
        v, i = _on_rows(x, d, lambda rows: eager_sorting.kthvalue_rows(rows, k))
        return (v, i) if keepdim else (jnp.squeeze(v, d), jnp.squeeze(i, d))

    return jax.lax.cond(tied, exact, lambda: fast) if near else fast


# ---------------------------------------------------------------------------------
# Binary search: searchsorted, bucketize
# ---------------------------------------------------------------------------------


def _search(sorted_seq, values, right, out_int32):
    dt = result_type(sorted_seq, values)
    seq, vals = sorted_seq.astype(dt), jnp.asarray(values).astype(dt)
    side = "right" if right else "left"
    if seq.ndim <= 1:
        out = jnp.searchsorted(seq, vals, side=side)
    else:  # one sorted row per leading index, matched with values' leading dims
        lead = seq.shape[:-1]
        rows = math.prod(lead)  # explicit: reshape(-1, 0) is ambiguous for empty rows
        flat = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(
            seq.reshape(rows, seq.shape[-1]), vals.reshape(rows, vals.shape[-1])
        )
        out = flat.reshape(*lead, vals.shape[-1])
    return out.astype(np.int32 if out_int32 else np.int64)


def _searchsorted_check(sorted_seq, x, *, out_int32=False, right=False, side=None, sorter=None):
    if side is not None and side not in ("left", "right"):
        return f"searchsorted with side={side!r}"
    return None


def _searchsorted(sorted_seq, x, *, out_int32=False, right=False, side=None, sorter=None):
    if sorter is not None:
        checks.fail_if(
            checks.out_of_bounds(sorter, sorted_seq.shape[-1], negative=False),
            RuntimeError,
            "torch.searchsorted(): sorter index out of range",
        )
        sorted_seq = jnp.take_along_axis(sorted_seq, sorter, axis=-1)
    return _search(sorted_seq, x, right or side == "right", out_int32)


lower(aten.searchsorted.Tensor, aten.searchsorted.Scalar, check=_searchsorted_check)(_searchsorted)


@lower(aten.bucketize.Tensor, aten.bucketize.Scalar)
def _bucketize(x, boundaries, *, out_int32=False, right=False):
    return _search(boundaries, x, right, out_int32)


@lower(aten.mode.default, check=_sort_check)
def _mode(x, dim=-1, keepdim=False):
    """The most frequent value along ``dim`` (the smallest one among equally frequent
    values) and the index of one of its occurrences, the one PyTorch's CPU kernel reports.

    Runs of equal values in the ascending sort give the frequencies (NaN never equals
    NaN, so each NaN is a run of its own). The index is the one at the run's end in
    the order ``std::sort`` leaves (PyTorch's kernel sorts (value, index) pairs by value
    with it): the last occurrence for rows of at most 16 values, where that order is
    stable, and wherever values tie beyond, the index ``eager_sort_along`` emulates.
    (With NaN in the input, PyTorch's kernel answers inconsistently, even for the
    non-NaN values.)
    """
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    d = dim % x.ndim
    values, indices = eager_sort_along(x, d, False)
    values, indices = jnp.moveaxis(values, d, -1), jnp.moveaxis(indices, d, -1)
    n = values.shape[-1]
    pos = jnp.broadcast_to(jnp.arange(n), values.shape)
    new_run = jnp.concatenate(
        [jnp.ones(values.shape[:-1] + (1,), bool), values[..., 1:] != values[..., :-1]], -1
    )
    ends_run = jnp.concatenate([new_run[..., 1:], jnp.ones(values.shape[:-1] + (1,), bool)], -1)
    start = jax.lax.cummax(jnp.where(new_run, pos, 0), axis=values.ndim - 1)
    end = jnp.flip(
        jax.lax.cummin(jnp.flip(jnp.where(ends_run, pos, n), -1), axis=values.ndim - 1), -1
    )
    best = jnp.argmax(end - start, axis=-1)[..., None]  # first = smallest value
    best_end = jnp.take_along_axis(end, best, axis=-1)
    v = jnp.take_along_axis(values, best, axis=-1)
    i = jnp.take_along_axis(indices, best_end, axis=-1)
    v, i = jnp.moveaxis(v, -1, d), jnp.moveaxis(i, -1, d)
    if not keepdim:
        v, i = jnp.squeeze(v, d), jnp.squeeze(i, d)
    return v, i
