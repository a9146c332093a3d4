"""Rules for transformers' own custom ops (``dynajax/lowering/transformers_ops.py``):
the experts' grouped matmul and its backward against transformers' eager kernels (empty
experts, rows past the last group, int32 and int64 offsets, float64), inside one JAX
partition; and the rules bind when transformers is imported after dynajax.

    pytest -q tests/lowering/test_transformers_ops.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import assert_ops_in_jax, compile_with
from tests.tolerances import assert_same

moe = pytest.importorskip("transformers.integrations.moe")

GROUPED_MM = torch.ops.transformers.grouped_mm_fallback.default
GROUPED_MM_BACKWARD = torch.ops.transformers.grouped_mm_fallback_backward.default

# (rows, in, out, ends of each expert's rows): an empty expert, rows past the last end.
CASES = {
    "four-experts": (10, 8, 6, [2, 2, 7, 9]),
    "all-rows": (6, 4, 3, [1, 3, 6]),
    "one-expert-empty-tail": (5, 3, 2, [0, 0]),
}


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_mm_forward_and_backward_match_eager(case, dtype, offs_dtype) -> None:
    rows, k, n, ends = CASES[case]
    torch.manual_seed(0)
    x = torch.randn(rows, k, dtype=dtype)
    w = torch.randn(len(ends), k, n, dtype=dtype)
    offs = torch.tensor(ends, dtype=offs_dtype)
    grad = torch.randn(rows, n, dtype=dtype)

    def f(x, w, offs, grad):
        return GROUPED_MM(x, w, offs).cos(), GROUPED_MM_BACKWARD(x, w, offs, grad)

    compiled, backend = compile_with(f, cache_dir="")
    assert_same(compiled(x, w, offs, grad), f(x, w, offs, grad))
    assert_ops_in_jax(
        backend,
        "transformers.grouped_mm_fallback.default",
        "transformers.grouped_mm_fallback_backward.default",
    )


def test_rules_bind_when_transformers_is_imported_after_dynajax() -> None:
    code = (
        "import torch, dynajax\n"
        "from dynajax.lowering import registry\n"
        "assert not hasattr(torch.ops.transformers, 'grouped_mm_fallback')\n"
        "import transformers.integrations.moe\n"
        "op = torch.ops.transformers.grouped_mm_fallback.default\n"
        "assert op in dynajax.supported_ops()\n"
        "assert registry.get_rule(op).fn.__name__ == '_grouped_mm_fallback'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
