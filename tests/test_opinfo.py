"""PyTorch's OpInfo database as dynajax's conformance suite (the CI subset).

One test per (op, dtype) of ``tests.opinfo_harness.ci_selection()``: its leading
samples must each run in JAX or fall back for a recorded reason, and match eager.
An entry of ``tests/opinfo_expected_failures.py`` must still fail: its test goes
through the triple's remaining samples until one fails, and fails itself, asking for
the entry's removal, when none does. The whole database: ``python -m tests.opinfo_full``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.opinfo_expected_failures import EXPECTED_FAILURES
from tests.opinfo_harness import FAILING, ci_selection, dtype_name, op_id, run_sample, samples


def _cases() -> list[Any]:
    return [
        pytest.param(op, dtype, n, id=f"{op_id(op)}-{dtype_name(dtype)}")
        for op, dtype, n in ci_selection()
    ]


@pytest.mark.parametrize(("op", "dtype", "n"), _cases())
def test_opinfo_sample_matches_eager(op: Any, dtype: torch.dtype, n: int) -> None:
    key = (op.name, op.variant_test_name, dtype_name(dtype))
    reason = EXPECTED_FAILURES.get(key)
    failures = []
    for i, sample in enumerate(samples(op, dtype)):
        if i >= n and (reason is None or failures):
            break
        outcome = run_sample(op, sample)
        if outcome.status == FAILING:
            failures.append(f"sample {i}: {outcome.detail}")
    if reason is None:
        assert not failures, "\n".join(failures)
    elif failures:
        pytest.xfail(reason)
    else:
        pytest.fail(
            f"{key} is listed in tests/opinfo_expected_failures.py ({reason!r}) but every "
            "sample now passes: remove the entry."
        )
