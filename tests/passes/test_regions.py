"""Regions the user marked with ``torch.compiler.nested_compile_region`` (torch's
``invoke_subgraph``): each call runs as the region's own ops in JAX, forward and
backward, with eager's answer; an op of the region with no rule is the only part kept
in PyTorch."""

from __future__ import annotations

import torch
from torch import nn

from dynajax.passes.regions import is_region_call
from tests.helpers import (
    assert_no_fallbacks,
    compile_with,
    param_grads,
    report_of,
)
from tests.models import gpt2
from tests.tolerances import assert_same


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, depth: int = 4, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.tanh().sum()


def _region_calls_seen(monkeypatch) -> list[int]:
    """The region calls in each ATen graph as it reaches dynajax's passes."""
    import dynajax.passes.pipeline as pipeline

    seen: list[int] = []
    original = pipeline.run_pass_list

    def counting(gm, *args, **kwargs):
        seen.append(sum(is_region_call(n) for n in gm.graph.nodes))
        return original(gm, *args, **kwargs)

    monkeypatch.setattr(pipeline, "run_pass_list", counting)
    return seen


def test_marked_region_runs_in_jax_forward_and_backward(monkeypatch):
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(8, 16, requires_grad=True)
    seen = _region_calls_seen(monkeypatch)
    compiled, backend = compile_with(model)
    out = compiled(x)
    out.backward()
    got = (out.detach(), x.grad.clone(), param_grads(model))
    x.grad = None
    model.zero_grad()
    ref = model(x)
    ref.backward()
    assert_same(got, (ref.detach(), x.grad, param_grads(model)))
    # The forward and backward graphs each called the region 4 times, and every op of
    # both ran in one JAX partition.
    assert seen == [4, 4], seen
    report = report_of(backend)
    assert_no_fallbacks(report)
    assert [len(g.partitions) for g in report.graphs] == [1, 1]
    assert report.graphs[0].partitions[0].ops["aten.addmm.default"] == 8
    # The report names each graph's region and counts its calls.
    assert [len(g.regions) for g in report.graphs] == [1, 1]
    assert [sum(g.regions.values()) for g in report.graphs] == [4, 4]
    text = report.text(width=None)
    assert "regions traced once (torch.compiler.nested_compile_region)" in text
    assert f"{next(iter(report.graphs[0].regions))} x4" in text


class Outer(nn.Module):
    """A marked region that calls another marked region."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList(Block() for _ in range(2))

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.inner:
            x = block(x)
        return x * 2


def _inference_report(*blocks: nn.Module):
    """The report of ``blocks`` in sequence compiled, after asserting eager's answer."""
    model = nn.Sequential(*blocks)
    x = torch.randn(4, 16)
    compiled, backend = compile_with(model)
    with torch.no_grad():
        assert_same(compiled(x), model(x))
    return report_of(backend)


def test_region_inside_a_region_is_inlined_with_it():
    torch.manual_seed(0)
    report = _inference_report(Outer(), Outer())
    assert_no_fallbacks(report)
    assert report.graphs[0].partitions[0].ops["aten.addmm.default"] == 8


@torch.library.custom_op("dynajax_regiontest::shift", mutates_args=())
def shift(x: torch.Tensor) -> torch.Tensor:
    return x + 0.5


@shift.register_fake
def _(x):
    return torch.empty_like(x)


class ShiftedBlock(Block):
    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return shift(x) + self.down(torch.relu(self.up(x)))


def test_an_op_of_the_region_without_a_rule_is_all_that_stays_in_pytorch():
    torch.manual_seed(0)
    report = _inference_report(ShiftedBlock(), ShiftedBlock())
    kept = sorted(v.target for v in report.fallbacks)
    assert kept == ["dynajax_regiontest.shift.default"] * 2, report.text(width=None)
    assert sum(p.ops["aten.addmm.default"] for p in report.graphs[0].partitions) == 4


def test_gpt2_with_its_blocks_marked_gives_eager_answer(monkeypatch):
    torch.manual_seed(0)
    model = gpt2(layers=3).eval()
    block = type(model.transformer.h[0])
    monkeypatch.setattr(block, "forward", torch.compiler.nested_compile_region(block.forward))
    ids = torch.randint(0, 128, (2, 16))
    seen = _region_calls_seen(monkeypatch)
    compiled, backend = compile_with(model)
    with torch.no_grad():
        assert_same(compiled(ids).logits, model(ids).logits, model=True)
    assert seen == [3], seen
    assert_no_fallbacks(backend)


class DropoutBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        with torch.no_grad():
            self.linear.weight.copy_(torch.eye(width))
            self.linear.bias.zero_()

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.linear(x), 0.5, training=True)


def test_each_call_of_a_region_draws_its_own_dropout_mask():
    # Identity layers on ones: an element survives three calls only where all three
    # masks keep it (1/8 of them, each 2**3), where one shared mask would keep 1/2.
    model = nn.Sequential(*(DropoutBlock(64) for _ in range(3)))
    x = torch.ones(64, 64, requires_grad=True)
    compiled, _ = compile_with(model)
    torch.manual_seed(0)
    out = compiled(x)
    out.sum().backward()
    kept = out != 0
    assert set(out[kept].tolist()) == {8.0}
    assert 0.09 < kept.float().mean().item() < 0.16
    # The backward multiplies by the forward's masks; the same seed draws them again.
    assert torch.equal(x.grad != 0, kept)
    torch.manual_seed(0)
    assert torch.equal(compiled(x), out)
