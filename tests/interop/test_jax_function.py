"""``dynajax.jax_function``: a torch model as a pure JAX function of its state.

The JAX function must give eager's answer, and stay right under JAX's transformations:
``jax.jit``, ``jax.grad`` (against ``torch.autograd``), ``jax.vmap`` (against a loop),
``jax.lax.scan`` (against a loop), with explicit PRNG keys, buffer updates, dynamic
batch sizes, and ops without a JAX rule (host callbacks into eager PyTorch).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import dynajax
from dynajax import Reason
from dynajax.errors import CallbackOpsError, JaxFunctionError
from dynajax.interop import BufferUpdatesDiscardedWarning
from tests import models
from tests.tolerances import assert_same

# ---------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------


def to_torch(tree: Any) -> Any:
    """JAX outputs (nested tuples, lists, dicts) as torch tensors, for ``assert_same``."""
    if isinstance(tree, dict):
        return {k: to_torch(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_torch(v) for v in tree)
    return torch.from_numpy(np.array(tree))


def eager_structure(out: Any) -> Any:
    """A torch output as the JAX function nests it (a ModelOutput is a dict)."""
    return dict(out) if hasattr(out, "to_tuple") else out


def narrow(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype JAX gives it in the current mode (int64 is int32 with JAX's
    64-bit mode off, the default)."""
    return t if jax.config.jax_enable_x64 or t.dtype != torch.int64 else t.to(torch.int32)


def first(out: Any) -> Any:
    """The main output: the tensor itself, or the first field (logits, hidden states)."""
    if isinstance(out, torch.Tensor | jax.Array):
        return out
    if isinstance(out, dict) or hasattr(out, "to_tuple"):
        return next(iter(out.values()))
    return out[0]


def weighted_loss(out: Any, xp: Any) -> Any:
    """A loss weighing every element of the main output by a fixed, non-uniform weight,
    in torch (``xp=torch``) or JAX (``xp=jnp``), so each element's gradient matters."""
    o = first(out)
    n = o.numel() if isinstance(o, torch.Tensor) else o.size
    return (o * xp.linspace(-1, 2, n).reshape(o.shape)).sum() / n


def arrays(*tensors: torch.Tensor) -> list[np.ndarray]:
    return [t.numpy() for t in tensors]


def torch_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for n, p in model.named_parameters()
    }


# ---------------------------------------------------------------------------------
# The model suite: outputs, and gradients against torch.autograd
# ---------------------------------------------------------------------------------

ZOO = models.transformers_zoo()

MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp": lambda: (models.mlp(), (torch.randn(4, 32),)),
    "cnn-eval": lambda: (models.cnn().eval(), (torch.randn(2, 3, 16, 16),)),
    "cnn-train": lambda: (models.cnn().train(), (torch.randn(2, 3, 16, 16),)),
    "encoder": lambda: (
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        (torch.randn(2, 10, 32),),
    ),
    "gpt2": lambda: (models.gpt2().eval(), (models.tokens(2, 16),)),
    "llama": lambda: (models.llama().eval(), (models.tokens(2, 16),)),
    "vit": lambda: (ZOO["vit"][0]().eval(), (ZOO["vit"][1]()["pixel_values"],)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_outputs_and_gradients_match_eager(name: str) -> None:
    torch.manual_seed(0)
    model, args = MODELS[name]()
    eager_model_state = {k: v.clone() for k, v in model.state_dict().items()}
    fn, state = dynajax.jax_function(model, *args)
    assert fn.callbacks == (), fn.report
    assert set(fn.parameter_names) == {n for n, _ in model.named_parameters()}

    # Outputs (and, in train mode, the updated buffers) under jax.jit.
    out, new_state = jax.jit(fn.with_state)(state, *arrays(*args))
    expected = model(*args)
    assert_same(to_torch(out), eager_structure(expected), model=True)
    assert set(new_state) == set(state)
    eager_buffers = dict(model.named_buffers())  # non-persistent ones too
    for buffer in fn.buffer_names:
        assert_same(to_torch(new_state[buffer]), narrow(eager_buffers[buffer]), path=buffer)
    if name == "cnn-train":
        assert set(fn.mutated_buffers) == set(eager_buffers)
        for buffer in fn.mutated_buffers:  # the forward changed them
            assert not torch.equal(eager_buffers[buffer], eager_model_state[buffer])
    else:
        assert fn.mutated_buffers == ()

    # Gradients w.r.t. the parameters, against torch.autograd on the same inputs (the
    # torch model starts from the state the JAX function was built from).
    model.load_state_dict(eager_model_state)
    params, buffers = fn.split_state(state)

    def loss(p: dict[str, jax.Array]) -> jax.Array:
        out, _ = fn.with_state({**p, **buffers}, *arrays(*args))
        return weighted_loss(out, jnp)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    model.zero_grad()
    expected_loss = weighted_loss(model(*args), torch)
    expected_loss.backward()
    assert_same(to_torch(value), expected_loss.detach(), model=True, path="loss")
    expected_grads = torch_grads(model)
    assert grads.keys() == expected_grads.keys()
    for n in expected_grads:
        assert_same(to_torch(grads[n]), expected_grads[n], model=True, path=f"grad[{n}]")


def test_tied_weights_are_one_state_entry() -> None:
    torch.manual_seed(0)
    model = models.gpt2().eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    fn, state = dynajax.jax_function(model, models.tokens(2, 8))
    assert "transformer.wte.weight" in state
    assert "lm_head.weight" not in state


def test_buffer_updates_dropped_by_the_outputs_only_form_warn_once() -> None:
    torch.manual_seed(0)
    model, (x,) = MODELS["cnn-train"]()
    fn, state = dynajax.jax_function(model, x)
    with pytest.warns(BufferUpdatesDiscardedWarning, match="with_state"):
        out = fn(state, x.numpy())
    assert_same(to_torch(out), model(x), model=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(state, x.numpy())  # once per function
    fn_eval, state_eval = dynajax.jax_function(model.eval(), x)
    assert fn_eval.mutated_buffers == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BufferUpdatesDiscardedWarning)
        fn_eval(state_eval, x.numpy())


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
def test_64_bit_types_follow_the_callers_jax_mode(x64: bool) -> None:
    torch.manual_seed(0)
    wide, narrow_ = (np.int64, np.float64), (np.int32, np.float32)
    int_dtype, float_dtype = wide if x64 else narrow_
    model, (x,) = MODELS["cnn-train"]()
    with jax.enable_x64(x64):
        fn, state = dynajax.jax_function(model, x)
        _, new_state = jax.jit(fn.with_state)(state, x.numpy())
        assert state["1.num_batches_tracked"].dtype == int_dtype
        assert new_state["1.num_batches_tracked"].dtype == int_dtype
        assert int(new_state["1.num_batches_tracked"]) == 1
        # argmax (int64 in torch) and a float64 computation, through nested jits
        f, _ = dynajax.jax_function(lambda a: (a.argmax(-1), a.double() / 3), x[:, 0, 0])
        index, third = jax.jit(f)({}, x[:, 0, 0].numpy())
        assert (index.dtype, third.dtype) == (int_dtype, float_dtype)
    index_t, third_t = x[:, 0, 0].argmax(-1), x[:, 0, 0].double() / 3
    np.testing.assert_array_equal(np.asarray(index), index_t.numpy())
    np.testing.assert_allclose(np.asarray(third), third_t.numpy(), rtol=1e-6 if not x64 else 0)


# ---------------------------------------------------------------------------------
# Dynamic shapes
# ---------------------------------------------------------------------------------


def test_dynamic_batch_two_sizes_from_one_function() -> None:
    torch.manual_seed(0)
    model = models.cnn().eval()  # Flatten: a view sized from the batch (sym_size)
    fn, state = dynajax.jax_function(
        model, torch.randn(2, 3, 16, 16), dynamic_shapes=({0: Dim("batch")},)
    )
    assert any("sym_size" in str(n.target) for n in fn.graph_module.graph.nodes)
    jitted = jax.jit(fn)
    for batch in (3, 5):
        x = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            assert_same(to_torch(jitted(state, x.numpy())), model(x), model=True)
    # A static dim at another size: the model is exported again at it, as jax.jit
    # retraces per shape (AdaptiveAvgPool2d takes any image size).
    x = torch.randn(3, 3, 15, 16)
    with torch.no_grad():
        assert_same(to_torch(jitted(state, x.numpy())), model(x), model=True)


def test_dynamic_batch_and_sequence_of_a_decoder() -> None:
    torch.manual_seed(0)
    model = models.llama().eval()
    shapes = ({0: Dim("batch"), 1: Dim("seq", max=64)},)
    fn, state = dynajax.jax_function(model, models.tokens(2, 16), dynamic_shapes=shapes)
    jitted = jax.jit(fn)
    for batch, length in ((2, 16), (3, 9)):
        ids = models.tokens(batch, length)
        with torch.no_grad():
            assert_same(to_torch(jitted(state, ids.numpy())), dict(model(ids)), model=True)
    with pytest.raises(JaxFunctionError, match="outside the range"):
        jitted(state, models.tokens(2, 65).numpy())


def test_a_size_read_from_a_tensor_is_refused_with_what_to_do() -> None:
    # torch.export fails in its own trace (an unbacked size it cannot place): the error
    # names the limit and the way out, with torch's error as its cause.
    with pytest.raises(JaxFunctionError, match="reads a tensor's value as a number") as info:
        dynajax.jax_function(lambda x, i: x.narrow(0, i, 2), torch.randn(5), torch.tensor(2))
    assert "PendingUnbackedSymbolNotFound" in str(info.value)
    assert isinstance(
        info.value.__cause__, torch.fx.experimental.symbolic_shapes.PendingUnbackedSymbolNotFound
    )


def test_take_by_a_0d_index_is_a_jax_function() -> None:
    x = torch.randn(3, 4)
    fn, _ = dynajax.jax_function(lambda x, i: torch.take(x, i), x, torch.tensor(5))
    for i in (5, -1, 0):
        assert_same(
            to_torch(jax.jit(fn)({}, x.numpy(), np.int64(i))), torch.take(x, torch.tensor(i))
        )


# ---------------------------------------------------------------------------------
# vmap and scan
# ---------------------------------------------------------------------------------


def test_vmap_over_inputs_and_over_states_equals_a_loop() -> None:
    torch.manual_seed(0)
    model = models.mlp()
    fn, state = dynajax.jax_function(model, jnp.ones((4, 32)))  # an array as example
    xs = jnp.asarray(torch.randn(5, 4, 32).numpy())
    batched = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(state, xs)
    looped = jnp.stack([fn(state, xs[i]) for i in range(xs.shape[0])])
    assert_same(to_torch(batched), to_torch(looped))
    with torch.no_grad():
        assert_same(to_torch(batched), model(torch.from_numpy(np.array(xs))), model=True)
    # An ensemble: one state per member, stacked, over the same input.
    states = [state, jax.tree.map(lambda a: a * 0.5, state)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)
    x = xs[0]
    ensemble = jax.vmap(fn, in_axes=(0, None))(stacked, x)
    assert_same(to_torch(ensemble), to_torch(jnp.stack([fn(s, x) for s in states])))


class Cell(nn.Module):
    """An RNN cell: h' = tanh(W x + U h), through an MLP-like pair of linears."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.rec = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x) + self.rec(h))


def test_scan_over_a_sequence_equals_the_loop() -> None:
    torch.manual_seed(0)
    cell = Cell()
    xs, h0 = torch.randn(6, 2, 4), torch.zeros(2, 8)
    fn, state = dynajax.jax_function(cell, xs[0], h0)

    def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = fn(state, x, h)
        return h, h

    final, hs = jax.jit(lambda h, xs: jax.lax.scan(step, h, xs))(h0.numpy(), xs.numpy())
    h, expected = h0, []
    with torch.no_grad():
        for x in xs:
            h = cell(x, h)
            expected.append(h)
    assert_same(to_torch(hs), torch.stack(expected), model=True)
    assert_same(to_torch(final), h, model=True)


def test_scan_carries_updated_buffers_as_eager_updates_them() -> None:
    torch.manual_seed(0)
    model = models.cnn().train()
    batches = torch.randn(3, 2, 3, 16, 16)
    fn, state = dynajax.jax_function(model, batches[0])

    def step(s: dict[str, jax.Array], x: jax.Array) -> tuple[dict[str, jax.Array], jax.Array]:
        out, s = fn.with_state(s, x)
        return s, out

    final, outs = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(state, batches.numpy())
    with torch.no_grad():
        expected = torch.stack([model(x) for x in batches])
    assert_same(to_torch(outs), expected, model=True)
    for name, value in model.state_dict().items():
        assert_same(to_torch(final[name]), narrow(value), model=True, path=name)


# -- every model of the suite --------------------------------------------------------

STEPS = 3  # vmap batch and scan length: small, the transforms' cost is their trace


def inputs_like(x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` fresh inputs of ``x``'s kind, stacked: token ids or Gaussian values."""
    if x.dtype == torch.int64:
        return models.tokens(n * x.shape[0], x.shape[1]).reshape(n, *x.shape)
    return torch.randn(n, *x.shape)


def step_of(tree: Any, i: int) -> Any:
    """Element ``i`` along the leading (vmap or scan) axis of every array of ``tree``."""
    return jax.tree.map(lambda a: a[i], tree)


@pytest.mark.parametrize("name", list(MODELS))
def test_vmap_over_a_batch_of_inputs_equals_a_loop_of_eager_calls(name: str) -> None:
    # Each element is one call of the model from the same state: its outputs, and (in
    # train mode) the buffers that call would leave, per element.
    torch.manual_seed(0)
    model, (x,) = MODELS[name]()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    fn, state = dynajax.jax_function(model, x)
    xs = inputs_like(x, STEPS)
    outs, states = jax.jit(jax.vmap(fn.with_state, in_axes=(None, 0)))(state, xs.numpy())
    for i, xi in enumerate(xs):
        model.load_state_dict(initial)
        with torch.no_grad():
            expected = eager_structure(model(xi))
        assert_same(to_torch(step_of(outs, i)), expected, model=True, path=f"out[{i}]")
        eager_buffers = dict(model.named_buffers())
        for buffer in fn.buffer_names:
            got = to_torch(states[buffer][i])
            assert_same(got, narrow(eager_buffers[buffer]), model=True, path=f"{buffer}[{i}]")


@pytest.mark.parametrize("name", list(MODELS))
def test_scan_over_a_sequence_of_inputs_equals_the_eager_loop(name: str) -> None:
    # The carry is the state (BatchNorm's running statistics move from step to step, as
    # in the eager loop) and a running sum of the main output; each step emits outputs.
    torch.manual_seed(0)
    model, (x,) = MODELS[name]()
    fn, state = dynajax.jax_function(model, x)
    xs = inputs_like(x, STEPS)

    def step(carry: Any, xi: jax.Array) -> tuple[Any, Any]:
        s, total = carry
        out, s = fn.with_state(s, xi)
        return (s, total + first(out)), out

    main = jax.eval_shape(lambda s, x: first(fn.with_state(s, x)[0]), state, xs[0].numpy())
    total0 = jnp.zeros(main.shape, main.dtype)
    (final, total), outs = jax.jit(lambda c, xs: jax.lax.scan(step, c, xs))(
        (state, total0), xs.numpy()
    )
    expected_total = torch.zeros(main.shape)
    with torch.no_grad():
        for i, xi in enumerate(xs):
            expected = eager_structure(model(xi))
            assert_same(to_torch(step_of(outs, i)), expected, model=True, path=f"out[{i}]")
            expected_total += first(expected)
    assert_same(to_torch(total), expected_total, model=True, path="sum")
    for buffer, value in model.named_buffers():
        assert_same(to_torch(final[buffer]), narrow(value), model=True, path=buffer)
    for param in fn.parameter_names:  # carried through unchanged
        np.testing.assert_array_equal(np.asarray(final[param]), np.asarray(state[param]))


@pytest.mark.parametrize("name", ["mlp", "cnn-train", "gpt2"])
def test_per_example_gradients_under_vmap_equal_autograd_per_example(name: str) -> None:
    torch.manual_seed(0)
    model, (x,) = MODELS[name]()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    fn, state = dynajax.jax_function(model, x)
    params, buffers = fn.split_state(state)
    xs = inputs_like(x, STEPS)

    def loss(p: dict[str, jax.Array], xi: jax.Array) -> jax.Array:
        out, _ = fn.with_state({**p, **buffers}, xi)
        return weighted_loss(out, jnp)

    values, grads = jax.jit(jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0)))(
        params, xs.numpy()
    )
    for i, xi in enumerate(xs):
        model.load_state_dict(initial)
        model.zero_grad()
        expected = weighted_loss(model(xi), torch)
        expected.backward()
        assert_same(to_torch(values[i]), expected.detach(), model=True, path=f"loss[{i}]")
        for n, g in torch_grads(model).items():
            assert_same(to_torch(grads[n][i]), g, model=True, path=f"grad[{n}][{i}]")


