"""Runs in subprocesses of tests/test_features_together.py: dynajax's features one
after another in one process, as a script that trains and then serves runs them.

python -m tests.features_worker train_step,backend,jax_function,export,explain
    first compiles a sentinel model with the backend (a forward that adds two
    ``ModuleList``s, as diffusers' up blocks do: ``ModuleList.__add__`` registers
    modules inside the compiled forward), then runs each feature in the order given,
    each against eager, and calls the sentinel again after each. Prints one JSON line:
    each feature's compiles, and the sentinel's graphs compiled after each feature.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable

import jax
import numpy as np
import torch
from torch import nn
from torch._dynamo.utils import counters

import dynajax
from tests.models import cnn, mlp
from tests.tolerances import assert_same


class _Added(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList([nn.Linear(4, 4)])
        self.b = nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.a + self.b:  # registers both layers in a new ModuleList
            x = layer(x)
        return x


class _Blocks(nn.Module):
    """Another forward that adds ``ModuleList``s (the backend feature's own code)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList([nn.Linear(4, 8), nn.ReLU()])
        self.up = nn.ModuleList([nn.Linear(8, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.down + self.up:
            x = layer(x)
        return x.tanh()


def _torch(a: object) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _compiled_graphs(calls: Callable[[], None]) -> int:
    before = _graphs()
    calls()
    return _graphs() - before


def train_step() -> int:
    """Three steps of an MLP against the eager loop; the programs traced."""
    torch.manual_seed(0)
    model = mlp(8, 16, 4)
    twin = copy.deepcopy(model)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(m(x), y)

    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    step = dynajax.train_step(model, opt, loss_fn)
    for _ in range(3):
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        twin_opt.zero_grad()
        expected = loss_fn(twin, x, y)
        expected.backward()
        twin_opt.step()
        assert_same(_torch(step(x, y)), expected.detach())
    step.sync()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert_same(p.detach(), q.detach())
    return step.traces


def backend() -> int:
    """A model whose forward adds ``ModuleList``s, four calls; its graphs compiled."""
    model = _Blocks()
    compiled = torch.compile(model, backend="dynajax")

    def calls() -> None:
        for _ in range(4):
            x = torch.randn(2, 4)
            assert_same(compiled(x), model(x))

    return _compiled_graphs(calls)


def jax_function() -> int:
    """A CNN as a JAX function under ``jax.jit``, called twice; its traces."""
    torch.manual_seed(0)
    model = cnn().eval()
    x = torch.randn(2, 3, 16, 16)
    fn, state = dynajax.jax_function(model, x)
    traces = [0]

    def counted(state, x):  # type: ignore[no-untyped-def]
        traces[0] += 1
        return fn(state, x)

    run = jax.jit(counted)
    for _ in range(2):
        x = torch.randn(2, 3, 16, 16)
        with torch.no_grad():
            expected = model(x)
        assert_same(_torch(run(state, x.numpy())), expected)
    return traces[0]


def export() -> int:
    """An MLP exported as StableHLO and called; one program."""
    torch.manual_seed(0)
    model = mlp(8, 16, 4).eval()
    x = torch.randn(3, 8)
    exported = dynajax.export(model, x)
    with torch.no_grad():
        assert_same(_torch(exported.call(x.numpy())), model(x))
    return 1


def explain() -> int:
    """The report of a CNN; the graphs it compiled."""
    torch.manual_seed(0)
    model = cnn().eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        report = dynajax.explain(model, x)
    assert report.fraction_in_jax == 1.0, report.text(width=None)
    return len(report.graphs)


FEATURES: dict[str, Callable[[], int]] = {
    f.__name__: f for f in (train_step, backend, jax_function, export, explain)
}


def main(order: list[str]) -> None:
    sentinel = _Added()
    compiled = torch.compile(sentinel, backend="dynajax")

    def call_sentinel() -> None:
        x = torch.randn(2, 4)
        assert_same(compiled(x), sentinel(x))

    first = _compiled_graphs(call_sentinel)
    compiles: dict[str, int] = {}
    sentinel_after: dict[str, int] = {}
    for name in order:
        compiles[name] = FEATURES[name]()
        sentinel_after[name] = _compiled_graphs(call_sentinel)
    print(json.dumps({"sentinel_first": first, "compiles": compiles, "sentinel": sentinel_after}))


if __name__ == "__main__":
    main(sys.argv[1].split(","))
