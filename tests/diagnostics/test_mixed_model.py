"""A model mixing JAX-supported ops, a custom op, a data-dependent op and an argument
value a rule refuses: it gets the eager answer and its report names every fallback."""

from __future__ import annotations

import inspect

import torch

import dynajax
from dynajax import Reason
from tests.tolerances import assert_same


@torch.library.custom_op("dynajax_mixtest::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    return limit * torch.tanh(x / limit)


@soft_clip.register_fake
def _(x, limit):
    return torch.empty_like(x)


class Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.nn.Linear(8, 16)
        self.decode = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.encode(x))
        h = soft_clip(h, 2.0)  # custom op: no JAX rule
        active = torch.nonzero(h > 0.5)  # data-dependent output shape
        h = h.clone()
        h[h < 0.1] = 0.0  # boolean-mask assignment: the index_put rule refuses the mask
        out = torch.softmax(self.decode(h), dim=-1)
        return out, active


def _line_of(text: str) -> int:
    lines, start = inspect.getsourcelines(Mixed.forward)
    [offset] = [i for i, line in enumerate(lines) if text in line]
    return start + offset


def test_mixed_model_gets_the_eager_answer_and_an_exact_report() -> None:
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(6, 8)
    backend = dynajax.Backend()
    with torch.no_grad(), torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(model, backend=backend)(x)
        assert_same(got, model(x))
    report = dynajax.Report(backend.graphs)
    [graph] = report.graphs
    fallbacks = {f.target: f for f in report.fallbacks}
    assert set(fallbacks) == {
        "dynajax_mixtest.soft_clip.default",
        "aten.nonzero.default",
    }, report.text(width=None)
    # The masked assignment's shape is static: PyTorch's kernel runs it inside XLA.
    [kernel] = report.kernels
    assert kernel.target == "aten.index_put.default"
    fallbacks[kernel.target] = kernel
    expected = {
        "dynajax_mixtest.soft_clip.default": (Reason.NO_LOWERING, "h = soft_clip(h, 2.0)"),
        "aten.nonzero.default": (Reason.DATA_DEPENDENT_SHAPE, "active = torch.nonzero(h > 0.5)"),
        "aten.index_put.default": (Reason.CHECK_REFUSED, "h[h < 0.1] = 0.0"),
    }
    for target, (reason, code) in expected.items():
        f = fallbacks[target]
        assert f.reason is reason, f.describe()
        assert f.source_line.startswith(f"{__file__}:{_line_of(code)} ("), f.source_line
        assert code in f.source_line
    assert "boolean" in fallbacks["aten.index_put.default"].detail
    assert "u0" in fallbacks["aten.nonzero.default"].detail
    # Linear, relu, compare, clone, softmax... run in JAX, around the fallbacks.
    assert len(graph.partitions) >= 2 and report.fraction_in_jax > 0.7
    # Only the custom op could gain from a new rule.
    assert [w.op for w in report.what_if()] == ["dynajax_mixtest.soft_clip.default"]
    text = report.text(width=None)
    for target in expected:
        assert target in text
    dot = report.to_dot()
    assert "NO_LOWERING" in dot and "DATA_DEPENDENT_SHAPE" in dot
