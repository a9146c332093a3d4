"""aot_autograd's training graphs, cached across processes (aot/rebuild.py).

A second compile of the same Dynamo graph with the same inputs' metadata loads the
forward and backward ATen graphs and aot_autograd's structures instead of running
aot_autograd, and rebuilds its autograd.Function with aot_autograd's own code: every
training step after that must be eager's (losses, gradients, parameters, buffers
written in place). What cannot be recorded or rebuilt is traced, and the report says
why.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from dynajax.aot import rebuild as aot_rebuild
from tests.helpers import compile_with, run_python
from tests.models import cnn, mlp
from tests.tolerances import assert_same

STORED = "traced and stored in the cache (cache miss: not cached yet)"
LOADED = "loaded from the cache (not traced)"


def _compile(cache_dir, fn):
    torch._dynamo.reset()
    return compile_with(fn, cache_dir=str(cache_dir))


def _aot(backend) -> list[tuple[str, str]]:
    return [(g.kind, g.aot) for g in backend.graphs]


def _train(model: nn.Module, step_fn, x: torch.Tensor, steps: int = 3) -> list[dict]:
    """Losses, gradients, parameters and buffers after each SGD step of ``step_fn``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen = []
    for _ in range(steps):
        loss = step_fn(x).square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        seen.append({"loss": loss.detach(), "grads": grads, "state": state})
    return seen


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        pytest.param(mlp, (8, 32), id="mlp"),
        # batch norm in training mode: running statistics written back in place
        pytest.param(cnn, (4, 3, 16, 16), id="batchnorm-cnn"),
    ],
)
def test_warm_training_steps_load_both_graphs_and_match_eager(
    tmp_path, aot_runs, make, shape
) -> None:
    torch.manual_seed(0)
    model = make().train()
    x = torch.randn(*shape)
    eager = copy.deepcopy(model)
    want = _train(eager, eager, x)
    for status in (STORED, LOADED):
        m = copy.deepcopy(model)
        f, backend = _compile(tmp_path, m)
        got = _train(m, f, x)
        for step_got, step_want in zip(got, want, strict=True):
            assert_same(step_got, step_want, model=True)
        assert _aot(backend) == [("forward", status), ("backward", status)]
    assert aot_runs[0] == 1  # the second compile did not run aot_autograd
    # the same verdicts and partitions, and every executable loaded by its program
    assert dynajax.Report(backend.graphs).compile_stats.xla_compiles == 0


def _mutate_and_alias(x: torch.Tensor, w: torch.Tensor, counter: torch.Tensor):
    counter.add_(1)  # a buffer written in place
    y = (x @ w).tanh() * counter
    return y, w.t()  # an output aliasing an input that requires grad


def test_loaded_wrappers_write_mutations_back_and_regenerate_aliases(tmp_path, aot_runs) -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 3)
    w0 = torch.randn(3, 5)
    runs = []
    for _ in range(3):  # eager, cold, warm
        runs.append((w0.clone().requires_grad_(True), torch.zeros(())))
    outs = []
    for i, (w, counter) in enumerate(runs):
        fn = _mutate_and_alias
        if i:
            fn, backend = _compile(tmp_path, _mutate_and_alias)
        y, wt = fn(x, w, counter)
        (y.sum() + wt.square().sum()).backward()
        y2, wt2 = fn(x, w, counter)
        outs.append((y, y2, wt2._base is w, w.grad, counter))
    assert outs[0][2]  # eager's alias is a view of w
    for got in outs[1:]:
        assert_same(got[:2], outs[0][:2])
        assert got[2]  # still a view of the input
        assert_same(got[3:], outs[0][3:])
    assert aot_runs[0] == 1
    assert _aot(backend) == [("forward", LOADED), ("backward", LOADED)]