@pytest.mark.parametrize("name", ["cnn-train", "gpt2"])
def test_scan_of_sgd_steps_equals_torch_optim_steps(name: str) -> None:
    # Gradients inside scan: parameters (tied ones in GPT-2) and buffers are the carry.
    torch.manual_seed(0)
    model, (x,) = MODELS[name]()
    fn, state = dynajax.jax_function(model, x)
    params, buffers = fn.split_state(state)
    xs = inputs_like(x, STEPS)
    lr = 0.1

    def step(carry: Any, xi: jax.Array) -> tuple[Any, jax.Array]:
        p, b = carry

        def loss(p: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
            out, new_state = fn.with_state({**p, **b}, xi)
            return weighted_loss(out, jnp), new_state

        (value, new_state), g = jax.value_and_grad(loss, has_aux=True)(p)
        p = jax.tree.map(lambda w, gw: w - lr * gw, p, g)
        return (p, {k: new_state[k] for k in b}), value

    (p, b), values = jax.jit(lambda c, xs: jax.lax.scan(step, c, xs))((params, buffers), xs.numpy())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    expected = []
    for xi in xs:
        opt.zero_grad()
        loss = weighted_loss(model(xi), torch)
        loss.backward()
        opt.step()
        expected.append(loss.detach())
    assert_same(to_torch(values), torch.stack(expected), model=True, path="losses")
    for n, w in model.named_parameters():
        assert_same(to_torch(p[n]), w.detach(), model=True, path=n)
    for n, v in model.named_buffers():
        assert_same(to_torch(b[n]), narrow(v), model=True, path=n)


# ---------------------------------------------------------------------------------
# Random ops
# ---------------------------------------------------------------------------------


def test_random_ops_take_an_explicit_key() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5)).train()
    x = torch.randn(4, 8)
    fn, state = dynajax.jax_function(model, x)
    assert len(fn.random_ops) == 1 and "dropout" in fn.random_ops[0]
    jitted = jax.jit(fn)
    a = jitted(state, x.numpy(), key=jax.random.key(0))
    b = jitted(state, x.numpy(), key=jax.random.key(0))
    c = jitted(state, x.numpy(), key=jax.random.key(1))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    # Dropout's values: zero, or the linear's output scaled by 1 / (1 - p).
    with torch.no_grad():
        scaled = model[0](x).numpy() * 2
    kept = np.asarray(a) != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(np.asarray(a)[kept], scaled[kept], rtol=1e-5, atol=1e-6)
    with pytest.raises(JaxFunctionError, match=r"needs a PRNG key.*key=jax\.random\.key"):
        fn(state, x.numpy())
    # In eval mode there is nothing random, and no key is needed.
    fn_eval, state_eval = dynajax.jax_function(model.eval(), x)
    assert fn_eval.random_ops == ()
    with torch.no_grad():
        assert_same(to_torch(fn_eval(state_eval, x.numpy())), model(x))


