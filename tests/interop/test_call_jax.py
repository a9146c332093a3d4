"""``dynajax.call_jax``: a JAX function inside a torch program.

Eager PyTorch (values, dtypes, structures, static arguments, no copies at the
boundary), autograd (the backward is ``jax.vjp``), ``torch.compile`` with dynajax (one
partition with its neighbours, forward and backward, no graph break, no recompilation
per call), with ``aot_eager`` and ``inductor`` (an opaque op), a Pallas kernel, and the
error messages.

    pytest -q tests/interop/test_call_jax.py
"""

from __future__ import annotations

import functools
import gc
import os
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch._dynamo.testing
from jax.experimental import pallas as pl
from torch import nn

import dynajax
import dynajax.interop.call_jax as call_jax_module
from dynajax.errors import CallJaxError, ConversionError
from dynajax.runtime import conversion
from tests.tolerances import assert_same

CALL_JAX = torch.ops.dynajax.call_jax.default

# ---------------------------------------------------------------------------------
# JAX functions used below, and their torch references
# ---------------------------------------------------------------------------------


def rms_norm(x, w, *, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def torch_rms_norm(x, w, *, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _double_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + y_ref[...]


def pallas_double_add(x, y):
    """``2 * x + y`` as a Pallas kernel, interpreted (CPU has no Pallas backend)."""
    return pl.pallas_call(
        _double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True
    )(x, y)


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _compiled(fn: Callable[..., Any], **kwargs: Any) -> tuple[Callable[..., Any], dynajax.Backend]:
    backend = dynajax.Backend()
    return torch.compile(fn, backend=backend, fullgraph=True, **kwargs), backend


def _partition_of_each(graph: Any) -> dict[str, str]:
    """ATen target -> the ``jax_<n>`` its node ran in, for every node of one graph."""
    parts = graph.node_partition
    return {
        str(n.target): parts.get(n.name, "eager")
        for n in graph.snapshot.nodes
        if n.op == "call_function" and hasattr(n.target, "_schema")
    }


# ---------------------------------------------------------------------------------
# Eager: values, dtypes, structures, static arguments
# ---------------------------------------------------------------------------------


def test_eager_values_match_the_torch_reference() -> None:
    x, w = _rand(4, 8), _rand(8, seed=1)
    out = dynajax.call_jax(rms_norm, x, w, eps=1e-6)
    assert_same(out, torch_rms_norm(x, w, eps=1e-6))


DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dtypes_cross_both_ways(dtype: torch.dtype) -> None:
    t = (_rand(3, 5) * 4).to(dtype)
    same, made = dynajax.call_jax(lambda v: (v, jnp.zeros((2,), v.dtype)), t)
    assert same.dtype == dtype and made.dtype == dtype
    assert torch.equal(same, t)
    assert torch.equal(made, torch.zeros(2, dtype=dtype))


def test_64_bit_types_stay_64_bit_and_jax_config_is_untouched() -> None:
    big = torch.tensor([2**40 + 1, -(2**35)], dtype=torch.int64)
    fine = torch.tensor([1.0 + 1e-12], dtype=torch.float64)
    ints, floats = dynajax.call_jax(lambda i, f: (i * 3, f - 1.0), big, fine)
    assert ints.dtype == torch.int64 and torch.equal(ints, big * 3)
    assert floats.dtype == torch.float64 and floats.item() == pytest.approx(1e-12, rel=1e-3)
    # 64-bit mode was on for the call only, on this thread only.
    assert not jax.config.jax_enable_x64
    assert jnp.asarray(1.0).dtype == jnp.float32


def test_pytrees_in_and_out_and_static_scalars() -> None:
    a, b, c = _rand(3), _rand(3, seed=1), _rand(2, seed=2)

    def fn(pair, named, power, *, shift):
        x, y = pair
        return {"sum": x + y + shift, "more": (named["c"] ** power, None), "list": [x * y]}

    out = dynajax.call_jax(fn, (a, b), {"c": c}, 3, shift=0.5)
    assert set(out) == {"sum", "more", "list"}
    assert_same(out["sum"], a + b + 0.5)
    assert_same(out["more"][0], c**3)
    assert out["more"][1] is None
    assert isinstance(out["list"], list)
    assert_same(out["list"][0], a * b)


def test_static_keyword_arguments_select_the_traced_function() -> None:
    x = _rand(5)
    scaled = {s: dynajax.call_jax(lambda v, *, s: v * s, x, s=s) for s in (1.0, 2.0, 3.0)}
    for s, out in scaled.items():
        assert_same(out, x * s)
    # An int and a float of equal value are different static arguments.
    as_int = dynajax.call_jax(lambda v, *, n: jnp.full((2,), n), x, n=1)
    as_float = dynajax.call_jax(lambda v, *, n: jnp.full((2,), n), x, n=1.0)
    assert as_int.dtype == torch.int64 and as_float.dtype == torch.float64


def test_repeated_calls_reuse_one_registry_entry() -> None:
    x = _rand(4)

    class Scaler:
        def __init__(self, s: float) -> None:
            self.s = s

        def apply(self, v):
            return v * self.s

    scaler = Scaler(2.0)
    dynajax.call_jax(rms_norm, x, x, eps=1e-5)
    dynajax.call_jax(scaler.apply, x)
    dynajax.call_jax(functools.partial(jnp.multiply, 2.0), x)
    before = len(call_jax_module._ENTRIES)
    for _ in range(3):
        dynajax.call_jax(rms_norm, x, x, eps=1e-5)  # same function, same static value
        dynajax.call_jax(scaler.apply, x)  # a new bound method object every time
        dynajax.call_jax(functools.partial(jnp.multiply, 2.0), x)  # a new, equal partial
    assert len(call_jax_module._ENTRIES) == before


def test_outputs_are_fresh_writable_tensors() -> None:
    x = _rand(4)
    fn = lambda v: (jnp.arange(4.0, dtype=jnp.float32), v)  # noqa: E731
    first, passed = dynajax.call_jax(fn, x)
    first.add_(100.0)  # writing to one output changes no later result
    second, _ = dynajax.call_jax(fn, x)
    assert torch.equal(second, torch.arange(4.0))
    assert passed.data_ptr() != x.data_ptr()  # an output never aliases an input


def test_the_registry_keeps_a_function_alive_for_its_compiled_graphs() -> None:
    def make():
        return lambda v: v * 7

    fn = make()
    alive = weakref.ref(fn)
    compiled = torch.compile(lambda f, x: dynajax.call_jax(f, x), backend="aot_eager")
    x = _rand(3)
    assert_same(compiled(fn, x), x * 7)
    del fn
    gc.collect()
    assert alive() is not None  # a graph compiled with its key may still call it


def test_the_op_has_a_rule_in_the_one_lowering_table() -> None:
    assert CALL_JAX in dynajax.supported_ops()


def test_a_growing_registry_is_reported(monkeypatch, caplog) -> None:
    monkeypatch.setattr(call_jax_module, "_WARN_ENTRIES", len(call_jax_module._ENTRIES) + 1)
    with caplog.at_level("WARNING", logger="dynajax.interop"):
        dynajax.call_jax(lambda v: v + 1, _rand(2))  # a new function: a new entry
    assert "A function created anew for every call" in caplog.text


def test_keys_are_private_to_this_process() -> None:
    key = call_jax_module._register(rms_norm, None, (0, 0), {"eps": 0.1}, ("tuple", ()))
    assert key.startswith("rms_norm#") and key.endswith("@" + call_jax_module._TOKEN)
    with pytest.raises(CallJaxError, match="no JAX function is registered under 'f#0@other'"):
        CALL_JAX("f#0@other", [_rand(2)])


# ---------------------------------------------------------------------------------
# Eager: no copies at the boundary
# ---------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_cpu_input_reaches_the_jax_function_without_a_copy() -> None:
    # While the JAX function runs, its input buffer exists: were it a copy of the
    # 64 MiB tensor, the process would hold 64 MiB more resident memory at that moment.
    size = 64 * 2**20
    during: list[int] = []

    def probe(value):
        during.append(_resident_bytes())
        return np.zeros((), np.float32)

    def fn(x):
        return x[0] + jax.pure_callback(probe, jax.ShapeDtypeStruct((), jnp.float32), x[0])

    dynajax.call_jax(fn, torch.ones(size // 4))  # compiles for this shape
    big = torch.ones(size // 4)
    before = _resident_bytes()
    out = dynajax.call_jax(fn, big)
    assert out.item() == 1.0
    assert during[-1] - before < size // 4, f"{(during[-1] - before) / 2**20:.1f} MiB more"


def test_views_cross_in_and_xla_buffers_come_back_without_copies(monkeypatch) -> None:
    inputs, outputs = [], []
    to_jax, to_torch = conversion.fast_to_jax, conversion.cpu_to_torch

    def recording_to_jax(t):
        view = to_jax(t)
        inputs.append((t.data_ptr(), view.__array_interface__["data"][0]))
        return view

    def recording_to_torch(a):
        t = to_torch(a)
        outputs.append((a.unsafe_buffer_pointer(), t))
        return t

    monkeypatch.setattr(conversion, "fast_to_jax", recording_to_jax)
    monkeypatch.setattr(conversion, "cpu_to_torch", recording_to_torch)
    x, y = _rand(64), _rand(64, seed=1)
    s, d = dynajax.call_jax(lambda a, b: (a + b, a - b), x, y)
    assert inputs == [(x.data_ptr(), x.data_ptr()), (y.data_ptr(), y.data_ptr())]
    assert [(buffer, t.data_ptr()) for buffer, t in outputs] == [
        (s.data_ptr(), s.data_ptr()),
        (d.data_ptr(), d.data_ptr()),
    ]


def test_the_dlpack_functions_share_memory_on_cpu() -> None:
    t = torch.arange(16.0)
    a = conversion.dlpack_to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    back = conversion.dlpack_to_torch(a)
    assert back.data_ptr() == a.unsafe_buffer_pointer()


def test_call_jax_through_the_dlpack_path(monkeypatch) -> None:
    # Tensors on accelerators cross through DLPack; CPU tensors take it here.
    monkeypatch.setattr(call_jax_module, "_VIEW_DEVICES", frozenset())
    seen = []
    dlpack_to_jax = conversion.dlpack_to_jax

    def recording(t):
        a = dlpack_to_jax(t)
        seen.append(a.unsafe_buffer_pointer() == t.data_ptr())
        return a

    monkeypatch.setattr(conversion, "dlpack_to_jax", recording)
    x, w = _rand(4, 8), _rand(8, seed=1)
    out = dynajax.call_jax(rms_norm, x, w, eps=1e-6)
    assert seen == [True, True]
    assert_same(out, torch_rms_norm(x, w, eps=1e-6))
    # Lazy conjugates are resolved before DLPack (which cannot carry them).
    z = torch.randn(3, dtype=torch.complex64)
    assert_same(dynajax.call_jax(lambda v: v * 1, z.conj()), z.conj().resolve_conj())


# ---------------------------------------------------------------------------------
# Autograd: the backward is jax.vjp
# ---------------------------------------------------------------------------------


def test_backward_matches_torch_autograd() -> None:
    x = _rand(4, 8, dtype=torch.float64).requires_grad_()
    w = _rand(8, seed=1, dtype=torch.float64).requires_grad_()
    weights = _rand(4, 8, seed=2, dtype=torch.float64)
    (dynajax.call_jax(rms_norm, x, w, eps=1e-6) * weights).sum().backward()
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    (torch_rms_norm(xr, wr, eps=1e-6) * weights).sum().backward()
    assert_same(x.grad, xr.grad)
    assert_same(w.grad, wr.grad)


def test_gradcheck() -> None:
    x = _rand(3, 4, dtype=torch.float64).requires_grad_()
    w = _rand(4, seed=1, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: dynajax.call_jax(rms_norm, a, b, eps=1e-3), (x, w), fast_mode=True
    )


def test_only_floating_inputs_that_need_it_get_gradients() -> None:
    a = _rand(5).requires_grad_()
    b = _rand(5, seed=1)  # no gradient wanted
    i = torch.arange(5)  # integer: no gradient
    out, arg = dynajax.call_jax(lambda a, b, i: (a * b + i, jnp.argmax(a)), a, b, i)
    assert arg.dtype == torch.int64 and not arg.requires_grad
    out.sum().backward()
    assert_same(a.grad, b)


def test_complex_gradients_follow_torch_convention() -> None:
    z = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    w = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    ct = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(2))

    def loss(outs):
        return (outs[0] * ct).real.sum() + outs[1].sum()

    za, wa = z.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.autograd.grad(
        loss(dynajax.call_jax(lambda a, b: (a * a * jnp.conj(b), jnp.abs(a) ** 2), za, wa)),
        (za, wa),
    )
    zr, wr = z.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad(loss((zr * zr * wr.conj(), zr.abs() ** 2)), (zr, wr))
    assert_same(got, want)


def test_double_backward() -> None:
    x = _rand(6, dtype=torch.float64).requires_grad_()
    (g,) = torch.autograd.grad(
        dynajax.call_jax(lambda v: jnp.sin(v) ** 2, x).sum(), x, create_graph=True
    )
    (gg,) = torch.autograd.grad(g.sum(), x)
    xr = x.detach().requires_grad_()
    (gr,) = torch.autograd.grad((xr.sin() ** 2).sum(), xr, create_graph=True)
    (ggr,) = torch.autograd.grad(gr.sum(), xr)
    assert_same((g, gg), (gr, ggr))


# ---------------------------------------------------------------------------------
# torch.compile with dynajax: one op, inlined into its neighbours' partition
# ---------------------------------------------------------------------------------


def _sin_call_cos(x):
    return dynajax.call_jax(jnp.tanh, x.sin()).cos()


def test_dynajax_inlines_call_jax_into_its_neighbours_partition() -> None:
    compiled, backend = _compiled(_sin_call_cos)
    x = _rand(16)
    assert_same(compiled(x), _sin_call_cos(x))
    report = dynajax.Report(backend.graphs)
    assert report.fallbacks == [], report.text(width=None)
    assert [p.name for p in report.partitions] == ["jax_0"], report.text(width=None)
    parts = _partition_of_each(backend.graphs[0])
    assert parts == {
        "aten.sin.default": "jax_0",
        "dynajax.call_jax.default": "jax_0",
        "aten.cos.default": "jax_0",
    }


def test_kept_out_of_jax_the_node_runs_the_eager_op() -> None:
    backend = dynajax.Backend(fallback_ops=["dynajax.call_jax"])
    compiled = torch.compile(_sin_call_cos, backend=backend, fullgraph=True)
    x = _rand(16)
    assert_same(compiled(x), _sin_call_cos(x))
    [fallback] = dynajax.Report(backend.graphs).fallbacks
    assert (fallback.target, fallback.reason) == (
        "dynajax.call_jax.default",
        dynajax.Reason.USER_FALLBACK,
    )


def test_dynajax_compiles_once_for_repeated_calls() -> None:
    compiled, backend = _compiled(_sin_call_cos)
    for seed in range(4):
        x = _rand(16, seed=seed)
        assert_same(compiled(x), _sin_call_cos(x))
    assert len(backend.graphs) == 1
    stats = dynajax.Report(backend.graphs).compile_stats
    assert stats.xla_compiles + stats.cache_hits == 1


class _JaxBlock(nn.Module):
    """A linear layer, then an RMS norm written in JAX, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = nn.Linear(8, 16)
        self.norm = nn.Parameter(torch.rand(16, generator=gen) + 0.5)
        self.down = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(dynajax.call_jax(rms_norm, h, self.norm, eps=1e-5))


def _train_step(model: nn.Module, x: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_dynajax_training_step_forward_and_backward_in_one_partition_each() -> None:
    torch.manual_seed(0)
    eager_model = _JaxBlock()
    compiled_model = _JaxBlock()
    compiled_model.load_state_dict(eager_model.state_dict())
    backend = dynajax.Backend()
    compiled_model.forward = torch.compile(  # type: ignore[method-assign]
        compiled_model.forward, backend=backend, fullgraph=True
    )
    x = _rand(5, 8)
    assert_same(_train_step(compiled_model, x), _train_step(eager_model, x))
    report = dynajax.Report(backend.graphs)
    assert report.fallbacks == [], report.text(width=None)
    assert [g.kind for g in backend.graphs] == ["forward", "backward"]
    for graph in backend.graphs:
        assert [p.name for p in graph.partitions] == ["jax_0"], report.text(width=None)
        assert _partition_of_each(graph)["dynajax.call_jax.default"] == "jax_0"


def test_dynajax_runs_a_pallas_kernel() -> None:
    compiled, backend = _compiled(lambda a, b: dynajax.call_jax(pallas_double_add, a.exp(), b) + 1)
    x, y = _rand(8, 16), _rand(8, 16, seed=1)
    assert_same(compiled(x, y), 2 * x.exp() + y + 1)
    assert dynajax.Report(backend.graphs).fallbacks == []


def test_closures_of_one_factory_are_different_functions_to_dynamo() -> None:
    def scale_by(s):
        return lambda v: v * s

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda fn, x: dynajax.call_jax(fn, x) + 1, backend=counter, fullgraph=True
    )
    x = _rand(4)
    double, triple = scale_by(2.0), scale_by(3.0)
    for _ in range(2):
        assert_same(compiled(double, x), x * 2 + 1)
        assert_same(compiled(triple, x), x * 3 + 1)
    assert counter.frame_count == 2  # once per function, not once per call


def test_a_static_argument_from_a_changing_python_number() -> None:
    # Dynamo makes a float argument symbolic once it changes; call_jax specializes it.
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda x, s, n: dynajax.call_jax(lambda v, *, s, n: v * s + n, x, s=s, n=n),
        backend=counter,
        fullgraph=True,
    )
    x = _rand(4)
    values = [(2.0, 1), (3.0, 2), (4.0, 3)]
    for s, n in values:
        assert_same(compiled(x, s, n), x * s + n)
    frames = counter.frame_count
    for s, n in values:  # a value seen before finds its graph again
        assert_same(compiled(x, s, n), x * s + n)
    assert counter.frame_count == frames


def test_dynamic_shapes_specialize_and_stay_right() -> None:
    compiled = torch.compile(
        lambda x: dynajax.call_jax(jnp.cumsum, x, axis=0) * x.shape[0],
        backend="aot_eager",
        dynamic=True,
        fullgraph=True,
    )
    for n in (3, 5, 7):
        x = _rand(n, 2, seed=n)
        assert_same(compiled(x), x.cumsum(0) * n)


# ---------------------------------------------------------------------------------
# Other backends: an opaque op with the right answer
# ---------------------------------------------------------------------------------


def test_aot_eager_forward_backward_without_recompiling() -> None:
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    model = _JaxBlock()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for seed in range(3):
        x = _rand(3, 8, seed=seed)
        model.zero_grad()
        compiled(x).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        assert_same(got, [p.grad for p in model.parameters()])
    assert counter.frame_count == 1


def test_inductor_runs_it_as_an_opaque_op() -> None:
    compiled = torch.compile(_sin_call_cos, backend="inductor", fullgraph=True)
    x = _rand(16)
    assert_same(compiled(x), _sin_call_cos(x))


def test_pallas_kernel_eager_and_aot_eager() -> None:
    x, y = _rand(8, 16), _rand(8, 16, seed=1)
    assert_same(dynajax.call_jax(pallas_double_add, x, y), 2 * x + y)
    compiled = torch.compile(
        lambda a, b: dynajax.call_jax(pallas_double_add, a, b), backend="aot_eager"
    )
    assert_same(compiled(x, y), 2 * x + y)


# ---------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------


def _matmul(a, b):
    return a @ b


def test_a_function_that_fails_on_the_shapes_names_itself_and_them() -> None:
    with pytest.raises(CallJaxError) as raised:
        dynajax.call_jax(_matmul, _rand(3, 4), _rand(5, 6))
    message = str(raised.value)
    assert "_matmul" in message and "test_call_jax.py" in message
    assert "float32[3, 4], float32[5, 6]" in message
    assert "dot_general" in message  # JAX's own reason
    assert isinstance(raised.value.__cause__, TypeError)


def test_the_failure_under_compile_names_the_function_too() -> None:
    compiled = torch.compile(lambda a, b: dynajax.call_jax(_matmul, a, b), backend="aot_eager")
    with pytest.raises(Exception, match=r"_matmul .*failed on inputs \(float32\[3, 4\]"):
        compiled(_rand(3, 4), _rand(5, 6))


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((np.ones(3),), {}, r"positional argument 0 is or contains a value of type numpy\.ndarray"),
        (
            ((_rand(2), object()),),
            {},
            r"positional argument 0 is or contains a value of type object",
        ),
        (
            (_rand(2),),
            {"w": np.ones(3)},
            r"keyword argument 'w' is of type numpy\.ndarray, which is not hashable",
        ),
    ],
    ids=["numpy-positional", "object-in-tuple", "unhashable-static"],
)
def test_arguments_that_cannot_cross_are_named(args, kwargs, match) -> None:
    with pytest.raises(ConversionError, match=match):
        dynajax.call_jax(lambda *a, **k: a[0], *args, **kwargs)


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda v: v.astype(jnp.uint32), r"output of .* is uint32, which has no torch dtype"),
        (lambda v: "text", r"output of .* is of type str"),
        (lambda v: (v, {"k": object()}), r"output\[1\]\['k'\] of .* is of type object"),
    ],
    ids=["uint32", "str", "nested-object"],
)
def test_outputs_that_cannot_come_back_are_named(fn, match) -> None:
    with pytest.raises(ConversionError, match=match):
        dynajax.call_jax(fn, _rand(2))


def test_an_output_structure_that_changes_with_the_shapes_is_refused() -> None:
    def rows(v):
        return tuple(v[i] for i in range(v.shape[0]))

    assert len(dynajax.call_jax(rows, _rand(2, 3))) == 2
    with pytest.raises(
        CallJaxError,
        match=r"different structure .*\(array, array, array\) instead of \(array, array\)",
    ):
        dynajax.call_jax(rows, _rand(3, 3))


def test_inputs_jax_cannot_hold_and_mixed_devices_are_named() -> None:
    with pytest.raises(ConversionError, match="tensor 1 passed to .* is torch.uint16"):
        dynajax.call_jax(jnp.add, _rand(2), torch.ones(2, dtype=torch.uint16))
    with pytest.raises(ConversionError, match="are on cpu and meta"):
        dynajax.call_jax(jnp.add, _rand(2), torch.ones(2, device="meta"))
    with pytest.raises(ConversionError, match="first argument must be a JAX function"):
        dynajax.call_jax(3, _rand(2))  # type: ignore[arg-type]
