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
from tests.helpers import assert_ops_in_jax, param_grads
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
        assert_ops_in_jax(backend, op)


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
    assert_same(param_grads(twin), param_grads(model), model=True, path="grad")
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
        out = compiled(x)
        out.square().mean().backward()
        return out.detach(), [p.grad for p in layer.parameters()]

    out_a, grads_a = run(0)
    out_b, grads_b = run(0)
    out_c, _ = run(1)
    assert torch.equal(out_a, out_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
    # The layer ends with a LayerNorm, so its outputs' mean square is 1 with or without
    # dropout: the outputs themselves are compared. Dropout of 0.1 on three sums moves
    # them by O(0.1); rounding alone (another seed's mask aside) by ~1e-6.
    assert (out_a - out_c).abs().max() > 0.05
    layer.eval()
    with torch.no_grad():
        without_dropout = layer(x)
    assert (out_a - without_dropout).abs().max() > 0.05
    # ... and the same layer with dropout 0 in training mode is that eval answer.
    for module in layer.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    layer.self_attn.dropout = 0.0  # attention's own dropout is a float, not a module
    layer.train()
    torch._dynamo.reset()
    plain = torch.compile(layer, backend=dynajax.Backend())(x).detach()
    torch.testing.assert_close(plain, without_dropout, rtol=1e-5, atol=1e-5)
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


# ---------------------------------------------------------------------------------
# multinomial, rrelu's slopes, fractional max pooling's windows, dropout variants
# ---------------------------------------------------------------------------------


def _seeded_twice(fn: Callable, *args, seed: int = 0):
    """(backend, first, same-seed repeat, next call) of a compiled ``fn``."""
    backend = dynajax.Backend()
    compiled = torch.compile(fn, backend=backend)
    torch.manual_seed(seed)
    first = compiled(*args)
    following = compiled(*args)
    torch.manual_seed(seed)
    again = compiled(*args)
    return backend, first, again, following


def test_multinomial_with_replacement_draws_in_proportion_to_the_weights() -> None:
    weights = torch.tensor([[0.0, 1.0, 2.0, 7.0], [5.0, 0.0, 0.0, 5.0]])
    backend, first, again, following = _seeded_twice(
        lambda w: torch.multinomial(w, 50_000, replacement=True), weights
    )
    assert first.dtype == torch.int64 and first.shape == (2, 50_000)
    assert torch.equal(first, again) and not torch.equal(first, following)
    for row, w in zip(first, weights, strict=True):
        freq = torch.bincount(row, minlength=4).double() / row.numel()
        assert (freq - w.double() / w.sum()).abs().max() < 0.01, freq
        assert (freq[w == 0] == 0).all(), "a zero-weight category was drawn"
    assert_all_in_jax(backend, "inference")
    assert_ops_in_jax(backend, "aten.multinomial.default")


def test_multinomial_without_replacement_draws_distinct_categories_by_weight() -> None:
    """Each row holds distinct categories, zero weights never appear while others are
    left, and the first two draws follow sequential sampling without replacement:
    P(first = i) = p_i, P(second = j) = sum_i p_i p_j / (1 - p_i)."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0], dtype=torch.float64)
    rows = 40_000
    backend, first, again, following = _seeded_twice(
        lambda w: torch.multinomial(w, 3), p.expand(rows, 5).contiguous()
    )
    assert torch.equal(first, again) and not torch.equal(first, following)
    assert first.shape == (rows, 3)
    assert (first.sort(dim=1).values.diff(dim=1) != 0).all(), "a category drawn twice"
    assert (first != 4).all(), "a zero-weight category drawn while others were left"
    f0 = torch.bincount(first[:, 0], minlength=5).double() / rows
    f1 = torch.bincount(first[:, 1], minlength=5).double() / rows
    second = torch.stack([(p * p[j] / (1 - p)).sum() - p[j] ** 2 / (1 - p[j]) for j in range(5)])
    assert (f0 - p).abs().max() < 0.01, f0
    assert (f1 - second).abs().max() < 0.01, (f1, second)
    assert_all_in_jax(backend, "inference")
    assert_ops_in_jax(backend, "aten.multinomial.default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rrelu_training_draws_uniform_slopes_for_non_positive_inputs(dtype) -> None:
    lower, upper = 0.1, 0.4
    x = torch.cat([-torch.rand(N // 2) - 0.5, torch.rand(N // 2) + 0.5]).to(dtype)
    x[0] = 0.0  # zero is "non-positive": it gets a slope too (output 0)
    backend, first, again, following = _seeded_twice(
        lambda v: torch.ops.aten.rrelu_with_noise_functional(
            v, torch.zeros_like(v), lower, upper, True
        ),
        x,
    )
    out, noise = first
    assert torch.equal(out, again[0]) and torch.equal(noise, again[1])
    assert not torch.equal(noise, following[1])
    neg, pos = noise[: N // 2].double(), noise[N // 2 :]
    assert (pos == 1).all() and torch.equal(out[N // 2 :], x[N // 2 :])
    # Slopes are drawn in [lower, upper] and then rounded to the dtype, as in eager.
    lo, hi = (torch.tensor(v, dtype=dtype).item() for v in (lower, upper))
    assert lo <= neg.min() and neg.max() <= hi
    assert abs(neg.mean().item() - (lower + upper) / 2) < 0.005
    assert abs(neg.std().item() - (upper - lower) / 12**0.5) < 0.005
    torch.testing.assert_close(out[: N // 2], x[: N // 2] * noise[: N // 2])
    assert_all_in_jax(backend, "inference")
    assert_ops_in_jax(backend, "aten.rrelu_with_noise_functional.default")


def test_rrelu_module_in_training_mode_matches_its_noise() -> None:
    """F.rrelu(training=True) compiled: negative inputs scaled by slopes in range, the
    positive ones untouched; gradients are the slopes (the forward's noise)."""
    x = (torch.randn(64, 64) * 2).requires_grad_()
    backend = dynajax.Backend()
    torch.manual_seed(0)
    out = torch.compile(lambda v: F.rrelu(v, 0.2, 0.3, training=True), backend=backend)(x)
    out.sum().backward()
    slope = torch.where(x > 0, torch.ones_like(x), out / x).detach()
    neg = x.detach() <= 0
    assert (slope[neg] >= 0.2 - 1e-6).all() and (slope[neg] <= 0.3 + 1e-6).all()
    torch.testing.assert_close(x.grad, slope)
    assert_all_in_jax(backend, "forward")


@pytest.mark.parametrize("nd", [2, 3])
def test_fractional_max_pool_windows_are_random_and_the_values_their_maxima(nd: int) -> None:
    """The random offsets come from torch.rand in the graph: seeded, fresh per call.
    The input increases with the flat index, so each window's maximum is its last
    element and the indices show where the windows start: along the last axis the
    second window must start at different positions in different planes, within
    the range the offsets allow: with alpha = (15 - 2) / 4 = 3.25 it starts at
    floor((1 + u) * alpha) - floor(u * alpha), 3 or 4."""
    pool = F.fractional_max_pool2d if nd == 2 else F.fractional_max_pool3d
    spatial = (15,) * nd
    planes = (8, 64)
    x = torch.arange(math.prod(spatial), dtype=torch.float32).reshape(spatial)
    x = x.expand(*planes, *spatial).contiguous()
    backend, first, again, following = _seeded_twice(
        lambda v: pool(v, 2, output_size=(5,) * nd, return_indices=True), x
    )
    values, indices = first
    assert torch.equal(indices, again[1]) and not torch.equal(indices, following[1])
    flat = x.flatten(start_dim=2)
    gathered = flat.gather(2, indices.flatten(start_dim=2)).view_as(values)
    assert torch.equal(values, gathered)
    start = indices[..., 1] % 15 - 1  # the second window of the last axis
    assert set(start.flatten().tolist()) == {3, 4}
    assert_all_in_jax(backend, "inference")
    assert_ops_in_jax(backend, f"aten.fractional_max_pool{nd}d.default")


def test_complex_samplers_draw_both_parts_as_pytorch() -> None:
    """Complex randn/randn_like: each part N(0, 1/2); rand_like and uniform_: each part
    uniform; normal_(mean, std): each part N(mean, std^2 / 2) (the mean shifts both)."""

    def sample(z):
        return (
            torch.randn(N, dtype=torch.complex64),
            torch.randn_like(z),
            torch.rand_like(z),
            z.clone().uniform_(-1.0, 3.0),
            z.clone().normal_(2.0, 3.0),
        )

    z = torch.zeros(N, dtype=torch.complex64)
    backend, first, again, following = _seeded_twice(sample, z)
    for a, b, c in zip(first, again, following, strict=True):
        assert a.dtype == torch.complex64 and torch.equal(a, b) and not torch.equal(a, c)
    randn, randn_like, rand_like, uniform, normal = first
    for t in (randn, randn_like):
        for part in (t.real, t.imag):
            _mean_std(0.0, 0.5**0.5, 0.01)(part)
        assert abs((t.real * t.imag).double().mean().item()) < 0.01  # independent parts
    for part in (rand_like.real, rand_like.imag):
        _check_rand(part)
    for part in (uniform.real, uniform.imag):
        assert -1 <= part.min() and part.max() < 3
        _mean_std(1.0, 4 / 12**0.5, 0.02)(part)
    for part in (normal.real, normal.imag):
        _mean_std(2.0, 3 * 0.5**0.5, 0.03)(part)
    assert_all_in_jax(backend, "inference")


@pytest.mark.parametrize("nd", [2, 3])
def test_channel_dropout_drops_whole_channels(nd: int) -> None:
    """dropout2d/3d: each (sample, channel) is kept, scaled by 1/(1-p), or zeroed whole;
    a fraction p of channels is dropped."""
    p = 0.3
    drop = F.dropout2d if nd == 2 else F.dropout3d
    x = torch.ones(400, 100, *(3,) * nd)
    backend, first, again, following = _seeded_twice(lambda v: drop(v, p, training=True), x)
    assert torch.equal(first, again) and not torch.equal(first, following)
    per_channel = first.flatten(start_dim=2)
    kept = per_channel[:, :, 0] != 0
    assert (per_channel == per_channel[:, :, :1]).all(), "a channel partly dropped"
    assert abs(kept.double().mean().item() - (1 - p)) < 0.01
    torch.testing.assert_close(per_channel[kept], torch.full_like(per_channel[kept], 1 / (1 - p)))
    assert_all_in_jax(backend, "inference")


# SELU's alpha, as alpha_dropout uses it.
_ALPHA = 1.7580993408473766


@pytest.mark.parametrize("feature", [False, True], ids=["alpha_dropout", "feature_alpha_dropout"])
def test_alpha_dropout_keeps_zero_mean_and_unit_variance(feature: bool) -> None:
    """alpha_dropout sets dropped units to the SELU saturation value and rescales with
    a, b so that standard-normal input keeps mean 0 and variance 1: kept units become
    a x + alpha a p, dropped ones alpha a (p - 1). The feature form drops whole
    channels."""
    p = 0.2
    a = 1 / ((_ALPHA**2 * p + 1) * (1 - p)) ** 0.5
    drop = F.feature_alpha_dropout if feature else F.alpha_dropout
    x = torch.randn(2000, 100, 4) if feature else torch.randn(N)
    backend, first, again, following = _seeded_twice(lambda v: drop(v, p, training=True), x)
    assert torch.equal(first, again) and not torch.equal(first, following)
    _mean_std(0.0, 1.0, 0.02)(first)
    dropped = torch.isclose(first, torch.tensor(_ALPHA * a * (p - 1)), rtol=0, atol=1e-6)
    assert abs(dropped.double().mean().item() - p) < 0.01
    torch.testing.assert_close(first[~dropped], a * x[~dropped] + _ALPHA * a * p)
    if feature:
        assert (dropped == dropped[:, :, :1]).all(), "a channel partly dropped"
    assert_all_in_jax(backend, "inference")
