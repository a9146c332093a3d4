"""PyTorch's kernels inside XLA programs (dynajax/ffi): eager's values, eager's errors,
a user's C++ custom op, and the paths taken where the extension cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dynajax
from dynajax import Reason, ffi
from dynajax.program.callbacks import eager_errors
from tests.helpers import compile_with, report_of
from tests.tolerances import assert_same

aten = torch.ops.aten

_CPP_OP = textwrap.dedent(
    """
    #include <torch/library.h>
    #include <ATen/ATen.h>

    at::Tensor checked_scale(const at::Tensor& x, double scale) {
      TORCH_CHECK(x.min().item<double>() >= 0, "checked_scale takes non-negative values");
      return x * scale + 1;
    }

    TORCH_LIBRARY(dynajax_cpp_test, m) {
      m.def("checked_scale(Tensor x, float scale) -> Tensor");
    }

    TORCH_LIBRARY_IMPL(dynajax_cpp_test, CPU, m) {
      m.impl("checked_scale", &checked_scale);
    }
    """
)


@pytest.fixture(scope="module")
def cpp_op(tmp_path_factory):
    """A user's C++ custom op (with a value check), built for the test, and its fake."""
    from torch.utils import cpp_extension

    directory = str(tmp_path_factory.mktemp("cpp-op"))
    cpp_extension.load_inline(
        "dynajax_cpp_test_op",
        cpp_sources=[_CPP_OP],
        build_directory=directory,
        is_python_module=False,
    )
    torch.library.register_fake("dynajax_cpp_test::checked_scale")(
        lambda x, scale: torch.empty_like(x)
    )
    return torch.ops.dynajax_cpp_test.checked_scale.default


def _kernel(op, args, kwargs, like):
    """``op`` called by PyTorch's kernel inside a jitted program, on ``args`` whose
    tensors are passed as arrays; its results, as torch tensors."""
    leaves = [a for a in args if isinstance(a, torch.Tensor)]
    flat = [like] if isinstance(like, torch.Tensor) else [t for t in like if t is not None]

    def program(*arrays):
        it = iter(arrays)
        filled = [next(it) if isinstance(a, torch.Tensor) else a for a in args]
        avals = [jax.ShapeDtypeStruct(t.shape, np.dtype(str(t.dtype).split(".")[1])) for t in flat]
        return ffi.call_kernel(op, filled, kwargs, avals, [t.dtype for t in flat])

    with eager_errors(), jax.enable_x64(True):  # (64-bit as the backend's partitions)
        outs = jax.jit(program)(*(jnp.asarray(t.numpy()) for t in leaves))
    return [torch.from_numpy(np.asarray(o).copy()) for o in outs]


def test_the_extension_builds_and_answers() -> None:
    assert ffi.available()
    assert (
        ffi.kernel_refusal(aten.add.Tensor, (torch.ones(2), torch.ones(2)), {}, torch.ones(2))
        is None
    )


def test_the_extension_is_built_from_its_directorys_copy_of_the_source(monkeypatch) -> None:
    # One path per build directory, whichever install asks: cpp_extension rebuilds
    # where a source's path changes.
    from torch.utils import cpp_extension

    from dynajax.ffi import extension

    asked = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **kw: asked.append(sources))
    directory = extension.build_directory()
    extension._build(directory)
    [[source]] = asked
    assert os.path.dirname(source) == directory
    with open(source, "rb") as copy, open(extension.SOURCE, "rb") as original:
        assert copy.read() == original.read()


@pytest.mark.parametrize(
    "case",
    [
        "convolution",
        "max.dim",
        "index_put_mask",
        "int64_cumsum",
        "fake_quantize",
        "float64",
        "attention",
        "string",
        "device",
    ],
)
def test_values_are_bit_equal_to_eagers(case: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 9)
    cases = {
        "convolution": (
            aten.convolution.default,
            (x, torch.randn(4, 3, 3, 3), torch.randn(4), [2, 1], [1, 0], [1, 1], False, [0, 0], 1),
            {},
        ),
        "max.dim": (aten.max.dim, (x, 2, True), {}),
        "string": (aten.div.Tensor_mode, (x, x + 3), {"rounding_mode": "floor"}),
        "device": (aten._to_copy.default, (x,), {"dtype": torch.float64, "device": "cpu"}),
        "attention": (
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            (torch.randn(2, 4, 64, 16), torch.randn(2, 4, 64, 16), torch.randn(2, 4, 64, 16)),
            {"dropout_p": 0.0, "is_causal": True, "scale": 0.3},
        ),
        "index_put_mask": (
            aten.index_put.default,
            (x, [x > 0.5], torch.tensor(0.25)),
            {"accumulate": False},
        ),
        "int64_cumsum": (aten.cumsum.default, (torch.arange(12).view(3, 4) * 7, 1), {}),
        "fake_quantize": (
            aten.fake_quantize_per_tensor_affine_cachemask.default,
            (x, 0.1, 0, -128, 127),
            {},
        ),
        "float64": (
            aten.addmm.default,
            (torch.randn(3).double(), torch.randn(3, 5).double(), torch.randn(5, 3).double()),
            {"beta": 0.5},
        ),
    }
    op, args, kwargs = cases[case]
    if case == "index_put_mask":
        # (a list of tensors is an argument of its own: give the mask as an operand)
        mask = args[1][0]
        expected = op(x, [mask], args[2], **kwargs)

        def program(xa, ma, va):
            aval = jax.ShapeDtypeStruct(x.shape, jnp.float32)
            return ffi.call_kernel(op, (xa, [ma], va), kwargs, [aval], [torch.float32])

        [got] = jax.jit(program)(*(jnp.asarray(t.numpy()) for t in (x, mask, args[2])))
        assert torch.equal(torch.from_numpy(np.asarray(got)), expected)
        return
    expected = op(*args, **kwargs)
    got = _kernel(op, args, kwargs, expected)
    flat = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    assert len(got) == len(flat)
    for g, e in zip(got, flat, strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e), case


