"""Eager's CPU sort and topk, tie for tie.

Eager's CPU kernels order a row with libstdc++'s algorithms on (value, index) pairs
compared by value only: ``sort`` (``stable=False``) is ``std::sort`` (introsort: median-
of-three quicksort partitions, heapsort past the depth limit, insertion sort of the
last 16-element runs); ``topk`` is ``std::partial_sort`` (a heap) where ``k * 64 <=
n``, else ``std::nth_element`` (introselect) followed, when ``sorted``, by ``std::sort``
of the first ``k - 1`` pairs (aten/src/ATen/native/TopKImpl.h); ``kthvalue`` is ATen's
own median-of-three quickselect (``quick_select_template``). These are
deterministic, but they do not keep equal values in index order: where values tie,
eager's indices are the ones these algorithms leave, which no stable sort gives (a
mixture-of-experts router with tied scores then picks other experts). The comparators
order NaN above every number (first when largest/descending, last otherwise) and -0.0
equal to 0.0.

This module runs the same algorithms, step for step, on each row (``lax.map`` over rows,
scalar ``while_loop``s within one), so the rules in ``sorting.py`` give eager's indices
wherever values tie. It is slow next to XLA's sort (a loop per step), so the rules call
it only where its answer can differ: under a ``lax.cond`` on ties among the values that
decide the result (and always for ``topk(sorted=False)``, whose order is the
introselect's). Checked against torch's kernels on random tied rows of every size class
(``tests/lowering/test_eager_sorting.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dynajax.lowering.dtypes import is_floating

_Comp = Callable[[jax.Array, jax.Array], jax.Array]
# A row: (values, indices); every algorithm moves both together.
_Row = tuple[jax.Array, jax.Array]
_I = np.int32
# libstdc++'s std::sort leaves rows of up to _S_threshold (16) values to its final
# insertion sort alone, which is stable: there eager's order is the stable sort's.
STABLE_UPTO = 16


def comparator(dtype: np.dtype, largest: bool) -> _Comp:
    """Eager's ``comp(a, b)``: whether ``a`` goes before ``b``."""
    if is_floating(dtype):
        if largest:
            return lambda a, b: (jnp.isnan(a) & ~jnp.isnan(b)) | (a > b)
        return lambda a, b: (~jnp.isnan(a) & jnp.isnan(b)) | (a < b)
    if largest:
        return lambda a, b: a > b
    return lambda a, b: a < b


def _lg(n: int) -> int:
    return n.bit_length() - 1


def _swap(p: _Row, i: jax.Array, j: jax.Array) -> _Row:
    v, ix = p
    vi, vj, ii, ij = v[i], v[j], ix[i], ix[j]
    return v.at[i].set(vj).at[j].set(vi), ix.at[i].set(ij).at[j].set(ii)


def _insertion_sort(p: _Row, first: jax.Array, last: jax.Array, comp: _Comp) -> _Row:
    """``std::__insertion_sort`` (also what ``__final_insertion_sort`` computes: its
    unguarded inserts stop where a guarded one does)."""

    def insert(i: jax.Array, p: _Row) -> _Row:
        v, ix = p
        val, vid = v[i], ix[i]

        def cond(s: Any) -> jax.Array:
            pos, v, _ = s
            return (pos > first) & comp(val, v[jnp.maximum(pos - 1, 0)])

        def body(s: Any) -> Any:
            pos, v, ix = s
            return pos - 1, v.at[pos].set(v[pos - 1]), ix.at[pos].set(ix[pos - 1])

        pos, v, ix = jax.lax.while_loop(cond, body, (i, v, ix))
        return v.at[pos].set(val), ix.at[pos].set(vid)

    return jax.lax.fori_loop(first + 1, jnp.maximum(last, first + 1), insert, p)


def _move_median_to_first(
    p: _Row, r: jax.Array, x: jax.Array, y: jax.Array, z: jax.Array, comp: _Comp
) -> _Row:
    v = p[0]
    a, b, c = v[x], v[y], v[z]
    ab, bc, ac = comp(a, b), comp(b, c), comp(a, c)
    target = jnp.where(
        ab, jnp.where(bc, y, jnp.where(ac, z, x)), jnp.where(ac, x, jnp.where(bc, z, y))
    )
    return _swap(p, r, target)