def test_decoder_in_train_mode_with_attention_dropout() -> None:
    # Attention dropout makes eager pick the math attention kernel: another layout of
    # its output than in eval mode, which the decomposition must follow.
    torch.manual_seed(0)
    model, ids = models.gpt2().train(), models.tokens(2, 16)
    fn, state = dynajax.jax_function(model, ids)
    assert len(fn.random_ops) == 7  # embeddings, and attention, residual, MLP per layer
    jitted = jax.jit(fn)
    a = jitted(state, ids.numpy(), key=jax.random.key(0))["logits"]
    b = jitted(state, ids.numpy(), key=jax.random.key(0))["logits"]
    c = jitted(state, ids.numpy(), key=jax.random.key(1))["logits"]
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    with pytest.raises(JaxFunctionError, match="and 6 more random op"):
        fn(state, ids.numpy())


# ---------------------------------------------------------------------------------
# Ops without a JAX rule: host callbacks
# ---------------------------------------------------------------------------------

FAKE_QUANT = "aten.fake_quantize_per_tensor_affine_cachemask.default"


class FakeQuantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        q = torch.fake_quantize_per_tensor_affine(y, 0.05, 0, -128, 127)  # the callback
        return torch.relu(q) * 2


def test_op_without_rule_runs_through_a_callback_with_eager_values_and_gradients() -> None:
    assert torch.ops.aten.fake_quantize_per_tensor_affine_cachemask.default not in (
        dynajax.supported_ops()
    )
    torch.manual_seed(0)
    model, x = FakeQuantized(), torch.randn(4, 8)
    fn, state = dynajax.jax_function(model, x)

    [callback] = fn.callbacks
    assert callback.op == FAKE_QUANT
    assert callback.reason is Reason.NO_LOWERING
    assert callback.differentiable
    assert callback.source_line.startswith(__file__)
    assert "torch.fake_quantize_per_tensor_affine(y" in callback.source_line
    assert FAKE_QUANT in fn.report

    with torch.no_grad():
        assert_same(to_torch(jax.jit(fn)(state, x.numpy())), model(x))

    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return weighted_loss(fn(p, x), jnp)

    grads = jax.jit(jax.grad(loss))(state, x.numpy())
    weighted_loss(model(x), torch).backward()
    for n, g in torch_grads(model).items():
        assert_same(to_torch(grads[n]), g, path=f"grad[{n}]")
    # The input gradient too (the fake quantizer passes it through where in range).
    xt = x.clone().requires_grad_(True)
    weighted_loss(model(xt), torch).backward()
    assert_same(to_torch(jax.grad(loss, argnums=1)(state, x.numpy())), xt.grad, path="grad[x]")


