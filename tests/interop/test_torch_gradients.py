"""``jax.grad`` of a ``jax_function`` is ``torch.autograd``'s gradient: torch's own
derivative formulas (``padding_idx``, subgradients at 0, ties, NaN), the user's
``autograd.Function`` backwards, ``torch.utils.checkpoint``; and a ``transformers`` BERT
fine-tuned with optax equals ``torch.optim.AdamW``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from dynajax.errors import JaxFunctionError
from tests import models


def _grads_agree(f, *xs: torch.Tensor) -> None:
    """jax.grad of fn (w.r.t. every input) against torch.autograd.grad, in float64."""
    fn, _ = dynajax.jax_function(f, *xs)
    ts = [x.clone().requires_grad_() for x in xs]
    expected = torch.autograd.grad(f(*ts), ts, allow_unused=True)
    with jax.enable_x64(True):
        actual = jax.grad(lambda *a: fn({}, *a), argnums=tuple(range(len(xs))))(
            *[x.numpy() for x in xs]
        )
    for a, e, t in zip(actual, expected, ts, strict=True):
        e = torch.zeros_like(t) if e is None else e
        np.testing.assert_allclose(np.asarray(a), e.numpy(), rtol=1e-12, atol=0, equal_nan=True)


def _f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# torch's derivative where JAX's autodiff of a rule would differ: subgradients at 0 and
# at the clamp bounds, ties (torch splits amax's gradient evenly, max.dim/median pick
# one index), inf and NaN, the branch where() does not select.
CASES = {
    "abs": (lambda x: x.abs().sum(), _f64(0.0, -1.0, 2.0)),
    "relu": (lambda x: torch.relu(x).sum(), _f64(0.0, -1.0, 2.0)),
    "clamp": (lambda x: x.clamp(0.0, 1.0).sum(), _f64(0.0, 1.0, 0.5, 2.0)),
    "hardtanh": (lambda x: F.hardtanh(x).sum(), _f64(-1.0, 1.0, 0.0, 3.0)),
    "norm": (lambda x: torch.linalg.vector_norm(x), _f64(0.0, 0.0, 0.0)),
    "sqrt": (lambda x: x.sqrt().sum(), _f64(0.0, 4.0)),
    "max": (lambda x: x.max(), _f64(1.0, 3.0, 3.0, 2.0)),
    "max_dim": (lambda x: x.max(dim=0).values.sum(), _f64(3.0, 3.0, 1.0)),
    "amax": (lambda x: x.amax(), _f64(1.0, 3.0, 3.0, 2.0)),
    "median": (lambda x: x.median(), _f64(1.0, 2.0, 2.0, 3.0)),
    "inf": (lambda x: (1.0 / x).sum(), _f64(0.0, 2.0)),
    "nan": (lambda x: x.log().sum(), _f64(-1.0, 2.0)),
    "where_nan_branch": (
        lambda x: torch.where(x > 0, x, x.log()).sum(),
        _f64(1.0, -1.0, 2.0),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_torchs_derivative_at_the_points_where_rules_differ(name: str) -> None:
    f, x = CASES[name]
    _grads_agree(f, x)


class _RoundThrough(torch.autograd.Function):
    """Rounding with a straight-through backward (quantization-aware training)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return grad