def _partition_pivot(
    p: _Row, first: jax.Array, last: jax.Array, comp: _Comp
) -> tuple[jax.Array, _Row]:
    """``std::__unguarded_partition_pivot``: the median of three to ``first``, then
    Hoare's partition of ``[first + 1, last)`` around it; the cut."""
    mid = first + (last - first) // 2
    p = _move_median_to_first(p, first, first + 1, mid, last - 1, comp)
    pivot = p[0][first]  # never moves: the scans stop at it

    def cond(s: Any) -> jax.Array:
        return ~s[2]

    def body(s: Any) -> Any:
        lo, hi, _, v, ix = s
        lo = jax.lax.while_loop(lambda i: comp(v[i], pivot), lambda i: i + 1, lo)
        hi = jax.lax.while_loop(lambda i: comp(pivot, v[i]), lambda i: i - 1, hi - 1)
        done = ~(lo < hi)
        v, ix = jax.lax.cond(done, lambda: (v, ix), lambda: _swap((v, ix), lo, hi))
        return jnp.where(done, lo, lo + 1), hi, done, v, ix

    lo, _, _, v, ix = jax.lax.while_loop(cond, body, (first + 1, last, jnp.bool_(False), *p))
    return lo, (v, ix)


# -- heaps (std::__adjust_heap, __push_heap, make_heap, __pop_heap) -------------------------


def _push_heap(
    p: _Row,
    base: jax.Array,
    hole: jax.Array,
    top: jax.Array,
    val: jax.Array,
    vid: jax.Array,
    comp: _Comp,
) -> _Row:
    def cond(s: Any) -> jax.Array:
        hole, v, _ = s
        parent = jnp.maximum(hole - 1, 0) // 2
        return (hole > top) & comp(v[base + parent], val)

    def body(s: Any) -> Any:
        hole, v, ix = s
        parent = (hole - 1) // 2
        return (
            parent,
            v.at[base + hole].set(v[base + parent]),
            ix.at[base + hole].set(ix[base + parent]),
        )

    hole, v, ix = jax.lax.while_loop(cond, body, (hole, *p))
    return v.at[base + hole].set(val), ix.at[base + hole].set(vid)