def test_strict_raises_one_error_naming_every_callback_op_and_its_line() -> None:
    class TwoOps(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127)
            return soft_clip(a, 2.0)

    with pytest.raises(CallbackOpsError) as info:
        dynajax.jax_function(TwoOps(), torch.randn(4, 4), strict=True)
    assert isinstance(info.value, dynajax.UnsupportedNodesError)
    assert [v.target for v in info.value.verdicts] == [FAKE_QUANT, SOFT_CLIP]
    message = str(info.value)
    assert "2 op(s)" in message
    assert FAKE_QUANT in message and SOFT_CLIP in message
    assert f"{__file__}:" in message
    assert "a = torch.fake_quantize_per_tensor_affine(x" in message
    assert "return soft_clip(a, 2.0)" in message


def test_fallback_ops_run_through_callbacks_and_strict_accepts_them() -> None:
    torch.manual_seed(0)
    model, x = models.mlp(), torch.randn(4, 32)
    fn, state = dynajax.jax_function(model, x, fallback_ops=["aten.relu"], strict=True)
    [callback] = fn.callbacks
    assert (callback.op, callback.reason) == ("aten.relu.default", Reason.USER_FALLBACK)
    with torch.no_grad():
        assert_same(to_torch(jax.jit(fn)(state, x.numpy())), model(x))
    grads = jax.grad(lambda p: weighted_loss(fn(p, x.numpy()), jnp))(state)
    weighted_loss(model(x), torch).backward()
    for n, g in torch_grads(model).items():
        assert_same(to_torch(grads[n]), g, path=f"grad[{n}]")


