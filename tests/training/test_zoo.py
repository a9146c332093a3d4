"""One backward step of transformers architectures (tests/models.py's zoo) through
dynajax: loss and every parameter's gradient match eager, forward and backward graphs
in JAX, nothing in PyTorch (Mixtral's experts' grouped matmul and its backward are
transformers' own custom ops, lowered by dynajax/lowering/transformers_ops.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import dynajax
from tests.helpers import measured_faster
from tests.models import transformers_zoo

ZOO = transformers_zoo()
CASES = ["t5", "whisper", "mistral", "mixtral", "swin", "convnext", "mobilenet-v2"]
# transformers' own ops that must run in a JAX partition of the forward and backward.
CUSTOM_OPS = {
    "mixtral": {
        "transformers.grouped_mm_fallback.default",
        "transformers.grouped_mm_fallback_backward.default",
    }
}


def _loss(output) -> torch.Tensor:
    first = output[0] if isinstance(output, tuple) else next(iter(output.values()))
    return first.float().pow(2).mean()


@pytest.mark.parametrize("name", CASES)
def test_backward_step_matches_eager(name: str) -> None:
    build, inputs = ZOO[name]
    torch.manual_seed(0)
    eager = build().eval()  # eval: no dropout, so both sides compute the same function
    model = copy.deepcopy(eager)
    kwargs = inputs()
    backend = dynajax.Backend(cache_dir="")
    expected = _loss(eager(**kwargs))
    expected.backward()
    with measured_faster("xla"):  # (each op's backward in JAX is the point, on any CPU)
        actual = _loss(torch.compile(model, backend=backend)(**kwargs))
        actual.backward()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)

    # Gradients are compared at the scale of the largest one: some are zero in exact
    # arithmetic (an attention key bias shifts every score of a row alike, which softmax
    # ignores) and hold only rounding noise, on both sides.
    scale = max(p.grad.abs().max() for p in eager.parameters() if p.grad is not None)
    for (pname, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        if p.grad is None:
            # Outside the loss's graph (an unused pooler): eager leaves no gradient,
            # torch.compile (any backend: aot_autograd's) a zero one.
            assert q.grad is None or not q.grad.any(), pname
            continue
        assert q.grad is not None, pname
        err = (q.grad - p.grad).abs().max()
        assert err <= 1e-5 * scale, f"{pname}: {err:.3g} off (largest gradient {scale:.3g})"

    report = dynajax.Report(backend.graphs)
    assert {g.kind for g in report.graphs} == {"forward", "backward"}, report.text(width=None)
    assert report.fallbacks == [], report.text(width=None)
    in_jax = {op for g in report.graphs for p in g.partitions for op in p.ops}
    assert CUSTOM_OPS.get(name, set()) <= in_jax, report.text(width=None)
