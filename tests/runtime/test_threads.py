"""Under load from threads: a compiled model called from 16 threads at once (its first,
compiling call included), and different models compiled from several threads at once.
No crash, no deadlock, and every answer is the eager answer."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import dynajax
from dynajax.lowering.interpreter import lower_partition
from dynajax.runtime.compiled import CompiledPartition
from dynajax.runtime.conversion import fast_to_jax, zero_copy_array
from dynajax.runtime.inputs import InputCache
from dynajax.sharding.placement import crossing
from tests.helpers import report_of
from tests.models import cnn, mlp
from tests.tolerances import assert_same

THREADS = 16
CALLS = 8
TIMEOUT_S = 300


@torch.library.custom_op("dynajax_threadtest::soft_sign", mutates_args=())
def soft_sign(x: torch.Tensor) -> torch.Tensor:
    """An op with no JAX rule: it runs in eager PyTorch between two JAX partitions."""
    return x / (1 + x.abs())


@soft_sign.register_fake
def _(x):
    return torch.empty_like(x)


def _soft_sign_context(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _soft_sign_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad / (1 + x.abs()) ** 2


soft_sign.register_autograd(_soft_sign_backward, setup_context=_soft_sign_context)


class Deep(nn.Module):
    """Three layers (seven inputs: the partition's fast path for all-cached inputs)."""

    def __init__(self, fallback: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        self.fallback = fallback

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = soft_sign(h) if self.fallback else h
        return self.c(torch.relu(self.b(h)))


def _in_threads(work: Callable[[int], None], n: int) -> None:
    """Runs ``work(i)`` for i < n in n threads started together; re-raises the first
    failure, and fails (instead of hanging) if a thread is still running at the end."""
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            start.wait()
            work(i)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"{len(stuck)} thread(s) still running after {TIMEOUT_S} s: a deadlock"
    if errors:
        raise errors[0]


def _partition() -> tuple[Any, list[torch.Tensor]]:
    """A CompiledPartition of a three-layer MLP's ATen graph, not compiled yet, and
    its weights."""

    def f(x, w1, b1, w2, b2, w3):
        return ((torch.tanh(x @ w1 + b1) @ w2 + b2).relu() @ w3,)

    weights = [torch.randn(16, 32), torch.randn(32), torch.randn(32, 32), torch.randn(32)]
    weights.append(torch.randn(32, 8))
    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 16), *weights)
    lowered = lower_partition("jax_0", gm)
    return (CompiledPartition(lowered, crossing=crossing(lowered)), f), weights


