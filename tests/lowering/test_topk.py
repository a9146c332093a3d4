"""topk's fast path (XLA's TopK on float32 keys, lowering/sorting.py): eager's values
and indices without ties, NaN, -0.0 and infinities included, for every dtype; distinct
values that share a float32 key take the exact path and still give eager's answer;
and a large row stays fast (XLA:CPU kept TopK, not a full sort)."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
import torch

from dynajax.lowering import sorting


@pytest.fixture(autouse=True)
def _x64():  # type: ignore[no-untyped-def]
    with jax.enable_x64(True):
        yield


def _check(x: torch.Tensor, k: int, dim: int, largest: bool) -> None:
    topk = jax.jit(sorting._topk, static_argnums=(1, 2, 3))
    values, indices = topk(jax.numpy.asarray(x.numpy()), k, dim, largest)
    expected = torch.topk(x, k, dim=dim, largest=largest)
    np.testing.assert_array_equal(np.asarray(indices), expected.indices.numpy())
    np.testing.assert_array_equal(np.asarray(values), expected.values.numpy())


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_no_ties_is_eagers_answer(dtype: torch.dtype, largest: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randperm(6 * 200, generator=g).reshape(6, 200).to(dtype)  # distinct
    if dtype.is_floating_point:
        x = (x - 600) / 7
        x[0, 3], x[1, 5], x[2, 7] = float("nan"), float("inf"), float("-inf")
        x[3, 9] = -0.0
    for dim in (1, 0):
        _check(x, 5, dim, largest)


def test_values_that_share_a_float32_key_are_eagers_ties() -> None:
    # 2**24 + 1 and 2**24 round to the same float32: the exact path orders them.
    x = torch.tensor([[1, 2**24 + 1, 2**24, 5, 2**24 + 1]], dtype=torch.int64)
    for largest in (True, False):
        _check(x, 3, 1, largest)
    y = torch.tensor([[1.0, 1.0 + 2**-40, 0.5, 1.0 + 2**-41]], dtype=torch.float64)
    _check(y, 2, 1, True)


def test_a_large_row_set_stays_fast() -> None:
    x = jax.numpy.asarray(np.random.RandomState(0).randn(64, 32000).astype(np.float32))
    topk = jax.jit(lambda x: sorting._topk(x, 5))
    jax.block_until_ready(topk(x))
    start = time.perf_counter()
    jax.block_until_ready(topk(x))
    # XLA's TopK takes ~5 ms here; the full sort it fell back to took ~570 ms.
    assert time.perf_counter() - start < 0.15
