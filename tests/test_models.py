"""End to end: real models through torch.compile(backend="dynajax") match eager, with
at least 95% of their ATen ops in JAX.

Every op's lowering is the point here, so the cost choices measured at the first
compile come out XLA-faster (``measured_faster``: the measuring runs, its times are
fixed): on a CPU where oneDNN's convolution wins, the convolutions would otherwise run
in PyTorch and their rules go untested. The measured choices as a user's CPU makes
them, on real models, are ``tests/test_pipelines.py``'s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dynajax
from tests import models
from tests.helpers import measured_faster
from tests.tolerances import assert_same


def _run(model: nn.Module, *args: torch.Tensor) -> dynajax.Report:
    model.eval()
    backend = dynajax.Backend()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), measured_faster("xla"):
        expected = model(*args)
        actual = compiled(*args)
    assert_same(actual, expected, model=True)
    report = dynajax.Report(backend.graphs)
    assert report.graphs, "dynajax compiled nothing"
    return report


CASES = {
    "mlp": lambda: (models.mlp(), torch.randn(4, 32)),
    "cnn": lambda: (models.cnn(), torch.randn(2, 3, 16, 16)),
    "conv-mix": lambda: (models.conv_mix(), torch.randn(2, 3, 16, 16)),
    "encoder-relu": lambda: (
        nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
        torch.randn(2, 10, 32),
    ),
    "encoder-gelu-norm-first": lambda: (
        nn.TransformerEncoderLayer(32, 4, 64, activation="gelu", norm_first=True, batch_first=True),
        torch.randn(2, 10, 32),
    ),
    "gpt2": lambda: (models.gpt2(), models.tokens(2, 16)),
    "bert": lambda: (models.bert(), models.tokens(2, 16)),
    "llama": lambda: (models.llama(), models.tokens(2, 16)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_model_matches_eager(name: str) -> None:
    torch.manual_seed(0)
    model, x = CASES[name]()
    report = _run(model, x)
    assert report.fraction_in_jax >= 0.95, report.text(width=None)


ZOO = models.transformers_zoo()

# What stays in PyTorch, by design: nothing. (transformers computes a mixture of
# experts' grouped matmul in a custom op of its own when Dynamo traces float32 weights;
# dynajax ships its rule, lowering/transformers_ops.py, so Mixtral runs all in JAX.)
ZOO_FALLBACKS: dict[str, set[str]] = {}


@pytest.mark.parametrize("name", list(ZOO))
def test_transformers_architecture_matches_eager(name: str) -> None:
    torch.manual_seed(0)
    build, inputs = ZOO[name]
    model, kwargs = build().eval(), inputs()
    backend = dynajax.Backend()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), measured_faster("xla"):
        expected = model(**kwargs)
        actual = compiled(**kwargs)
    assert_same(actual, expected, model=True)
    report = dynajax.Report(backend.graphs)
    assert report.graphs, "dynajax compiled nothing"
    assert {str(f.target) for f in report.fallbacks} == ZOO_FALLBACKS.get(name, set()), report.text(
        width=None
    )


@pytest.mark.parametrize("name", ["gpt2", "llama", "conv-mix"])
def test_autocast_bfloat16_matches_eager(name: str) -> None:
    # torch.autocast's casts are in the ATen graph aot_autograd hands over (_to_copy
    # around each matmul and convolution): they run in JAX like any other op.
    torch.manual_seed(0)
    model, x = CASES[name]()
    model.eval()
    backend = dynajax.Backend()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), measured_faster("xla"):
        expected = model(x)
        actual = compiled(x)
    assert_same(actual, expected, model=True)
    report = dynajax.Report(backend.graphs)
    assert report.fraction_in_jax == 1.0, report.text(width=None)
    assert any("_to_copy" in op for p in report.partitions for op in p.ops)


def test_encoder_layer_in_training_mode_graph_under_no_grad() -> None:
    # Not eval: PyTorch skips the fused fast path, dropout p=0 keeps it deterministic.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    x = torch.randn(2, 10, 32)
    compiled = torch.compile(layer, backend="dynajax")
    with torch.no_grad():
        assert_same(compiled(x), layer(x), model=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_mlp_keeps_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = models.mlp().to(dtype)
    x = torch.randn(4, 32, dtype=dtype)
    out = _run(model, x)
    assert out.fraction_in_jax == 1.0


def test_int64_past_int32_range() -> None:
    def f(a, b):
        return a * b + 3, (a // 7) % 5

    a = torch.tensor([2**40, -(2**35) - 3, 7], dtype=torch.int64)
    b = torch.tensor([3, 5, -(2**33)], dtype=torch.int64)
    backend = dynajax.Backend()
    assert_same(torch.compile(f, backend=backend)(a, b), f(a, b))
    assert not dynajax.Report(backend.graphs).fallbacks