class _ScaledGrad(torch.autograd.Function):
    """ctx.save_for_backward and once_differentiable: the backward is the user's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return grad * 3 * x  # deliberately not 2x: the user's backward rules


def test_custom_autograd_functions_use_their_own_backward() -> None:
    x = torch.randn(6, dtype=torch.float64)
    _grads_agree(lambda x: (_RoundThrough.apply(x * 3) * x).sum(), x)
    _grads_agree(lambda x: _ScaledGrad.apply(x).sum(), x)
    fn, _ = dynajax.jax_function(lambda x: _RoundThrough.apply(x).sum(), x.float())
    assert np.asarray(jax.grad(lambda a: fn({}, a))(np.ones(6, np.float32))).tolist() == [1.0] * 6


def test_activation_checkpointing_gives_autograds_gradient() -> None:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)).double()

    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return y.square().sum()

    _grads_agree(f, torch.randn(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_embedding_padding_row_gets_no_gradient(scale_grad_by_freq: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(10, 4, padding_idx=0, scale_grad_by_freq=scale_grad_by_freq),
        nn.Linear(4, 2),
    )
    ids = torch.tensor([[0, 1, 2, 0, 2, 2]])
    fn, state = dynajax.jax_function(model, ids)
    params, buffers = fn.split_state(state)
    grads = jax.grad(lambda p: jnp.square(fn({**p, **buffers}, ids.numpy())).sum())(params)
    model(ids).square().sum().backward()
    assert not np.asarray(grads["0.weight"])[0].any()  # JAX's autodiff gives ones there
    for name, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[name]), p.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_vjp_and_value_and_grad_are_torchs_and_forward_mode_says_why() -> None:
    x = _f64(0.0, -2.0, 3.0)
    fn, _ = dynajax.jax_function(lambda x: x.abs() * 2, x)
    with jax.enable_x64(True):
        y, pullback = jax.vjp(lambda a: fn({}, a), x.numpy())
        (g,) = pullback(jnp.ones(3))
        assert np.asarray(g).tolist() == [0.0, -2.0, 2.0]  # torch: sign(0) = 0
        value, g2 = jax.value_and_grad(lambda a: fn({}, a).sum())(x.numpy())
        assert float(value) == 10.0 and np.asarray(g2).tolist() == [0.0, -2.0, 2.0]
        with pytest.raises(TypeError, match="forward-mode autodiff"):
            jax.jvp(lambda a: fn({}, a), (x.numpy(),), (jnp.ones(3),))


# Forward mode of the function itself has no torch rule (a custom_vjp): each way of asking
# for it raises dynajax's error, which says why and what works instead, not JAX's
# "can't apply forward-mode autodiff (jvp) to a custom_vjp function" (under jax.jit, JAX's
# came only when XLA lowered the program).
FORWARD_MODE = {
    "jvp": lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),)),
    "jit_of_jvp": lambda f, x: jax.jit(lambda a: jax.jvp(f, (a,), (a,)))(x),
    "jacfwd": lambda f, x: jax.jacfwd(f)(x),
    "jit_of_jacfwd": lambda f, x: jax.jit(jax.jacfwd(f))(x),
    "vmap_of_jvp": lambda f, x: jax.vmap(lambda t: jax.jvp(f, (x,), (t,)))(jnp.eye(3)),
    "grad_of_jvp": lambda f, x: jax.grad(lambda a: jax.jvp(f, (a,), (a,))[1].sum())(x),
}


@pytest.mark.parametrize("how", list(FORWARD_MODE))
def test_forward_mode_raises_an_error_that_says_why(how: str) -> None:
    x = _f64(0.5, -2.0, 3.0)
    fn, _ = dynajax.jax_function(lambda x: torch.sin(x) * 2, x)
    with jax.enable_x64(True), pytest.raises(JaxFunctionError) as raised:
        FORWARD_MODE[how](lambda a: fn({}, a), jnp.asarray(x.numpy()))
    message = str(raised.value)
    assert "forward-mode autodiff" in message and "torch's backward" in message
    assert "custom_vjp" in message and "jax.jacrev" in message and "jax.hessian" in message
    assert isinstance(raised.value, TypeError)  # what JAX raises, for code that catches it
    with jax.enable_x64(True):  # reverse mode is untouched
        g = jax.grad(lambda a: fn({}, a).sum())(x.numpy())
    np.testing.assert_allclose(np.asarray(g), 2 * np.cos(x.numpy()), rtol=1e-15)


def test_forward_mode_of_a_module_with_state_says_why() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with jax.enable_x64(True):
        fn, state = dynajax.jax_function(model, x)
        tangents = jax.tree_util.tree_map(jnp.ones_like, state)
        with pytest.raises(JaxFunctionError, match="torch's backward"):
            jax.jvp(lambda s: fn(s, x.numpy()), (state,), (tangents,))


# Forward mode over the backward is ordinary JAX (torch's backward graph, lowered), so
# second derivatives are torch.func's: jax.hessian (jacfwd of jacrev) as
# torch.func.hessian, jacrev of jacrev as torch.func's, and Hessian-vector products (jvp of
# grad), also at the points where torch's first derivative is its own (CASES above).
# Was: sqrt's second derivative at 0 was NaN where torch's is -inf: the float64 division's
# optimization barrier made the cotangent's zero tangent an array of zeros, and 0 / 0 is
# NaN (dtypes.divide now has torch's forward-mode formula, zero tangents left out).
SECOND_ORDER = {
    **CASES,
    "smooth": (lambda x: (x.sin() * x.exp()).sum() + (x**3).prod(), _f64(0.3, -1.2, 2.0)),
    "softmax": (
        lambda x: (torch.softmax(x, 0) * torch.arange(3.0, dtype=torch.float64)).sum(),
        _f64(0.3, -1.2, 2.0),
    ),
    "matmul_tanh": (
        lambda x: torch.tanh(x.reshape(2, 2) @ x.reshape(2, 2)).sum(),
        _f64(0.3, -1.2, 2.0, 0.5),
    ),
    "logsumexp": (lambda x: torch.logsumexp(x, 0), _f64(0.3, -1.2, 2.0)),
    "gelu": (lambda x: F.gelu(x).sum(), _f64(0.3, -1.2, 2.0)),
    "division": (lambda x: (x[0] / x[1]) + (2.0 / x).sum(), _f64(1.5, 0.0, -2.0)),
}


def _same(actual, expected: torch.Tensor) -> None:
    np.testing.assert_allclose(
        np.asarray(actual), expected.numpy(force=True), rtol=1e-12, atol=1e-12, equal_nan=True
    )


@pytest.mark.parametrize("name", list(SECOND_ORDER))
def test_second_derivatives_are_torch_funcs(name: str) -> None:
    f, x = SECOND_ORDER[name]
    fn, _ = dynajax.jax_function(f, x)
    v = torch.linspace(-1, 2, x.numel(), dtype=torch.float64)
    with jax.enable_x64(True):
        g = lambda a: fn({}, a)  # noqa: E731
        hessian = jax.hessian(g)(x.numpy())
        reverse_over_reverse = jax.jacrev(jax.jacrev(g))(x.numpy())
        hvp = jax.jvp(jax.grad(g), (x.numpy(),), (v.numpy(),))[1]
    _same(hessian, torch.func.hessian(f)(x))
    _same(reverse_over_reverse, torch.func.jacrev(torch.func.jacrev(f))(x))
    _same(hvp, torch.func.jvp(torch.func.grad(f), (x,), (v,))[1])


def test_hessian_of_a_module_wrt_its_input_and_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with jax.enable_x64(True):  # the state in float64
        fn, state = dynajax.jax_function(model, x)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, inputs):
        return torch.func.functional_call(model, p, (inputs,)).pow(2).sum()

    with jax.enable_x64(True):
        by_input = jax.hessian(lambda a: (fn(state, a) ** 2).sum())(x.numpy())
        by_bias = jax.hessian(lambda b: (fn({**state, "2.bias": b}, x.numpy()) ** 2).sum())(
            state["2.bias"]
        )
        by_weight = jax.hessian(lambda w: (fn({**state, "0.weight": w}, x.numpy()) ** 2).sum())(
            state["0.weight"]
        )
    _same(by_input, torch.func.hessian(lambda a: loss(params, a))(x))
    _same(by_bias, torch.func.hessian(lambda b: loss({**params, "2.bias": b}, x))(params["2.bias"]))
    _same(
        by_weight,
        torch.func.hessian(lambda w: loss({**params, "0.weight": w}, x))(params["0.weight"]),
    )


def test_bert_fine_tuned_with_optax_equals_torch_adamw() -> None:
    import optax

    torch.manual_seed(0)
    model = models.bert(layers=2, width=32, heads=4, vocab=64).eval()  # eval: no dropout
    head = nn.Linear(32, 2)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (4, 12), generator=gen)
    ids[:, 9:] = 0  # padding: BERT's word embeddings have padding_idx 0
    labels = torch.tensor([0, 1, 1, 0])

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert, self.head = model, head

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            pooled = self.bert(ids).last_hidden_state[:, 0]
            return F.cross_entropy(self.head(pooled), labels)

    torch_model = Classifier()
    fn, state = dynajax.jax_function(torch_model, ids, labels)
    params, buffers = fn.split_state(state)
    opt = optax.adamw(1e-3, weight_decay=0.01)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state):  # type: ignore[no-untyped-def]
        loss, grads = jax.value_and_grad(
            lambda p: fn({**p, **buffers}, ids.numpy(), labels.numpy())
        )(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state)
        torch_opt.zero_grad()
        expected = torch_model(ids, labels)
        expected.backward()
        torch_opt.step()
        assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    padding_row = "bert.embeddings.word_embeddings.weight"
    trained = dict(torch_model.named_parameters())
    np.testing.assert_allclose(
        np.asarray(params[padding_row]), trained[padding_row].detach().numpy(), atol=2e-5
    )


def test_state_trained_with_optax_goes_back_into_the_module(tmp_path) -> None:
    import optax
    import transformers

    torch.manual_seed(0)
    model = models.gpt2(layers=1, width=32, heads=4, vocab=64).eval()
    ids = torch.randint(0, 64, (2, 10))
    fn, state = dynajax.jax_function(model, ids)
    params, buffers = fn.split_state(state)
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)

    def loss(p):  # type: ignore[no-untyped-def]
        logits = fn({**p, **buffers}, ids.numpy())["logits"]
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    for _ in range(3):
        grads = jax.grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
    trained = {**params, **buffers}
    expected = np.asarray(fn(trained, ids.numpy())["logits"])

    fn.load_into(model, trained)
    model.save_pretrained(tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        for m in (model, reloaded):
            np.testing.assert_allclose(m(ids).logits.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()

    # copy=False: each tensor views its array's memory (CPU arrays, CPU module).
    fn.load_into(model, trained, copy=False)
    weight = model.transformer.wte.weight
    assert weight.data_ptr() == trained["transformer.wte.weight"].unsafe_buffer_pointer()
    assert model.lm_head.weight is weight  # still tied

    other = models.gpt2(layers=1, width=48, heads=4, vocab=64)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(JaxFunctionError, match=r"does not fit this module; nothing was written"):
        fn.load_into(other, trained)
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k])


# An op run in eager PyTorch (a host callback: no rule, or fallback_ops) has torch's VJP
# only: forward mode through it names the op (jax.hessian's forward mode runs over the
# forward's values too, where JAX's message was dynajax's general one), and reverse over
# reverse still gives torch's Hessian.
def test_forward_mode_through_a_host_callback_names_the_op() -> None:
    x = _f64(0.3, -1.2, 2.0)
    f = lambda t: torch.sin(t).sum()  # noqa: E731
    with jax.enable_x64(True):
        fn, _ = dynajax.jax_function(f, x, fallback_ops=("aten.sin",))
        assert [c.op for c in fn.callbacks] == ["aten.sin.default"]
        g = lambda a: fn({}, a)  # noqa: E731
        with pytest.raises(JaxFunctionError, match=r"through aten\.sin\.default.*host callback"):
            jax.hessian(g)(x.numpy())
        with pytest.raises(JaxFunctionError, match="torch's backward"):
            jax.jvp(g, (x.numpy(),), (x.numpy(),))
        reverse_over_reverse = jax.jacrev(jax.jacrev(g))(x.numpy())
    _same(reverse_over_reverse, torch.func.hessian(f)(x))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _value_and_grad(model: nn.Module, x: torch.Tensor) -> tuple[dynajax.JaxFunction, Any, Any]:
    with jax.enable_x64(True):
        fn, state = dynajax.jax_function(model, x)
        params, buffers = fn.split_state(state)
        value, grads = jax.jit(
            jax.value_and_grad(lambda p, x: jnp.square(fn({**p, **buffers}, x)).sum())
        )(params, x.numpy())
    return fn, value, grads


@pytest.mark.parametrize("checkpointed", [False, True])
def test_value_and_grad_saves_torchs_forward_for_its_backward(checkpointed: bool) -> None:
    # The backward reads what torch's forward saved, as aot_autograd's partition does,
    # instead of computing the forward again; where a checkpoint recomputes a region in
    # the backward, the whole joint graph runs (saving the region would undo it).
    model = _mlp()

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.model, x, use_reentrant=False)

    run = Checkpointed() if checkpointed else model
    x = torch.randn(5, 4, dtype=torch.float64)
    fn, value, grads = _value_and_grad(run, x)
    splits = list(fn.torch_backward._splits.values())
    assert len(splits) == 1
    assert (splits[0] is None) == checkpointed
    loss = run(x).square().sum()
    names = [n for n, _ in run.named_parameters()]
    expected = torch.autograd.grad(loss, list(run.parameters()))
    assert float(value) == pytest.approx(loss.item(), rel=1e-12)
    for name, e in zip(names, expected, strict=True):
        np.testing.assert_allclose(np.asarray(grads[name]), e.numpy(), rtol=1e-12, atol=1e-14)


def test_a_split_joint_graph_runs_as_the_whole() -> None:
    # split_joint's forward then backward compute what the joint graph computes, and
    # the backward holds no forward product (the forward's values are saved).
    from torch.fx.experimental.proxy_tensor import make_fx

    from dynajax.program.residuals import split_joint

    w1, w2 = torch.randn(4, 8), torch.randn(8, 3)

    def joint(x, a, b, ct):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        with torch.enable_grad():
            y = torch.tanh(x @ a) @ b
            ga, gb = torch.autograd.grad(y, (a, b), ct)
        return y.detach(), ga, gb

    x, ct = torch.randn(5, 4), torch.randn(5, 3)
    gm = make_fx(joint)(x, w1, w2, ct)
    parts = split_joint(gm, n_primals=3, n_outputs=1)
    assert parts is not None
    mms = lambda g: sum(n.target is torch.ops.aten.mm.default for n in g.graph.nodes)  # noqa: E731
    assert mms(parts.forward) == 2  # x @ a, tanh(.) @ b
    assert mms(parts.backward) == 3  # the two weight gradients and one input gradient
    forward = parts.forward(x, w1, w2)
    y, saved = forward[0], forward[1:]
    assert len(saved) == parts.n_saved
    whole = gm(x, w1, w2, ct)
    torch.testing.assert_close(y, whole[0])
    for got, want in zip(parts.backward(*saved, ct), whole[1:], strict=True):
        torch.testing.assert_close(got, want)
