"""Random ops inside compiled graphs draw from PyTorch's generator (through a seed per
call; see dynajax/lowering/random.py): reproducible under torch.manual_seed, fresh on
every call, with the right distributions; dropout's backward uses the forward's mask.

Values are not bitwise eager's (JAX's PRNG is not PyTorch's), so tests compare
distributions, or make eager reuse the mask the compiled model drew."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from dynajax.lowering.registry import get_rule
from tests.tolerances import assert_same
from tests.training.harness import assert_all_in_jax

N = 200_000  # samples per statistics check: standard errors well under the tolerances


def _moments(t: torch.Tensor) -> tuple[float, float]:
    t = t.double()
    return t.mean().item(), t.std().item()


def _mean_std(mean: float, std: float, tol: float) -> Callable[[torch.Tensor], None]:
    def check(t: torch.Tensor) -> None:
        m, s = _moments(t)
        assert abs(m - mean) < tol and abs(s - std) < tol, f"mean {m}, std {s}"

    return check


def _check_rand(u: torch.Tensor) -> None:
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1
    _mean_std(0.5, (1 / 12) ** 0.5, 0.005)(u)


def _check_uniform(v: torch.Tensor) -> None:
    assert -2 <= v.min() and v.max() < 3
    _mean_std(0.5, 5 / 12**0.5, 0.02)(v)


def _check_bernoulli(b: torch.Tensor) -> None:
    assert set(b.unique().tolist()) <= {0.0, 1.0}
    assert abs(b.mean().item() - 0.3) < 0.005


def _check_randint(r: torch.Tensor) -> None:
    assert r.dtype == torch.int64 and r.min() == 0 and r.max() == 9
    freq = torch.bincount(r, minlength=10).double() / N
    assert (freq - 0.1).abs().max() < 0.005


def _check_exponential(e: torch.Tensor) -> None:
    assert e.min() >= 0
    _mean_std(0.5, 0.5, 0.005)(e)


def _check_dropout(d: torch.Tensor) -> None:  # input all ones, p = 0.3
    kept = d != 0
    assert abs(kept.double().mean().item() - 0.7) < 0.005
    torch.testing.assert_close(d[kept], torch.full_like(d[kept], 1 / 0.7))


def _check_randperm(r: torch.Tensor) -> None:
    assert torch.equal(r.sort().values, torch.arange(1000))


# name -> (function of x = zeros(N), ATen op expected in JAX or None, statistics check)
SAMPLERS = {
    "rand": (lambda x: torch.rand(N), "aten.rand.default", _check_rand),
    "randn": (lambda x: torch.randn(N), "aten.randn.default", _mean_std(0, 1, 0.01)),
    "rand_like": (lambda x: torch.rand_like(x), "aten.rand_like.default", _check_rand),
    "randn_like": (lambda x: torch.randn_like(x), "aten.randn_like.default", _mean_std(0, 1, 0.01)),
    "randint": (lambda x: torch.randint(0, 10, (N,)), "aten.randint.low", _check_randint),
    "bernoulli": (lambda x: torch.bernoulli(torch.full_like(x, 0.3)), None, _check_bernoulli),
    "bernoulli_p": (lambda x: x.clone().bernoulli_(0.3), "aten.bernoulli.p", _check_bernoulli),
    "normal_": (
        lambda x: torch.empty_like(x).normal_(2.0, 3.0),
        "aten.normal_functional.default",
        _mean_std(2, 3, 0.03),
    ),
    "uniform_": (
        lambda x: torch.empty_like(x).uniform_(-2.0, 3.0),
        "aten.uniform.default",
        _check_uniform,
    ),
    "normal_tensor": (
        lambda x: torch.normal(x, 2.0),
        "aten.normal.Tensor_float",
        _mean_std(0, 2, 0.02),
    ),
    "exponential_": (lambda x: torch.empty_like(x).exponential_(2.0), None, _check_exponential),
    "dropout": (
        lambda x: F.dropout(x + 1.0, 0.3, training=True),
        "aten.native_dropout.default",
        _check_dropout,
    ),
    "randperm": (lambda x: torch.randperm(1000), "aten.randperm.default", _check_randperm),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_seeded_reproducible_fresh_and_distributed(name: str) -> None:
    fn, op, check = SAMPLERS[name]
    backend = dynajax.Backend()
    compiled = torch.compile(fn, backend=backend)
    x = torch.zeros(N)
    torch.manual_seed(1)
    first, second = compiled(x), compiled(x)
    torch.manual_seed(1)
    again = compiled(x)
    torch.manual_seed(2)
    other = compiled(x)
    assert torch.equal(first, again), "same seed, different numbers"
    assert not torch.equal(first, second), "successive calls drew the same numbers"
    assert not torch.equal(first, other), "different seeds drew the same numbers"
    check(first)
    check(other)
    assert_all_in_jax(backend, "inference")
    if op is not None:
        ops = {k for p in backend.graphs[0].partitions for k in p.ops}
        assert op in ops, f"{op} not in the JAX partition ({sorted(ops)})"


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keeps_one_minus_p_and_rescales(p: float) -> None:
    compiled = torch.compile(lambda x: F.dropout(x, p, training=True), backend="dynajax")
    x = torch.rand(N) + 0.5  # never zero, so zeros in the output are dropped elements
    torch.manual_seed(0)
    out = compiled(x)
    kept = out != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.005
    torch.testing.assert_close(out[kept], x[kept] / (1 - p))


def test_dropout_backward_uses_the_forward_mask() -> None:
    backend = dynajax.Backend()
    compiled = torch.compile(lambda x: F.dropout(x, 0.4, training=True) * 2.0, backend=backend)
    x = (torch.rand(64, 64) + 0.5).requires_grad_()
    torch.manual_seed(0)
    out = compiled(x)
    grad = torch.randn(64, 64)
    out.backward(grad)
    mask = out != 0
    assert 0 < mask.double().mean() < 1
    torch.testing.assert_close(x.grad, grad * mask * 2.0 / 0.6)
    # The backward draws nothing: aot_autograd saved the forward's mask for it.
    for g in backend.graphs:
        if g.kind == "backward":
            random = [n for n in g.graph_module.graph.nodes if _is_random(n)]
            inner = [n for p in g.partitions for n in _partition_nodes(g, p.name) if _is_random(n)]
            assert not random and not inner, "the backward graph draws random numbers"
    assert_all_in_jax(backend, "forward")


def _is_random(node: torch.fx.Node) -> bool:
    rule = get_rule(node.target) if node.op == "call_function" else None
    return rule is not None and rule.needs_key


def _partition_nodes(g, name: str):
    return getattr(g.graph_module, name).graph_module.graph.nodes


class _DropoutMLP(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.a, self.b, self.p = nn.Linear(16, 32), nn.Linear(32, 4), p

    def forward(self, x, mask=None):
        h = torch.relu(self.a(x)) + 1.0  # positive, so zeros after dropout are the mask
        if mask is None:
            h = F.dropout(h, self.p, training=self.training)
        else:  # eager replay of a given mask, as native_dropout computes it
            h = h * mask / (1 - self.p)
        return self.b(h), h


def test_dropout_training_gradients_match_eager_given_the_same_mask() -> None:
    """p > 0: eager replays the mask the compiled model drew; gradients agree exactly."""
    torch.manual_seed(0)
    model = _DropoutMLP(0.5)
    twin = copy.deepcopy(model)
    backend = dynajax.Backend()
    compiled = torch.compile(twin, backend=backend)
    x = torch.randn(8, 16)
    out, h = compiled(x)
    out.square().mean().backward()
    mask = h.detach() != 0
    assert 0.3 < mask.double().mean() < 0.7
    expected, _ = model(x, mask)
    expected.square().mean().backward()
    assert_same(out, expected, model=True)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert_same(q.grad, p.grad, model=True, path=f"grad[{name}]")
    assert_all_in_jax(backend, "forward")
    assert_all_in_jax(backend, "backward")


def test_encoder_with_dropout_trains_reproducibly_in_jax() -> None:
    """nn.TransformerEncoderLayer(dropout=0.1) in training mode: forward and backward in
    JAX, same seed -> same losses and gradients, and the dropout really acts."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    x = torch.randn(2, 8, 32)
    backend = dynajax.Backend()
    compiled = torch.compile(layer, backend=backend)

    def run(seed: int):
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = compiled(x).square().mean()
        loss.backward()
        return loss.detach(), [p.grad for p in layer.parameters()]

    loss_a, grads_a = run(0)
    loss_b, grads_b = run(0)
    loss_c, _ = run(1)
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(loss_a, loss_c)
    layer.eval()  # without dropout the loss differs: dropout was applied
    with torch.no_grad():
        assert not torch.equal(layer(x).square().mean(), loss_a)
    assert_all_in_jax(backend, "forward")
    assert_all_in_jax(backend, "backward")