def _adjust_heap(
    p: _Row,
    base: jax.Array,
    hole: jax.Array,
    length: jax.Array,
    val: jax.Array,
    vid: jax.Array,
    comp: _Comp,
) -> _Row:
    top = hole

    def cond(s: Any) -> jax.Array:
        return s[1] < (length - 1) // 2

    def body(s: Any) -> Any:
        hole, child, v, ix = s
        child = 2 * (child + 1)
        child = jnp.where(comp(v[base + child], v[base + child - 1]), child - 1, child)
        return (
            child,
            child,
            v.at[base + hole].set(v[base + child]),
            ix.at[base + hole].set(ix[base + child]),
        )

    hole, child, v, ix = jax.lax.while_loop(cond, body, (hole, hole, *p))
    last_child = ((length & 1) == 0) & (child == (length - 2) // 2)
    c = 2 * (child + 1) - 1
    v, ix = jax.lax.cond(
        last_child,
        lambda: (v.at[base + hole].set(v[base + c]), ix.at[base + hole].set(ix[base + c])),
        lambda: (v, ix),
    )
    hole = jnp.where(last_child, c, hole)
    return _push_heap((v, ix), base, hole, top, val, vid, comp)


def _make_heap(p: _Row, base: jax.Array, n: jax.Array, comp: _Comp) -> _Row:
    start = (n - 2) // 2  # floor: -1 for n < 2 (nothing to do)

    def step(j: jax.Array, p: _Row) -> _Row:
        parent = start - j
        return _adjust_heap(p, base, parent, n, p[0][base + parent], p[1][base + parent], comp)

    return jax.lax.fori_loop(0, jnp.maximum(start + 1, 0), step, p)


def _pop_heap(p: _Row, base: jax.Array, last: jax.Array, result: jax.Array, comp: _Comp) -> _Row:
    v, ix = p
    val, vid = v[result], ix[result]
    v, ix = v.at[result].set(v[base]), ix.at[result].set(ix[base])
    return _adjust_heap((v, ix), base, jnp.zeros((), _I), last - base, val, vid, comp)


def _heap_select(
    p: _Row, first: jax.Array, middle: jax.Array, last: jax.Array, comp: _Comp
) -> _Row:
    p = _make_heap(p, first, middle - first, comp)

    def step(i: jax.Array, p: _Row) -> _Row:
        return jax.lax.cond(
            comp(p[0][i], p[0][first]), lambda: _pop_heap(p, first, middle, i, comp), lambda: p
        )

    return jax.lax.fori_loop(middle, jnp.maximum(last, middle), step, p)


def _sort_heap(p: _Row, first: jax.Array, last: jax.Array, comp: _Comp) -> _Row:
    def cond(s: Any) -> jax.Array:
        return s[0] - first > 1

    def body(s: Any) -> Any:
        last = s[0] - 1
        return (last, *_pop_heap((s[1], s[2]), first, last, last, comp))

    _, v, ix = jax.lax.while_loop(cond, body, (last, *p))
    return v, ix


def _partial_sort(
    p: _Row, first: jax.Array, middle: jax.Array, last: jax.Array, comp: _Comp
) -> _Row:
    return _sort_heap(_heap_select(p, first, middle, last, comp), first, middle, comp)


# -- std::sort, std::nth_element ------------------------------------------------------------


def _std_sort(p: _Row, n: int, comp: _Comp) -> _Row:
    """``std::sort`` of ``[0, n)``. Introsort's ranges are disjoint, so an explicit
    stack of pending ranges (depths strictly decrease up it: at most ``2 lg n + 1``)
    leaves what the recursion leaves."""
    if n < 2:
        return p
    limit = 2 * _lg(n)
    size = limit + 2
    i0 = jnp.zeros((), _I)
    stack = (
        jnp.zeros(size, _I),
        jnp.zeros(size, _I).at[0].set(n),
        jnp.zeros(size, _I).at[0].set(limit),
    )

    def outer_cond(s: Any) -> jax.Array:
        return s[0] > 0

    def outer_body(s: Any) -> Any:
        sp, firsts, lasts, depths, v, ix = s
        sp = sp - 1
        first, last, depth = firsts[sp], lasts[sp], depths[sp]

        def cond(t: Any) -> jax.Array:
            return (t[1] - t[0] > 16) & ~t[3]

        def body(t: Any) -> Any:
            first, last, depth, _, sp, firsts, lasts, depths, v, ix = t

            def heapsort() -> Any:
                v2, ix2 = _partial_sort((v, ix), first, last, last, comp)
                return last, jnp.bool_(True), sp, firsts, lasts, depths, v2, ix2

            def split() -> Any:
                cut, (v2, ix2) = _partition_pivot((v, ix), first, last, comp)
                return (
                    cut,
                    jnp.bool_(False),
                    sp + 1,
                    firsts.at[sp].set(cut),
                    lasts.at[sp].set(last),
                    depths.at[sp].set(depth - 1),
                    v2,
                    ix2,
                )

            last2, stop, sp, firsts, lasts, depths, v, ix = jax.lax.cond(
                depth == 0, heapsort, split
            )
            return first, last2, depth - 1, stop, sp, firsts, lasts, depths, v, ix

        t = (first, last, depth, jnp.bool_(False), sp, firsts, lasts, depths, v, ix)
        t = jax.lax.while_loop(cond, body, t)
        return t[4], t[5], t[6], t[7], t[8], t[9]

    s = jax.lax.while_loop(outer_cond, outer_body, (jnp.ones((), _I), *stack, *p))
    return _insertion_sort((s[4], s[5]), i0, jnp.asarray(n, _I), comp)


def _nth_element(p: _Row, nth: int, n: int, comp: _Comp) -> _Row:
    """``std::nth_element(0, nth, n)`` (introselect)."""
    if n == 0 or nth == n:
        return p
    nth_ = jnp.asarray(nth, _I)

    def cond(s: Any) -> jax.Array:
        return (s[1] - s[0] > 3) & ~s[3]

    def body(s: Any) -> Any:
        first, last, depth, _, v, ix = s

        def heap() -> Any:
            p2 = _heap_select((v, ix), first, nth_ + 1, last, comp)
            v2, ix2 = _swap(p2, first, nth_)
            return first, last, jnp.bool_(True), v2, ix2

        def split() -> Any:
            cut, (v2, ix2) = _partition_pivot((v, ix), first, last, comp)
            go_right = cut <= nth_
            return (
                jnp.where(go_right, cut, first),
                jnp.where(go_right, last, cut),
                jnp.bool_(False),
                v2,
                ix2,
            )

        first, last, stop, v, ix = jax.lax.cond(depth == 0, heap, split)
        return first, last, depth - 1, stop, v, ix

    init = (
        jnp.zeros((), _I),
        jnp.asarray(n, _I),
        jnp.asarray(2 * _lg(n), _I),
        jnp.bool_(False),
        *p,
    )
    first, last, _, stopped, v, ix = jax.lax.while_loop(cond, body, init)
    return jax.lax.cond(
        stopped, lambda: (v, ix), lambda: _insertion_sort((v, ix), first, last, comp)
    )


# -- ATen's own quickselect (kthvalue) --------------------------------------------------------


def _swap_if(p: _Row, a: jax.Array, b: jax.Array, gt: _Comp) -> _Row:
    """``if (gt(v[a], v[b])) swap(a, b)``."""
    return jax.lax.cond(gt(p[0][a], p[0][b]), lambda: _swap(p, a, b), lambda: p)


def _quick_select(p: _Row, k: int, n: int, gt: _Comp) -> _Row:
    """``quick_select_template(arr, k, gt_or_nan, swap)`` of
    aten/src/ATen/native/SortingUtils.h, which ``kthvalue`` runs on each row: a
    median-of-three quickselect of PyTorch's own (not libstdc++'s), whose swaps decide
    which of tied values lands at ``k``."""
    k_ = jnp.asarray(k, _I)

    def step(s: Any) -> Any:
        lo, hi, _, v, ix = s
        mid = lo + (hi - lo) // 2
        q = _swap((v, ix), mid, lo + 1)
        q = _swap_if(q, lo + 1, hi, gt)
        q = _swap_if(q, lo, hi, gt)
        q = _swap_if(q, lo + 1, lo, gt)
        piv = q[0][lo]

        def scan(t: Any) -> Any:
            i, j, _, v, ix = t
            i = jax.lax.while_loop(lambda i: gt(piv, v[i]), lambda i: i + 1, i + 1)
            j = jax.lax.while_loop(lambda j: gt(v[j], piv), lambda j: j - 1, j - 1)
            crossed = j < i
            v, ix = jax.lax.cond(crossed, lambda: (v, ix), lambda: _swap((v, ix), i, j))
            return i, j, crossed, v, ix

        i, j, _, v, ix = jax.lax.while_loop(
            lambda t: ~t[2], scan, (lo + 1, hi, jnp.bool_(False), *q)
        )
        v, ix = _swap((v, ix), lo, j)
        return jnp.where(j <= k_, i, lo), jnp.where(j >= k_, j - 1, hi), jnp.bool_(False), v, ix

    def two(s: Any) -> Any:
        lo, hi, _, v, ix = s
        v, ix = _swap_if((v, ix), lo, hi, gt)
        return lo, hi, jnp.bool_(True), v, ix

    def body(s: Any) -> Any:
        lo, hi = s[0], s[1]
        branch = jnp.where(hi <= lo, 0, jnp.where(hi == lo + 1, 1, 2))
        one = lambda s: (s[0], s[1], jnp.bool_(True), s[3], s[4])  # noqa: E731
        return jax.lax.switch(branch, [one, two, step], s)

    init = (jnp.zeros((), _I), jnp.asarray(n - 1, _I), jnp.bool_(False), *p)
    out = jax.lax.while_loop(lambda s: ~s[2], body, init)
    return out[3], out[4]


# -- the kernels, on rows ---------------------------------------------------------------------


def _rows(x: jax.Array, fn: Callable[[_Row], _Row]) -> _Row:
    """``fn`` on each row of the 2-D ``x`` (indices 0..n-1 beside the values)."""
    keys = x.astype(np.uint8) if x.dtype == np.bool_ else x
    n = x.shape[-1]
    ids = jnp.broadcast_to(jnp.arange(n, dtype=_I), x.shape)
    v, ix = jax.lax.map(lambda r: fn((r[0], r[1])), (keys, ids))
    return v.astype(x.dtype), ix


def sort_rows(x: jax.Array, descending: bool) -> _Row:
    """Eager's ``sort(stable=False)`` of each row of the 2-D ``x``: (values, indices)."""
    comp = comparator(x.dtype, descending)
    return _rows(x, lambda p: _std_sort(p, x.shape[-1], comp))


def topk_rows(x: jax.Array, k: int, largest: bool, sorted: bool) -> _Row:
    """Eager's ``topk`` of each row of the 2-D ``x``: (values, indices), ``k`` columns."""
    n = x.shape[-1]
    comp = comparator(x.dtype, largest)

    def row(p: _Row) -> _Row:
        if k * 64 <= n:
            return _partial_sort(p, jnp.zeros((), _I), jnp.asarray(k, _I), jnp.asarray(n, _I), comp)
        p = _nth_element(p, k - 1, n, comp)
        return _std_sort(p, k - 1, comp) if sorted else p

    v, ix = _rows(x, row)
    return v[:, :k], ix[:, :k]


def kthvalue_rows(x: jax.Array, k: int) -> _Row:
    """Eager's ``kthvalue`` of each row of the 2-D ``x``: (values, indices), one column."""
    n = x.shape[-1]
    gt = comparator(x.dtype, True)  # gt_or_nan: NaN above every number
    v, ix = _rows(x, lambda p: _quick_select(p, k - 1, n, gt))
    return v[:, k - 1 : k], ix[:, k - 1 : k]


def ties(sorted_values: jax.Array, axis: int, comp: _Comp, upto: int | None = None) -> jax.Array:
    """Whether two neighbours of ``sorted_values`` along ``axis`` (among its first
    ``upto``) are equivalent under ``comp`` (neither goes before the other)."""
    end = sorted_values.shape[axis] if upto is None else min(upto, sorted_values.shape[axis])
    if end < 2:
        return jnp.bool_(False)
    a = jax.lax.slice_in_dim(sorted_values, 0, end - 1, axis=axis)
    b = jax.lax.slice_in_dim(sorted_values, 1, end, axis=axis)
    return jnp.any(~comp(a, b) & ~comp(b, a))
