"""Ops JAX cannot run stay in eager PyTorch, between JAX partitions, with a reason."""

from __future__ import annotations

import torch

import dynajax
from dynajax import Reason
from tests.helpers import compare_with_eager

aten = torch.ops.aten


@torch.library.custom_op("dynajax_test::scaled_cumsum", mutates_args=())
def scaled_cumsum(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.cumsum(x, dim=-1) * scale


@scaled_cumsum.register_fake
def _(x, scale):
    return torch.empty_like(x)


def test_custom_op_in_the_middle_runs_eagerly() -> None:
    def f(x):
        y = torch.sin(x) * 2
        z = scaled_cumsum(y, 0.5)
        return torch.relu(z) + x

    report = compare_with_eager(f, torch.randn(4, 8))
    [fallback] = report.fallbacks
    assert (fallback.target, fallback.reason, fallback.node) == (
        "dynajax_test.scaled_cumsum.default",
        Reason.NO_LOWERING,
        "scaled_cumsum",
    )
    assert fallback.source_line.startswith(__file__)
    assert "z = scaled_cumsum(y, 0.5)" in fallback.source_line
    # JAX on both sides of the custom op.
    assert len(report.partitions) == 2
    assert "dynajax_test.scaled_cumsum.default" in report.text(width=None)


def _fake_quantized(x):
    return torch.fake_quantize_per_tensor_affine(x * 0.5, 0.1, 0, -128, 127) + 1


def test_aten_op_without_rule_runs_pytorchs_kernel_inside_the_partition() -> None:
    op = aten.fake_quantize_per_tensor_affine_cachemask.default
    assert op not in dynajax.supported_ops()
    report = compare_with_eager(_fake_quantized, torch.randn(4, 4))
    assert report.fallbacks == []
    [graph] = report.graphs
    [partition] = graph.partitions
    assert str(op) in partition.ops and partition.op_count == 3
    [kernel] = graph.kernels
    assert (kernel.target, kernel.reason) == (str(op), Reason.NO_LOWERING)
    assert "PyTorch's kernels inside the XLA program" in report.text(width=None)


def test_aten_op_without_rule_runs_eagerly_with_the_kernels_off(monkeypatch) -> None:
    monkeypatch.setenv("DYNAJAX_TORCH_KERNELS", "0")
    op = aten.fake_quantize_per_tensor_affine_cachemask.default
    report = compare_with_eager(_fake_quantized, torch.randn(4, 4))
    [fallback] = report.fallbacks
    assert fallback.target == str(op)
    assert fallback.reason is Reason.NO_LOWERING
    assert len(report.partitions) == 2 and report.graphs[0].kernels == []
