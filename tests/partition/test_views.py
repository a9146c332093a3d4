"""A view whose users all run in PyTorch stays in PyTorch (Reason.PERF): there it is
new strides over its input, in a JAX partition a copy written on every call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dynajax
from dynajax import Reason
from tests.helpers import assert_no_fallbacks, compare_with_eager, partition_ops
from tests.tolerances import assert_same


def _perf(report) -> list[str]:
    return [str(f.target) for f in report.fallbacks if f.reason is Reason.PERF]


def _others(report) -> list[str]:
    return [str(f.target) for f in report.fallbacks if f.reason is not Reason.PERF]


def test_weight_view_before_an_op_kept_in_pytorch() -> None:
    """``t`` of a linear layer's weight feeds only an addmm in fallback_ops: the
    transpose stays a view in PyTorch, the ReLU between the layers runs in JAX."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        report = compare_with_eager(
            model, torch.randn(3, 8), fallback_ops=["aten.addmm"], strict=True
        )
    assert _perf(report) == ["aten.permute.default"] * 2, report.text(width=None)
    assert _others(report) == ["aten.addmm.default"] * 2, report.text(width=None)
    assert partition_ops(report) == {"aten.relu.default"}
    assert all("free in PyTorch" in f.detail for f in report.fallbacks if f.reason is Reason.PERF)


def test_chain_of_views_after_jax_work() -> None:
    """sin runs in JAX; the views after it feed only an op kept in PyTorch, so the
    partition hands out sin's result, not a transposed copy of it."""

    def f(x, w):
        return torch.mm(x.sin().t().reshape(6, 4), w)

    report = compare_with_eager(f, torch.randn(4, 6), torch.randn(4, 5), fallback_ops=["aten.mm"])
    assert partition_ops(report) == {"aten.sin.default"}
    assert _perf(report) == ["aten.permute.default", "aten.view.default"], report.text(width=None)


@pytest.mark.parametrize(
    "name",
    ["view-is-the-output", "view-feeds-jax-too"],
)
def test_views_that_stay_in_jax(name: str) -> None:
    if name == "view-is-the-output":
        # A view compiled alone (or a graph's last op) still runs its JAX rule.
        report = compare_with_eager(lambda x: x.sin().t(), torch.randn(3, 5))
        assert_no_fallbacks(report)
        assert "aten.permute.default" in partition_ops(report) or "aten.t.default" in (
            partition_ops(report)
        )
    else:
        # One user in the partition: the view is computed there anyway.
        def f(x, w):
            y = x.sin().t()
            return y.cos(), torch.mm(y, w)

        report = compare_with_eager(
            f, torch.randn(4, 6), torch.randn(4, 5), fallback_ops=["aten.mm"]
        )
        assert _perf(report) == [], report.text(width=None)
        assert _others(report) == ["aten.mm.default"]


def _aliased(y: torch.Tensor, v: torch.Tensor) -> bool:
    return y.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "name, fn",
    [
        ("tensor-and-its-view", lambda x: ((y := x * 2), y.view(-1))),
        ("two-views", lambda x: ((y := x.sin()).view(-1), y.t())),
        ("chain-of-views", lambda x: ((y := x + 1), y.t().reshape(3, 2)[1:])),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_outputs_that_alias_stay_aliased(name: str, fn) -> None:
    """Outputs over one intermediate tensor share its storage, as eager's do: a write
    into one shows in the other (aot_autograd leaves that relation to the compiled
    graph, so the views run in PyTorch over the partition's output)."""
    x = torch.randn(2, 3)
    backend = dynajax.Backend(cache_dir="")
    a, b = torch.compile(fn, backend=backend, fullgraph=True)(x)
    ea, eb = fn(x)
    assert _aliased(ea, eb) and _aliased(a, b)
    assert a.stride() == ea.stride() and b.stride() == eb.stride()
    assert_same((a, b), (ea, eb))  # sin: XLA's, not bit-equal to eager's
    before = b.clone()
    a.add_(1)
    ea.add_(1)
    # the write into a shows in b, exactly (one correctly rounded add per element)
    torch.testing.assert_close(b, before + 1, rtol=0, atol=0)
    assert_same(b, eb)
    report = backend.graphs[-1]
    aliases = [f for f in report.fallbacks if f.reason is Reason.OUTPUT_ALIAS]
    assert aliases and all(f.detail == "returned as a view, as eager does" for f in aliases)
    assert all(f.reason.is_choice for f in report.fallbacks), report.text(width=None)