def test_a_transposed_argument_crosses_as_its_array() -> None:
    a, w = torch.randn(6, 5), torch.randn(7, 5)
    expected = aten.mm.default(a, w.t())

    def program(a, w):
        aval = jax.ShapeDtypeStruct((6, 7), jnp.float32)
        transposed = ffi.Strided(w, (5, 7), (1, 5), 0)  # w.t(), over w's buffer
        return ffi.call_kernel(aten.mm.default, (a, transposed), {}, [aval], [torch.float32])[0]

    lowered = jax.jit(program).lower(jnp.asarray(a.numpy()), jnp.asarray(w.numpy()))
    assert "transpose" not in lowered.as_text()  # the kernel's view transposes it
    got = lowered.compile()(jnp.asarray(a.numpy()), jnp.asarray(w.numpy()))
    assert torch.equal(torch.from_numpy(np.asarray(got)), expected)


def test_views_cross_as_their_base_array_in_the_backend() -> None:
    """A kernel's argument that is a view (a transpose, a slice, an unbind, an expand)
    of an array the partition computed crosses as that array and eager's view of it."""

    def quantized(t):
        return torch.fake_quantize_per_tensor_affine(t, 0.05, 3, -128, 127)

    def f(x):
        y = x.sin() * 2
        a = quantized(y[:, 1:5].t())
        b = quantized(y.unsqueeze(0).expand(3, -1, -1)).sum(0)
        c = quantized(y.view(4, 2, 3).unbind(1)[1])
        return a.cos(), b, c

    x = torch.randn(4, 6)
    compiled, backend = compile_with(f)
    for got, expected in zip(compiled(x), f(x), strict=True):
        assert_same(got, expected)
    report = report_of(backend)
    assert len(report.kernels) == 3 and len(report.partitions) == 1


def test_what_the_kernels_refuse() -> None:
    x = torch.empty(2, 4, 8, 16)
    attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    out = (x, torch.empty(2, 4, 8))
    assert ffi.kernel_refusal(attention, (x, x, x, 0.0), {}, out) is None
    assert "random" in ffi.kernel_refusal(attention, (x, x, x, 0.1), {}, out)
    assert "random" in ffi.kernel_refusal(aten.bernoulli.p, (x, 0.5), {}, x)
    assert "in place" in ffi.kernel_refusal(aten.add_.Tensor, (x, x), {}, x)
    square = torch.empty(2, 2)
    storage = ffi.kernel_refusal(aten.as_strided.default, (x, (2, 2), (1, 1)), {}, square)
    assert "storage" in storage
    assert "symbolic" not in (ffi.kernel_refusal(aten.sin.default, (x,), {}, x) or "")
    assert "not an operator" in ffi.kernel_refusal(torch.sin, (x,), {}, x)
    with torch.device("meta"):
        on_meta = torch.empty(3)
    assert "meta" in ffi.kernel_refusal(aten.sin.default, (on_meta,), {}, on_meta)


def test_a_kernels_error_is_eagers_error() -> None:
    x = torch.randn(4, 3)
    index = torch.tensor([0, 7])
    with pytest.raises(IndexError) as eager:
        aten.index_select.default(x, 0, index)
    with pytest.raises(IndexError) as inside:
        _kernel(aten.index_select.default, (x, 0, index), {}, torch.empty(2, 3))
    assert str(inside.value) == str(eager.value)


def test_a_users_cpp_op_runs_inside_the_backends_partition(cpp_op) -> None:
    def f(x):
        return torch.relu(cpp_op(x.abs() * 2, 0.5)) - x

    x = torch.randn(4, 8)
    compiled, backend = compile_with(f)
    assert torch.equal(compiled(x), f(x))
    report = report_of(backend)
    assert report.fallbacks == []
    [kernel] = report.kernels
    assert (kernel.target, kernel.reason) == (
        "dynajax_cpp_test.checked_scale.default",
        Reason.NO_LOWERING,
    )
    assert len(report.partitions) == 1


