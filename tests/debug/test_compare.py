"""dynajax.debug.compare names the node whose JAX rule makes a model drift from eager.

Bugs are planted through the public registration API (``dynajax.register_rule`` with
``override=True``): a rule that is slightly wrong (off by 0.1% to 1%), in a GPT-2's
forward graph and in its backward graph; the debugger must name exactly that node, its
op, its partition and the user's source line. A custom op whose eager kernel rounds
coarsely shows the float64 criterion clearing a rule that only rounds differently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import pytest
import torch
from torch import nn

import dynajax
from dynajax.debug import Finding
from dynajax.debug.recording import RecordingPartition
from dynajax.lowering.registry import get_rule
from dynajax.runtime.compiled import CompiledPartition
from tests.models import gpt2, tokens

aten = torch.ops.aten
NO_CACHE = {"cache_dir": ""}  # executables of planted rules never reach other tests


@contextlib.contextmanager
def planted(op: torch._ops.OpOverload, factor: float) -> Iterator[None]:
    """``op``'s built-in rule, its result scaled by ``factor`` (a wrong rule), for the
    duration of the block."""
    builtin = get_rule(op)
    assert builtin is not None

    def wrong(*args: Any, **kwargs: Any) -> Any:
        return builtin.fn(*args, **kwargs) * factor

    with pytest.warns(dynajax.RuleOverrideWarning):
        dynajax.register_rule(op, override=True)(wrong)
    try:
        yield
    finally:
        dynajax.unregister_rule(op)
        torch._dynamo.reset()


def small_gpt2() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return gpt2(layers=1, width=32, heads=2, vocab=64).eval(), tokens(2, 8, vocab=64)


class Block(nn.Module):
    """A small model of our own: layer norm, GELU, softmax, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(nn.functional.gelu(self.up(self.norm(x))))
        return (x + h).softmax(-1)


def test_a_correct_model_gives_a_clean_report() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16, requires_grad=True)
    report = dynajax.debug.compare(
        Block(), x, backward=True, loss=lambda out: (out * out).mean(), options=NO_CACHE
    )
    assert report.clean, str(report)
    assert report.first is None
    assert report.outputs is not None and report.outputs.within
    assert set(report.gradients) == {
        "norm.weight",
        "norm.bias",
        "up.weight",
        "up.bias",
        "down.weight",
        "down.bias",
        "input[0]",
    }
    assert all(g.within for g in report.gradients.values())
    kinds = {p.kind for p in report.partitions}
    assert kinds == {"forward", "backward"}, str(report)
    assert all(
        p.nodes > 0 and p.outputs is not None and p.outputs.within for p in report.partitions
    )
    assert "matches eager" in str(report)


def test_planted_forward_bug_in_gpt2_is_named_with_its_line() -> None:
    model, ids = small_gpt2()
    with planted(aten.tanh.default, 1.001):  # GPT-2's gelu_new is the only tanh
        report = dynajax.debug.compare(model, ids, options=NO_CACHE)
    first = report.first
    assert first is not None, str(report)
    assert first.op is aten.tanh.default
    assert first.node == "tanh"  # the first of the graph's tanh nodes
    assert (first.kind, first.partition) == ("inference", "jax_0")
    assert first.inputs == ["float32[2, 8, 128]"]
    assert first.finding is Finding.WRONG
    assert not first.error.within and first.error.max_rel == pytest.approx(1e-3, rel=0.01)
    assert first.distance_rule is not None and first.distance_eager is not None
    assert first.distance_rule > 100 * first.distance_eager
    assert "transformers/activations.py" in first.source_line
    assert "torch.tanh(" in first.source_line
    # every other node agrees with eager on its own inputs
    assert [m.node for m in report.mismatches] == ["tanh"]
    assert not report.clean
    text = str(report)
    assert "aten.tanh.default (node 'tanh') in graph 0 (inference) jax_0" in text
    assert "activations.py" in text