def test_input_cache_refreshes_racing_give_every_argument() -> None:
    # Regression: the positions converted per call were read from the cache, not from
    # the snapshot whose arrays a call copied. A first call that refreshed the cache
    # late (from no snapshot: it cached its activation) overwrote them while another
    # thread was between the two reads, whose argument then stayed None. Thread
    # switches as often as possible make that window show within a few hundred rounds.
    weights = [torch.randn(8, 8) for _ in range(5)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(200):
            cache = InputCache(6, fast_to_jax, zero_copy_array)
            xs = [torch.randn(3) for _ in range(8)]

            def work(i: int, cache: InputCache = cache, xs: list[torch.Tensor] = xs) -> None:
                for _ in range(10):
                    x, *rest = cache.arrays([xs[i], *weights])
                    assert x is not None and all(a is not None for a in rest)
                    assert np.array_equal(np.asarray(x), xs[i].numpy())

            _in_threads(work, 8)
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("inputs", ["own", "shared", "mixed"])
def test_partition_first_calls_from_16_threads(inputs) -> None:
    # The partition's first call (XLA compile, input cache, fast path) races too: every
    # thread calls it before any call has finished. "own": each thread its own input
    # (activations converted per call); "shared": one input for all (every input
    # cached: the direct path); "mixed": four inputs among sixteen threads.
    torch.manual_seed(0)
    (part, f), weights = _partition()
    n = {"own": THREADS, "shared": 1, "mixed": 4}[inputs]
    xs = [torch.randn(4, 16) for _ in range(n)]
    expected = [f(x, *weights)[0] for x in xs]

    def work(i: int) -> None:
        k = i % n
        for _ in range(CALLS):
            [out] = part(xs[k], *weights)
            assert_same(out, expected[k])

    _in_threads(work, THREADS)
    assert part.stats.xla_compiles == 1


@pytest.mark.parametrize("fallback", [False, True], ids=["jax-only", "fallback-between"])
@pytest.mark.parametrize("inputs", ["own", "shared"])
@pytest.mark.parametrize("cache", ["no-cache", "cache"])
def test_compiled_model_from_16_threads(tmp_path, fallback, inputs, cache) -> None:
    # "own": every thread its own inputs; "shared": one input tensor for all.
    torch.manual_seed(0)
    model = Deep(fallback).eval()
    xs = [torch.randn(4, 16) for _ in range(THREADS)] if inputs == "own" else [torch.randn(4, 16)]
    with torch.no_grad():
        expected = [model(x) for x in xs]
    backend = dynajax.Backend(cache_dir=str(tmp_path) if cache == "cache" else "")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        assert_same(compiled(xs[0]), expected[0])  # Dynamo compiles (see the cold test)

    def work(i: int) -> None:
        k = i % len(xs)
        with torch.no_grad():
            for _ in range(CALLS):
                assert_same(compiled(xs[k]), expected[k])

    _in_threads(work, THREADS)
    report = report_of(backend)
    assert len(report.graphs) == 1
    assert len(report.partitions) == (2 if fallback else 1)
    if fallback:
        [f] = report.fallbacks
        assert f.target == "dynajax_threadtest.soft_sign.default"


def test_cold_compiled_model_from_16_threads() -> None:
    # No call before the threads: Dynamo itself compiles the frame several times when
    # threads enter it together (with any backend, "eager" included: its guards fail
    # while another thread compiles; pytorch/pytorch#123177), up to its recompile
    # limit, after which it runs the frame eagerly. Each answer is still eager's.
    torch.manual_seed(0)
    model = Deep(fallback=True).eval()
    xs = [torch.randn(4, 16) for _ in range(THREADS)]
    with torch.no_grad():
        expected = [model(x) for x in xs]
    backend = dynajax.Backend()
    compiled = torch.compile(model, backend=backend)

    def work(i: int) -> None:
        with torch.no_grad():
            for _ in range(CALLS):
                assert_same(compiled(xs[i]), expected[i])

    _in_threads(work, THREADS)
    report = report_of(backend)
    assert len(report.graphs) >= 1
    assert len(report.partitions) == 2 * len(report.graphs)


def _training_threads(warm: bool, backend: dynajax.Backend) -> None:
    """16 threads, each taking input gradients through the compiled model 3 times."""
    torch.manual_seed(0)
    model = Deep(fallback=True)
    xs = [torch.randn(4, 16) for _ in range(THREADS)]
    expected = []
    for x in xs:
        x = x.clone().requires_grad_()
        model(x).square().sum().backward()
        expected.append(x.grad)
    compiled = torch.compile(model, backend=backend)
    if warm:  # Dynamo and aot_autograd compile the forward and backward here
        x = xs[0].clone().requires_grad_()
        torch.autograd.grad(compiled(x).square().sum(), [x])

    def work(i: int) -> None:
        for _ in range(3):
            x = xs[i].clone().requires_grad_()
            (grad,) = torch.autograd.grad(compiled(x).square().sum(), [x])
            assert_same(grad, expected[i])

    _in_threads(work, THREADS)


def test_training_steps_from_16_threads() -> None:
    # Forward and backward graphs compiled first: the threads only call them.
    _training_threads(warm=True, backend=dynajax.Backend())


def test_training_steps_compiled_from_16_threads_at_once() -> None:
    # Regression: the threads enter the frame together, so Dynamo compiles it several
    # times (see the cold test above) while other threads run the first calls of
    # partitions it compiled already. A first call traces the partition through a
    # torch.fx.Interpreter, which wrote torch.fx's process-wide current node meta while
    # another thread's aot_autograd joint trace had node-meta preservation on: that
    # trace failed ("Expected current_level > 0") or built a backward whose partition
    # was handed None. Thread switches as often as possible make it show every round.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(2):
            torch._dynamo.reset()
            # No persistent cache: every partition traces at its first call.
            _training_threads(warm=False, backend=dynajax.Backend(cache_dir=""))
    finally:
        sys.setswitchinterval(interval)


def test_lowering_leaves_torch_fx_current_meta_alone(monkeypatch) -> None:
    # The cause of the regression above, deterministically: tracing a partition while
    # node-meta preservation is on (as another thread's joint trace turns it on) never
    # sets torch.fx's process-wide current node meta.
    from torch.fx import traceback as fx_traceback

    from dynajax.lowering.interpreter import to_jax_function

    (part, f), weights = _partition()
    calls: list[Any] = []
    original = fx_traceback.set_current_meta

    def spy(node: Any, *args: Any) -> Any:
        calls.append(node)
        return original(node, *args)

    monkeypatch.setattr(fx_traceback, "set_current_meta", spy)
    x = torch.randn(4, 16)
    arrays = [np.asarray(t) for t in (x, *weights)]
    with fx_traceback.preserve_node_meta():
        (out,) = to_jax_function(part.graph_module)(*arrays)
    assert calls == []
    assert_same(torch.from_numpy(np.asarray(out)), f(x, *weights)[0])


def test_dynamic_shapes_from_16_threads() -> None:
    # Every thread its own batch size: the executables' LRU is shared by the threads
    # and smaller than the number of sizes, so compiles and evictions race.
    torch.manual_seed(0)
    model = mlp().eval()
    xs = [torch.randn(1 + i, 32) for i in range(THREADS)]
    with torch.no_grad():
        expected = [model(x) for x in xs]
    backend = dynajax.Backend(max_executables=4)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        assert_same(compiled(xs[0]), expected[0])  # Dynamo compiles (see the cold test)

    def work(i: int) -> None:
        with torch.no_grad():
            for _ in range(3):
                assert_same(compiled(xs[i]), expected[i])

    _in_threads(work, THREADS)


def _models() -> list[tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    return [
        (mlp().eval(), (torch.randn(8, 32),)),
        (cnn().eval(), (torch.randn(2, 3, 16, 16),)),
        (Deep(fallback=True).eval(), (torch.randn(4, 16),)),
        (Deep(fallback=False).eval(), (torch.randn(4, 16),)),
        (
            nn.Sequential(nn.LayerNorm(24), nn.GELU(), nn.Linear(24, 6)).eval(),
            (torch.randn(5, 24),),
        ),
        (nn.Sequential(nn.Conv1d(4, 6, 3), nn.Tanh()).eval(), (torch.randn(2, 4, 10),)),
    ]


@pytest.mark.parametrize("backends", ["one-backend", "a-backend-each"])
def test_different_models_compiled_from_threads_at_once(tmp_path, backends) -> None:
    models = _models()
    with torch.no_grad():
        expected = [m(*args) for m, args in models]
    shared = dynajax.Backend(cache_dir=str(tmp_path))
    used: list[Any] = [None] * len(models)

    def work(i: int) -> None:
        model, args = models[i]
        backend = shared if backends == "one-backend" else dynajax.Backend(cache_dir=str(tmp_path))
        used[i] = backend
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            for _ in range(3):
                assert_same(compiled(*args), expected[i], model=True)

    _in_threads(work, len(models))
    graphs = [g for b in {id(b): b for b in used}.values() for g in b.graphs]
    assert len(graphs) >= len(models)  # more where Dynamo recompiled (see the cold test)