def test_a_users_cpp_op_raises_eagers_error_from_the_backends_partition(cpp_op) -> None:
    def f(x):
        return cpp_op(x * 2, 0.5).relu()

    compiled, _ = compile_with(f)
    with pytest.raises(RuntimeError, match="checked_scale takes non-negative values"):
        f(-torch.ones(3))
    with pytest.raises(RuntimeError, match="checked_scale takes non-negative values") as e:
        compiled(-torch.ones(3))
    assert "dynajax-torch-error" not in str(e.value)


class _WithCppOp(torch.nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.op(self.linear(x).abs(), 3.0).tanh()


def test_a_users_cpp_op_inside_jax_jit_of_jax_function(cpp_op) -> None:
    torch.manual_seed(0)
    model = _WithCppOp(cpp_op)
    x = torch.randn(4, 8)
    fn, state = dynajax.jax_function(model, x)
    [callback] = fn.callbacks
    assert callback.kernel and "PyTorch's kernel inside XLA" in callback.describe()
    got = jax.jit(fn)(state, jnp.asarray(x.numpy()))
    assert_same(torch.from_numpy(np.asarray(got)), model(x).detach())  # (XLA's linear, tanh)
    # vmap: the kernel runs once per element.
    xs = torch.randn(3, 4, 8)
    batched = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(state, jnp.asarray(xs.numpy()))
    assert_same(torch.from_numpy(np.asarray(batched)), model(xs).detach())


def test_a_users_cpp_op_raises_eagers_error_from_jax_function(cpp_op) -> None:
    model = _WithCppOp(cpp_op)
    model.linear.bias.data.fill_(-100.0)  # abs() keeps it positive: negate after
    model.op = lambda y, s: cpp_op(-y, s)
    x = torch.randn(4, 8)
    fn, state = dynajax.jax_function(model, x)
    with pytest.raises(RuntimeError, match="checked_scale takes non-negative values"):
        jax.block_until_ready(jax.jit(fn)(state, jnp.asarray(x.numpy())))


def test_kernels_off_the_backend_runs_the_op_between_partitions(monkeypatch) -> None:
    monkeypatch.setenv("DYNAJAX_TORCH_KERNELS", "0")
    assert not ffi.available()
    x = torch.randn(4, 4)
    compiled, backend = compile_with(
        lambda x: torch.fake_quantize_per_tensor_affine(x.sin(), 0.1, 0, -128, 127).cos()
    )
    compiled(x)
    [fallback] = report_of(backend).fallbacks
    assert fallback.reason is Reason.NO_LOWERING and report_of(backend).kernels == []


_NO_COMPILER = """
import logging, sys, jax, torch, dynajax
from dynajax import ffi
from tests.tolerances import assert_same
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
f = lambda x: torch.fake_quantize_per_tensor_affine(x.sin(), 0.1, 0, -128, 127).cos()
backend = dynajax.Backend()
x = torch.randn(4, 4)
assert_same(torch.compile(f, backend=backend)(x), f(x))
report = dynajax.Report(backend.graphs)
print("fallbacks", [v.reason.name for v in report.fallbacks], "kernels", len(report.kernels))
class Quantized(torch.nn.Module):
    def forward(self, x):
        return f(x)
fn, state = dynajax.jax_function(Quantized(), x)
assert_same(torch.from_numpy(jax.numpy.asarray(fn(state, x.numpy())).__array__()), f(x))
print("callback kernel", [c.kernel for c in fn.callbacks])
print("available", ffi.available())
"""


def test_without_a_compiler_the_other_paths_run_and_one_line_says_why(tmp_path) -> None:
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), DYNAJAX_KERNEL_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fallbacks ['NO_LOWERING'] kernels 0" in done.stdout
    assert "callback kernel [False]" in done.stdout  # a Python host callback
    assert "available False" in done.stdout
    said = [line for line in done.stderr.splitlines() if line.startswith("dynajax.ffi")]
    assert len(said) == 1, said
    assert "no C++ compiler" in said[0] and "no-such-c++" in said[0]


def test_a_kernels_error_is_eagers_error_at_every_call_of_a_jitted_function() -> None:
    # Called again, a jitted function runs through jit's C++ fast path, whose XLA error
    # is a ValueError (the first call's is a JaxRuntimeError): eager's error both times.
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4)
    ids = torch.randint(0, 10, (2, 5))
    fn, state = dynajax.jax_function(embedding, ids, fallback_ops=["aten.embedding"])
    jitted = jax.jit(fn)
    jitted(state, jnp.asarray(ids.numpy()))
    bad = torch.full((2, 5), 10)
    with pytest.raises(IndexError) as eager:
        embedding(bad)
    for _ in range(2):
        with pytest.raises(IndexError) as inside, eager_errors():
            jax.block_until_ready(jitted(state, jnp.asarray(bad.numpy())))
        assert str(inside.value) == str(eager.value)
