"""sort, topk and kthvalue pick eager's CPU indices where values tie
(lowering/eager_sorting.py: libstdc++'s introsort, introselect and heap select, and
ATen's own quickselect, as eager's kernels run them)."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest
import torch

import dynajax
from dynajax.lowering import sorting

# (rows, n): every size class of the kernels: insertion sort only (n <= 3 for
# nth_element, <= 16 for sort), one partition, several, and topk's heap (k * 64 <= n).
SIZES = [(3, 4), (2, 8), (2, 17), (2, 40), (1, 130), (1, 300)]


@pytest.fixture(autouse=True)
def _x64():  # type: ignore[no-untyped-def]
    # The rules ask for int64 indices, as the backend runs them.
    with jax.enable_x64(True):
        yield


def _tied(shape: tuple[int, ...], levels: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, shape, generator=g).to(dtype)
    if dtype.is_floating_point:
        x.view(-1)[seed % x.numel()] = float("nan")
        x.view(-1)[(seed * 7) % x.numel()] = -0.0
    return x


def _jnp(x: torch.Tensor) -> jax.Array:
    if x.dtype == torch.bfloat16:
        return jax.numpy.asarray(x.float().numpy()).astype(jax.numpy.bfloat16)
    return jax.numpy.asarray(x.numpy())


@pytest.mark.parametrize("rows,n", SIZES)
@pytest.mark.parametrize("largest", [True, False])
def test_topk_picks_eagers_indices_among_ties(rows: int, n: int, largest: bool) -> None:
    topk = jax.jit(sorting._topk, static_argnums=(1, 2, 3, 4))
    cases = [
        (1, torch.float32, 2, True),
        (3, torch.int64, min(n, 5), False),
        (2, torch.bfloat16, 1, True),
    ]
    for seed, (levels, dtype, k, sorted_) in enumerate(cases):
        x = _tied((rows, n), levels, seed, dtype)
        want = torch.topk(x, k, largest=largest, sorted=sorted_)
        values, indices = topk(_jnp(x), k, -1, largest, sorted_)
        where = f"{dtype} levels={levels} k={k} sorted={sorted_}"
        np.testing.assert_array_equal(np.asarray(indices), want.indices.numpy(), where)
        np.testing.assert_array_equal(
            np.asarray(values.astype(np.float32)), want.values.float().numpy(), where
        )


@pytest.mark.parametrize("rows,n", SIZES)
def test_sort_picks_eagers_indices_among_ties(rows: int, n: int) -> None:
    sort = jax.jit(sorting._sort, static_argnums=(1, 2))
    for seed, (levels, dtype, descending) in enumerate(
        [(1, torch.float32, False), (3, torch.int32, True)]
    ):
        x = _tied((rows, n), levels, seed, dtype)
        want = torch.sort(x, descending=descending)
        _, indices = sort(_jnp(x), -1, descending)
        np.testing.assert_array_equal(np.asarray(indices), want.indices.numpy())
        if n > 16:  # std::sort is not stable there: a stable sort would fail this test
            stable = torch.sort(x, descending=descending, stable=True).indices
            assert not torch.equal(stable, want.indices)


@pytest.mark.parametrize("rows,n", SIZES)
def test_kthvalue_picks_eagers_value_and_index_among_ties(rows: int, n: int) -> None:
    """ATen's quickselect leaves one of the tied values at k (with it its index, and the
    sign of a zero); a stable sort picks another. median's comparator breaks ties by
    index, so median agrees with the stable sort (checked beside)."""
    kthvalue = jax.jit(sorting._kthvalue, static_argnums=(1, 2, 3))
    differs = 0
    for seed, (levels, dtype) in enumerate(
        [(2, torch.float32), (3, torch.int64), (1, torch.bfloat16)]
    ):
        x = _tied((rows, n), levels, seed, dtype)
        for k in sorted({1, (n + 1) // 2}):
            want = torch.kthvalue(x, k, dim=-1)
            values, indices = kthvalue(_jnp(x), k, -1, False)
            where = f"{dtype} levels={levels} k={k}"
            np.testing.assert_array_equal(np.asarray(indices), want.indices.numpy(), where)
            got = np.asarray(values.astype(np.float64))
            np.testing.assert_array_equal(got, want.values.double().numpy(), where)
            np.testing.assert_array_equal(np.signbit(got), want.values.signbit().numpy(), where)
            stable = torch.sort(x, dim=-1, stable=True).indices[:, k - 1]
            differs += int((stable != want.indices).sum())
        want = torch.median(x, dim=-1)
        _, indices = jax.jit(sorting._median_dim, static_argnums=(1, 2))(_jnp(x), -1, False)
        np.testing.assert_array_equal(np.asarray(indices), want.indices.numpy(), str(dtype))
    if n >= 8:  # where the stable sort's pick differs from eager's: what the test covers
        assert differs > 0


@pytest.mark.parametrize("rows,n", SIZES)
def test_mode_reports_eagers_index(rows: int, n: int) -> None:
    """mode's index is the one at its run's end in the order std::sort leaves: the last
    occurrence up to 16 values (insertion sort, stable), another one beyond."""
    mode = jax.jit(sorting._mode, static_argnums=(1, 2))
    for seed, (levels, dtype) in enumerate([(3, torch.int64), (2, torch.float32)]):
        x = torch.randint(0, levels, (rows, n), generator=torch.Generator().manual_seed(seed))
        x = x.to(dtype)
        want = torch.mode(x, dim=-1)
        values, indices = mode(_jnp(x), -1, False)
        np.testing.assert_array_equal(np.asarray(indices), want.indices.numpy(), str(dtype))
        np.testing.assert_array_equal(np.asarray(values), want.values.numpy(), str(dtype))


def test_sort_along_another_dim_and_stable_sort_stay_stable() -> None:
    x = _tied((20, 3), 2, 5, torch.float32)
    for dim in (0, 1):
        want = torch.sort(x, dim=dim, descending=True)
        _, indices = jax.jit(sorting._sort, static_argnums=(1, 2))(_jnp(x), dim, True)
        np.testing.assert_array_equal(np.asarray(indices), want.indices.numpy())
    want = torch.sort(x, dim=0, stable=True)
    _, indices = sorting._sort_stable(_jnp(x), stable=True, dim=0)
    np.testing.assert_array_equal(np.asarray(indices), want.indices.numpy())


def test_random_tied_rows_match_eager() -> None:
    rng = random.Random(0)
    topk = jax.jit(sorting._topk, static_argnums=(1, 2, 3, 4))
    for _ in range(8):
        n = rng.choice([5, 9, 33, 65, 129])
        x = _tied((2, n), rng.choice([2, 3, 5]), rng.randrange(100), torch.float32)
        k = rng.choice([1, 2, 3, 4])
        largest, sorted_ = rng.random() < 0.5, rng.random() < 0.7
        want = torch.topk(x, k, largest=largest, sorted=sorted_).indices
        got = topk(_jnp(x), k, -1, largest, sorted_)[1]
        np.testing.assert_array_equal(np.asarray(got), want.numpy(), f"n={n} k={k}")


def test_tied_router_scores_pick_eagers_experts_in_the_backend() -> None:
    # A fresh mixture-of-experts router on a tiny config: every expert scores the same.
    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, 2, dim=-1)
        order = torch.argsort(experts.flatten())
        return weights, experts, order

    logits = torch.zeros(24, 8)
    logits[3, 5] = 1.0  # one row without ties
    compiled = torch.compile(route, backend="dynajax", fullgraph=True)
    for a, e in zip(compiled(logits), route(logits), strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    fn, _ = dynajax.jax_function(route, logits)
    for a, e in zip(jax.jit(fn)({}, logits.numpy()), route(logits), strict=True):
        np.testing.assert_array_equal(np.asarray(a), e.numpy())