def test_more_distributions_in_one_graph() -> None:
    """bernoulli with a tensor p, log_normal_, cauchy_, geometric_, poisson: one graph,
    all in JAX, seeded, and distributed as PyTorch's."""

    def sample(x):
        return (
            x.clone().bernoulli_(torch.full_like(x, 0.3)),
            torch.empty_like(x).log_normal_(0.0, 0.5),
            torch.empty_like(x).cauchy_(),
            torch.empty_like(x).geometric_(0.3),
            torch.poisson(x + 2.0),
        )

    backend = dynajax.Backend()
    compiled = torch.compile(sample, backend=backend)
    x = torch.zeros(N)
    torch.manual_seed(3)
    first = compiled(x)
    torch.manual_seed(3)
    for a, b in zip(compiled(x), first, strict=True):
        assert torch.equal(a, b)
    bern, lognormal, cauchy, geometric, poisson = (t.double() for t in first)
    assert abs(bern.mean().item() - 0.3) < 0.005
    assert abs(lognormal.median().item() - 1.0) < 0.01
    assert abs(lognormal.mean().item() - math.exp(0.125)) < 0.01  # exp(std^2 / 2)
    q1, q2, q3 = torch.quantile(cauchy[:100_000], torch.tensor([0.25, 0.5, 0.75]).double())
    assert abs(q1 + 1) < 0.03 and abs(q2) < 0.03 and abs(q3 - 1) < 0.03
    assert geometric.min() == 1 and abs(geometric.mean().item() - 1 / 0.3) < 0.03
    assert abs(poisson.mean().item() - 2) < 0.02 and abs(poisson.var().item() - 2) < 0.05
    assert_all_in_jax(backend, "inference")