@torch.library.custom_op("dynajax_interoptest::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    return limit * torch.tanh(x / limit)


@soft_clip.register_fake
def _(x: torch.Tensor, limit: float) -> torch.Tensor:
    return torch.empty_like(x)


def _soft_clip_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.limit = inputs[1]


def _soft_clip_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    (x,) = ctx.saved_tensors
    return grad * (1 - torch.tanh(x / ctx.limit) ** 2), None


soft_clip.register_autograd(_soft_clip_backward, setup_context=_soft_clip_setup)

SOFT_CLIP = "dynajax_interoptest.soft_clip.default"


class Clipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_clip(self.linear(x), 0.5).sum(-1)


def test_custom_op_callback_under_vmap_dynamic_shapes_and_grad() -> None:
    torch.manual_seed(0)
    model = Clipped()
    fn, state = dynajax.jax_function(model, torch.randn(3, 6), dynamic_shapes=({0: Dim("batch")},))
    assert [c.op for c in fn.callbacks] == [SOFT_CLIP]
    jitted = jax.jit(fn)
    for batch in (2, 7):  # output shapes of the callback follow the traced batch
        x = torch.randn(batch, 6)
        with torch.no_grad():
            assert_same(to_torch(jitted(state, x.numpy())), model(x))
    xs = jnp.asarray(torch.randn(4, 3, 6).numpy())
    batched = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(state, xs)
    assert_same(to_torch(batched), to_torch(jnp.stack([fn(state, x) for x in xs])))
    x = torch.randn(5, 6)
    grads = jax.grad(lambda p: fn(p, x.numpy()).sum())(state)
    model(x).sum().backward()
    for n, g in torch_grads(model).items():
        assert_same(to_torch(grads[n]), g, path=f"grad[{n}]")


# ---------------------------------------------------------------------------------
# Training in pure JAX with optax, against the same loop in PyTorch
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam"])
def test_optax_training_loop_matches_torch_optim(optimizer: str) -> None:
    torch.manual_seed(0)
    model = models.mlp()
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    xs, ys = x.expand(5, 8, 32), y.expand(5, 8, 16)  # one batch, five steps
    fn, state = dynajax.jax_function(model, xs[0])
    params, buffers = fn.split_state(state)
    if optimizer == "adam":
        opt, torch_opt = optax.adam(1e-2), torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = optax.sgd(5e-2, momentum=0.9)
        torch_opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    opt_state = opt.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            return jnp.mean((fn({**p, **buffers}, x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    jax_losses, torch_losses = [], []
    for x, y in zip(xs, ys, strict=True):
        params, opt_state, value = step(params, opt_state, x.numpy(), y.numpy())
        jax_losses.append(float(value))
        torch_opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch_opt.step()
        torch_losses.append(loss.item())
    assert torch_losses[-1] < torch_losses[0]  # it trains
    assert_same(torch.tensor(jax_losses), torch.tensor(torch_losses), model=True, path="losses")
    for n, p in model.named_parameters():
        assert_same(to_torch(params[n]), p.detach(), model=True, path=n)


# ---------------------------------------------------------------------------------
# Structures, plain functions, errors
# ---------------------------------------------------------------------------------


def test_plain_function_with_nested_inputs_and_outputs() -> None:
    weight = torch.randn(4, 3)  # closed over: a constant of the function, not state

    def f(pair: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor) -> dict[str, Any]:
        a, b = pair
        y = (a @ weight) * scale
        return {"y": y, "parts": (a + b, [b.argmax(-1)])}

    a, b, scale = torch.randn(2, 4), torch.randn(2, 4), torch.tensor(3.0)
    fn, state = dynajax.jax_function(f, (a, b), scale)
    assert state == {}
    out = jax.jit(fn)(state, (a.numpy(), b.numpy()), scale.numpy())
    expected = f((a, b), scale)
    expected["parts"][1][0] = narrow(expected["parts"][1][0])
    assert_same(to_torch(out), expected)


def test_a_new_batch_size_is_exported_again_once() -> None:
    torch.manual_seed(0)
    model = models.gpt2(layers=1, width=32, heads=4, vocab=64).eval()
    fn, state = dynajax.jax_function(model, torch.randint(0, 64, (2, 8)))
    jitted = jax.jit(fn)
    for shape in ((5, 8), (3, 13), (5, 8)):
        ids = torch.randint(0, 64, shape)
        with torch.no_grad():
            expected = model(ids).logits
        assert_same(to_torch(jitted(state, ids.numpy())["logits"]), expected, model=True)
    assert len(fn._variants) == 2  # one export per new shape, reused
    # Under vmap the traced shape (without the mapped axis) is the example's: no export.
    batched = jax.vmap(lambda ids: fn(state, ids)["logits"])(np.zeros((4, 2, 8), np.int64))
    assert batched.shape == (4, 2, 8, 64) and len(fn._variants) == 2


def test_call_errors_say_what_is_wrong() -> None:
    model = models.mlp()
    fn, state = dynajax.jax_function(model, torch.randn(4, 32))
    x = torch.randn(4, 32).numpy()
    with pytest.raises(JaxFunctionError, match=r"missing \['0.bias'\]"):
        fn({k: v for k, v in state.items() if k != "0.bias"}, x)
    with pytest.raises(JaxFunctionError, match=r"unknown \['extra'\]"):
        fn({**state, "extra": jnp.zeros(1)}, x)
    with pytest.raises(JaxFunctionError, match="dtype int32.*float32"):
        fn(state, x.astype(np.int32))
    with pytest.raises(JaxFunctionError, match=r"cannot run at these input sizes \(\(4, 31\)\)"):
        fn(state, torch.randn(4, 31).numpy())  # torch.export's reason follows
    with pytest.raises(JaxFunctionError, match="nested as the example arguments"):
        fn(state, x, x)


def test_the_first_call_warns_of_nothing() -> None:
    # torch 2.13's run_decompositions copies a tree spec through a deprecated check
    # (FutureWarning "isinstance(treespec, LeafSpec) is deprecated"): not the user's.
    import warnings

    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn, state = dynajax.jax_function(model, x)
        fn(state, x.numpy())
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