def _filled(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scale.fill_(2.0)
    return ((x @ w) * scale).sum()


def test_a_loaded_graph_writes_an_overlapping_input_as_eager(tmp_path, aot_runs) -> None:
    # The input written in place is an expanded tensor (one element at five places):
    # eager's fill_ writes it, where copying the graph's new value back cannot; the call
    # runs eagerly, traced or loaded (the mutated inputs read from the loaded structures).
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    want = []
    for shared in (False, True):
        scale = torch.zeros(1).expand(5) if shared else torch.zeros(5)
        w_ = w.clone().requires_grad_(True)
        loss = _filled(x, w_, scale)
        loss.backward()
        want.append((loss, w_.grad, scale.clone()))
    for status in (STORED, LOADED):
        fn, backend = _compile(tmp_path, _filled)
        for k, shared in enumerate((False, True)):
            scale = torch.zeros(1).expand(5) if shared else torch.zeros(5)
            w_ = w.clone().requires_grad_(True)
            loss = fn(x, w_, scale)
            loss.backward()
            assert_same((loss, w_.grad, scale.clone()), want[k])
        assert _aot(backend)[:2] == [("forward", status), ("backward", status)]
    assert aot_runs[0] == 2  # (a graph for each stride of scale, both loaded the second time)


def _dropout_mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.dropout((x @ w).relu(), p=0.5, training=True).sum(-1)


def test_loaded_graph_draws_the_same_dropout_masks(tmp_path, aot_runs) -> None:
    x = torch.randn(16, 8)
    results = []
    for _ in range(2):
        w = torch.ones(8, 8, requires_grad=True)
        f, backend = _compile(tmp_path, _dropout_mlp)
        torch.manual_seed(3)
        y = f(x, w)
        y.sum().backward()
        results.append((y, w.grad))
    assert_same(results[1], results[0])
    assert aot_runs[0] == 1
    assert _aot(backend)[0] == ("forward", LOADED)


@torch.library.custom_op("dynajax_test_aot_train::scale", mutates_args=())
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_scale.register_fake
def _(x):
    return torch.empty_like(x)


_scale.register_autograd(lambda ctx, g: g * 3)


def _with_custom_op(x: torch.Tensor) -> torch.Tensor:
    return _scale(x.sin()).cos()


def test_training_graph_with_a_custom_op_is_traced_and_says_why(tmp_path, aot_runs) -> None:
    for _ in range(2):
        x = torch.randn(6, requires_grad=True)
        f, backend = _compile(tmp_path, _with_custom_op)
        f(x).sum().backward()
        grad = x.grad
        x.grad = None
        _with_custom_op(x).sum().backward()
        assert_same(grad, x.grad)
    assert aot_runs[0] == 2
    why = "traced (not cached: the ATen graph calls dynajax_test_aot_train.scale.default)"
    assert _aot(backend)[0] == ("forward", why)


def test_torch_without_the_recording_point_traces_and_says_why(
    tmp_path, aot_runs, monkeypatch
) -> None:
    monkeypatch.setattr(
        aot_rebuild, "_recording_point", lambda: "this torch's aot_autograd has no X"
    )
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(4, 32)
    for _ in range(2):
        f, backend = _compile(tmp_path, model)
        f(x).sum().backward()
    assert aot_runs[0] == 2
    assert _aot(backend)[0] == (
        "forward",
        "traced (not cached: this torch's aot_autograd has no X)",
    )


def test_entry_this_torch_cannot_rebuild_is_traced_and_replaced(
    tmp_path, aot_runs, monkeypatch
) -> None:
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(4, 32)
    eager = copy.deepcopy(model)
    want = _train(eager, eager, x, steps=1)
    _train(m := copy.deepcopy(model), _compile(tmp_path, m)[0], x, steps=1)
    monkeypatch.setattr(aot_rebuild, "_loadables", lambda: None)
    m = copy.deepcopy(model)
    f, backend = _compile(tmp_path, m)
    assert_same(_train(m, f, x, steps=1), want, model=True)
    assert aot_runs[0] == 2
    assert _aot(backend)[0] == (
        "forward",
        "traced and stored in the cache (cache miss: unloadable entry, TypeError)",
    )


def test_other_backends_are_untouched_by_the_recording(tmp_path) -> None:
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(4, 32)
    _compile(tmp_path, copy.deepcopy(model))[0](x).sum().backward()  # installs it
    torch._dynamo.reset()
    m = copy.deepcopy(model)
    torch.compile(m, backend="aot_eager")(x).sum().backward()
    model(x).sum().backward()
    for (name, p), q in zip(m.named_parameters(), model.parameters(), strict=True):
        assert_same(p.grad, q.grad, path=name)


def test_training_entry_loads_in_another_process(tmp_path) -> None:
    code = (
        "import torch, dynajax; from tests.models import mlp; torch.manual_seed(0);"
        f"m = mlp(); b = dynajax.Backend(cache_dir={str(tmp_path)!r});"
        "x = torch.randn(8, 32); f = torch.compile(m, backend=b);"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1);"
        "losses = []\n"
        "for _ in range(3):\n"
        "    loss = f(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad()\n"
        "    losses.append(loss.item())\n"
        "print(losses, [g.aot for g in b.graphs])"
    )
    cold, warm = (run_python("-c", code, timeout=300) for _ in range(2))
    assert cold.split("] [")[0] == warm.split("] [")[0]  # the same losses, bit for bit
    assert cold.endswith(f"[{STORED!r}, {STORED!r}]")
    assert warm.endswith(f"[{LOADED!r}, {LOADED!r}]")
