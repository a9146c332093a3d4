"""Tensors on the device eager gives them, on every device this machine has.

CI runs the CPU cases; a machine with a GPU runs each case on CUDA as well
(``python -m pytest tests/runtime/test_devices.py``). PyTorch lets a 0-dim CPU tensor
meet a GPU's tensors in one op (as a scalar): such a partition runs on the GPU, takes
the CPU tensor there per call, and hands back on the CPU what eager gives on the CPU.
A graph with no tensor inputs runs where its outputs live.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dynajax
from tests.tolerances import assert_same

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def _both(fn, *args):
    backend = dynajax.Backend()
    got = torch.compile(fn, backend=backend)(*args)
    return got, fn(*args), backend


def _same_placed(got, want) -> None:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert [g.device for g in got] == [w.device for w in want]
    assert [g.dtype for g in got] == [w.dtype for w in want]
    assert_same(list(got), list(want))


def test_cpu_scalar_beside_device_tensors(device) -> None:
    x = torch.randn(4, 8, device=device)
    scale, step = torch.tensor(2.5), torch.tensor(3, dtype=torch.int64)

    def f(x, scale, step):
        return x * scale + step, step + 1, (step * 2).double()

    for s in (scale, torch.tensor(-0.5)):  # a new CPU tensor: crosses per call
        got, want, backend = _both(f, x, s, step)
        _same_placed(got, want)
    assert not dynajax.Report(backend.graphs).fallbacks


def test_graph_without_tensor_inputs_gives_eager_devices(device) -> None:
    def f(n: int):
        return torch.arange(n, device=device) * 2, torch.ones(3, dtype=torch.float64)

    got, want, _ = _both(f, 5)
    _same_placed(got, want)


def test_model_forward_backward_and_buffers(device) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model).to(device)
    model = model.to(device)
    x = torch.randn(32, 8, device=device)
    compiled = torch.compile(model, backend="dynajax")
    got, want = compiled(x), ref(x)
    got.square().mean().backward()
    want.square().mean().backward()
    _same_placed(got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        # (device types: torch.device("cuda") != torch.device("cuda:0"))
        assert p.grad is not None and p.grad.device.type == device.type, name
        assert_same([p.grad], [q.grad])
    for b, c in zip(model.buffers(), ref.buffers(), strict=True):  # running stats
        assert b.device.type == device.type
        assert_same([b], [c])


def test_exact_dtypes_on_device(device) -> None:
    a = torch.arange(-6, 6, device=device, dtype=torch.int64) * (2**40)
    b = torch.linspace(-1, 1, 12, device=device, dtype=torch.float64)

    def f(a, b):
        return a // 3 + 1, b * 1e-300, (a.double() * b).sum()

    got, want, _ = _both(f, a, b)
    _same_placed(got, want)
    assert torch.equal(got[0], want[0])


def test_training_steps_see_the_optimizers_writes(device) -> None:
    """Steps of a compiled model with an eager optimizer between them: on a GPU, the
    parameters written in place by the optimizer (on torch's stream) are kept as arrays
    and fenced, and the forward's activations reach the backward as JAX's own arrays.
    Every step's loss, gradients, parameters and buffers are eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    ref = copy.deepcopy(model).to(device)
    model = model.to(device)
    compiled = torch.compile(model, backend="dynajax")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for step in range(4):
        x = torch.randn(16, 8, device=device)
        losses = []
        for fn, opt in zip((compiled, ref), opts, strict=True):
            opt.zero_grad()
            loss = fn(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert_same([losses[0]], [losses[1]])
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert_same([p], [q])
        with torch.no_grad():  # a write of the user's between steps
            model[0].bias.add_(0.01 * step)
            ref[0].bias.add_(0.01 * step)
    for b, c in zip(model.buffers(), ref.buffers(), strict=True):
        assert_same([b], [c])


def test_lean_crossings_are_taken(device) -> None:
    """JAX's own DLPack importer and exporter, not the public functions' Python, on
    every device present: a fallback here would be silent (only slower)."""
    import jax

    from dynajax.runtime import conversion

    assert conversion.jax_importer(device) is not jax.dlpack.from_dlpack
    assert conversion.torch_importer(device) is not conversion.dlpack_to_torch
    t = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)
    a = conversion.jax_importer(device)(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    back = conversion.torch_importer(device)(a * 2)
    assert back.device.type == device.type and torch.equal(back, t * 2)


def test_kv_cache_rows_written_back_on_device(device) -> None:
    """A decode step's cache update, written back as the rows it changed
    (``passes/writes.py``): on a GPU the rows and the computed index are results of the
    partition, and the in-place ``index_copy_`` runs on torch's stream after them; a new
    cache object per generation is cached again once it stays (``InputCache._probe``)."""

    def step(cache, counter, x, w):
        pos = torch.arange(x.shape[0], device=x.device) + counter
        counter.add_(x.shape[0])
        cache.index_copy_(0, pos, x @ w)
        return cache.sum(0)

    backend = dynajax.Backend()
    compiled = torch.compile(step, backend=backend)
    w = torch.randn(4, 4, device=device)
    for generation in range(2):
        states = [
            (torch.zeros(40, 4, device=device), torch.zeros((), dtype=torch.int64, device=device))
            for _ in range(2)
        ]
        for i in range(36):
            x = torch.full((1, 4), float(generation * 50 + i), device=device)
            got, want = compiled(*states[0], x, w), step(*states[1], x, w)
            assert_same(got, want)
            assert_same(list(states[0]), list(states[1]))
    assert not dynajax.Report(backend.graphs).fallbacks
