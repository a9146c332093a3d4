"""Ops JAX cannot run stay in eager PyTorch, between JAX partitions, with a reason."""

from __future__ import annotations

import torch

import dynajax
from dynajax import Reason
from tests.tolerances import assert_same

aten = torch.ops.aten


@torch.library.custom_op("dynajax_test::scaled_cumsum", mutates_args=())
def scaled_cumsum(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.cumsum(x, dim=-1) * scale


@scaled_cumsum.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _compile(fn, **options):
    backend = dynajax.Backend(**options)
    return torch.compile(fn, backend=backend), backend


def test_custom_op_in_the_middle_runs_eagerly() -> None:
    def f(x):
        y = torch.sin(x) * 2
        z = scaled_cumsum(y, 0.5)
        return torch.relu(z) + x

    x = torch.randn(4, 8)
    compiled, backend = _compile(f)
    assert_same(compiled(x), f(x))
    report = dynajax.Report(backend.graphs)
    [fallback] = report.fallbacks
    assert fallback.target == "dynajax_test.scaled_cumsum.default"
    assert fallback.reason is Reason.NO_LOWERING
    assert "test_fallback.py" in fallback.source_line
    assert "scaled_cumsum(y, 0.5)" in fallback.source_line
    # JAX on both sides of the custom op.
    assert len(report.partitions) == 2
    assert "dynajax_test.scaled_cumsum.default" in str(report)


def test_aten_op_without_rule_runs_eagerly() -> None:
    op = aten.fake_quantize_per_tensor_affine_cachemask.default
    assert op not in dynajax.supported_ops()

    def f(x):
        return torch.fake_quantize_per_tensor_affine(x * 0.5, 0.1, 0, -128, 127) + 1

    x = torch.randn(4, 4)
    compiled, backend = _compile(f)
    assert_same(compiled(x), f(x))
    [fallback] = dynajax.Report(backend.graphs).fallbacks
    assert fallback.target == str(op)
    assert fallback.reason is Reason.NO_LOWERING


def test_user_fallback_ops() -> None:
    def f(x):
        return torch.cos(torch.sin(x))

    x = torch.randn(8)
    compiled, backend = _compile(f, fallback_ops=["aten.sin"])
    assert_same(compiled(x), f(x))
    [fallback] = dynajax.Report(backend.graphs).fallbacks
    assert fallback.reason is Reason.USER_FALLBACK
    assert fallback.target == "aten.sin.default"


def test_min_block_size_keeps_small_partitions_in_pytorch() -> None:
    def f(x):
        y = torch.sin(x)
        y = scaled_cumsum(y, 2.0)
        return torch.cos(torch.exp(y) + 1)

    x = torch.randn(8)
    compiled, backend = _compile(f, min_block_size=2)
    assert_same(compiled(x), f(x))
    report = dynajax.Report(backend.graphs)
    small = [v for v in report.fallbacks if v.reason is Reason.BLOCK_TOO_SMALL]
    assert [v.target for v in small] == ["aten.sin.default"]
    assert [p.op_count for p in report.partitions] == [3]
