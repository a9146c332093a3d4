"""The attention-backward decomposition (dynajax/aot/table.py) agrees with
PyTorch's CPU flash-attention backward kernel fed the kernel's own forward outputs."""

from __future__ import annotations

import pytest
import torch

from dynajax.aot.table import corrections
from tests.tolerances import assert_same

aten = torch.ops.aten


CASES = {  # id -> (mask kind, is_causal, scale); SDPA takes a mask or is_causal
    "full": ("none", False, None),
    "causal": ("none", True, None),
    "causal-scale": ("none", True, 0.3),
    "bool_mask": ("bool", False, None),
    "float_mask-scale": ("float", False, 0.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_eager_kernel(case: str) -> None:
    mask, causal, scale = CASES[case]
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, dtype=torch.float64) for _ in range(3))
    kernel_mask = ours_mask = None
    if mask == "bool":
        keep = torch.rand(6, 6) > 0.3
        keep[:, 0] = True  # no fully masked row
        # The kernel takes additive float masks (SDPA converts boolean ones before it).
        kernel_mask = torch.zeros(6, 6, dtype=torch.float64).masked_fill(~keep, float("-inf"))
        ours_mask = keep
    elif mask == "float":
        kernel_mask = ours_mask = torch.randn(6, 6, dtype=torch.float64)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=kernel_mask, scale=scale
    )
    grad = torch.randn_like(out)
    op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    expected = op(grad, q, k, v, out, lse, 0.0, causal, attn_mask=kernel_mask, scale=scale)
    # The decomposition never reads out/lse: garbage there must not matter.
    actual = corrections()[op](
        grad, q, k, v, out * 0, lse * 0, 0.0, causal, attn_mask=ours_mask, scale=scale
    )
    assert_same(actual, expected)
