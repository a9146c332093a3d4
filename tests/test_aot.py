"""The aot stage's decomposition policy (dynajax/aot.py), in one place."""

from __future__ import annotations

from torch._decomp import core_aten_decompositions

import dynajax
from dynajax import aot


def test_fused_kernels_are_kept_whole_and_have_rules() -> None:
    table = aot.decompositions()
    for op in aot.FUSED_KERNELS:
        assert op not in table, f"{op} is decomposed, so its rule in lowering/fused.py is dead"
        assert op in dynajax.supported_ops(), f"{op} is kept whole but has no JAX rule"


def test_checked_kernels_are_kept_whole_and_have_rules() -> None:
    table = aot.decompositions()
    for op in aot.CHECKED_KERNELS:
        assert op not in table, f"{op} is decomposed, so its rule's value check is dead"
        assert op in dynajax.supported_ops(), f"{op} is kept whole but has no JAX rule"


def test_corrections_replace_core_decompositions() -> None:
    # Built afresh: torch registers more decompositions as its modules are imported.
    aot.decompositions.cache_clear()
    table = aot.decompositions()
    core = core_aten_decompositions()
    corrections = aot.corrections()
    for op, fn in corrections.items():
        assert table[op] is fn
    # Everything else is PyTorch's own table.
    kept = set(aot.FUSED_KERNELS) | set(aot.CHECKED_KERNELS)
    assert set(table) == (set(core) | set(corrections)) - kept
