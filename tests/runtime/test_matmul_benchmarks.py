"""benchmarks/matmul.py and benchmarks/xla_options.py: what they time computes the eager
answer, the runtime they report is the one in XLA's optimized HLO, and a candidate
leaves dynajax's options and rules as it found them (no timing is asserted)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from benchmarks import matmul, xla_options
from dynajax.lowering import registry
from dynajax.runtime import cache

# One product per runtime: x @ W^T goes to YNNPACK, a weight gradient g^T @ x to Eigen.
SHAPES = {
    "linear-ynn": (matmul.SHAPES[0], "ynn"),
    "weight-grad-eigen": (matmul.SHAPES[3], "eigen"),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_peer_computes_the_same_product(name: str) -> None:
    (_, sa, sb, ta, tb), runtime = SHAPES[name]
    steps, found = matmul._steps(sa, sb, ta, tb)
    assert found == runtime  # what the README says XLA does with these layouts
    expected = steps["eager"]().numpy()
    for peer in ("dynajax", "xla eigen"):
        np.testing.assert_allclose(np.asarray(steps[peer]()), expected, rtol=1e-5, atol=1e-4)


def test_main_prints_a_row_per_shape(monkeypatch, capsys) -> None:
    monkeypatch.setattr(matmul, "SHAPES", [SHAPES["linear-ynn"][0]])
    matmul.main(["--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("MLP fc1") and " ynn " in lines[-1]


def test_candidates_restore_options_and_rules() -> None:
    mm = torch.ops.aten.mm.default
    options, rule = dict(cache.COMPILER_OPTIONS), registry.get_rule(mm)
    for name in xla_options.CANDIDATES:
        with xla_options._candidate(name):
            assert cache.COMPILER_OPTIONS == {**options, **xla_options.CANDIDATES[name]}
            swapped = registry.get_rule(mm)
            assert swapped is not None
            a, b = np.arange(12.0).reshape(4, 3), np.arange(6.0).reshape(3, 2)
            got = jax.jit(swapped.fn)(jnp.asarray(a.T, np.float32).T, jnp.asarray(b, np.float32))
            np.testing.assert_array_equal(np.asarray(got), (a @ b).astype(np.float32))
        assert cache.COMPILER_OPTIONS == options
        assert registry.get_rule(mm) is rule