def test_planted_backward_bug_in_gpt2_is_named_in_the_backward_graph() -> None:
    model, ids = small_gpt2()
    # index_put (accumulate) is the embeddings' backward; no forward graph has it
    with planted(aten.index_put.default, 1.01):
        report = dynajax.debug.compare(model, ids, backward=True, options=NO_CACHE)
    first = report.first
    assert first is not None, str(report)
    assert first.op is aten.index_put.default
    assert (first.kind, first.node) == ("backward", "index_put")
    assert first.finding is Finding.WRONG
    # a backward node's line is the forward op it differentiates
    assert "modeling_gpt2.py" in first.source_line
    assert "self.wpe(position_ids)" in first.source_line
    assert {m.node for m in report.mismatches} == {"index_put", "index_put_1"}
    assert all(m.kind == "backward" for m in report.mismatches)
    bad = {name for name, g in report.gradients.items() if not g.within}
    assert bad == {"transformer.wte.weight", "transformer.wpe.weight"}, str(report)
    assert report.outputs is not None and report.outputs.within


# A custom op whose eager float32 kernel rounds its result through bfloat16 (accurate
# in float64): its exact JAX rule is farther than the tolerance from eager, yet closer
# to the float64 answer, so it rounds differently and is not to blame.
@torch.library.custom_op("dynajax_debug_test::coarse_exp", mutates_args=())
def coarse_exp(x: torch.Tensor) -> torch.Tensor:
    y = x.exp()
    return y.to(torch.bfloat16).to(x.dtype) if x.dtype == torch.float32 else y


@coarse_exp.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.fixture
def exact_exp_rule() -> Iterator[None]:
    dynajax.register_rule("dynajax_debug_test::coarse_exp")(jnp.exp)
    try:
        yield
    finally:
        dynajax.unregister_rule("dynajax_debug_test::coarse_exp")


def test_float64_criterion_clears_a_rule_that_rounds_differently(exact_exp_rule: None) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return coarse_exp(x * 0.5) + 1

    report = dynajax.debug.compare(fn, torch.randn(64), options=NO_CACHE)
    assert report.first is None, str(report)
    [rounding] = report.rounding
    assert rounding.op is torch.ops.dynajax_debug_test.coarse_exp.default
    assert rounding.finding is Finding.ROUNDING
    assert not rounding.error.within
    assert rounding.distance_rule is not None and rounding.distance_eager is not None
    assert rounding.distance_rule < rounding.distance_eager
    assert (
        "test_compare.py" in rounding.source_line and "coarse_exp(x * 0.5)" in rounding.source_line
    )
    assert report.outputs is not None and not report.outputs.within
    assert "rounds differently" in str(report)


def test_a_wrong_graph_pass_is_not_blamed_on_a_rule() -> None:
    def tanh_to_sigmoid(gm: torch.fx.GraphModule) -> None:  # a wrong user pass
        for node in gm.graph.nodes:
            if node.target is torch.tanh:
                node.target = torch.sigmoid
        gm.recompile()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * 2) + 1

    options = {**NO_CACHE, "passes": {"pre_aot": [tanh_to_sigmoid]}}
    report = dynajax.debug.compare(fn, torch.randn(16), options=options)
    assert report.first is None and report.mismatches == [], str(report)
    assert report.outputs is not None and not report.outputs.within
    assert all(p.outputs is not None and p.outputs.within for p in report.partitions)
    assert "comes from outside the partitions' rules" in str(report)


def test_recording_is_only_on_the_debuggers_backend() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() + 1).exp()

    x = torch.randn(8)
    backend = dynajax.Backend(**NO_CACHE)
    torch.compile(fn, backend=backend)(x)
    [graph] = backend.graphs
    assert type(graph.graph_module.jax_0) is CompiledPartition  # per-call path untouched
    torch._dynamo.reset()
    report = dynajax.debug.compare(fn, x, options=NO_CACHE)
    [graph] = report.report.graphs
    assert isinstance(graph.graph_module.jax_0, RecordingPartition)
    [call] = report.partitions
    assert (call.kind, call.partition, call.nodes) == ("inference", "jax_0", 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss": torch.sum}, TypeError, "needs backward=True"),
        ({"backward": True}, ValueError, "nothing to differentiate"),
    ],
    ids=["loss-without-backward", "backward-without-grads"],
)
def test_misuse_says_what_to_do(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    fn: Callable[[torch.Tensor], torch.Tensor] = torch.sin
    with pytest.raises(error, match=match):
        dynajax.debug.compare(fn, torch.randn(3), **kwargs)
