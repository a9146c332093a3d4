"""Verdicts and reasons, one category at a time; every result is compared with eager."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import dynajax
from dynajax import Reason
from dynajax.capability import META_KEY, Supported
from dynajax.lowering import registry
from tests.helpers import compare_with_eager, compile_with, report_of
from tests.tolerances import assert_same

aten = torch.ops.aten


# ---------------------------------------------------------------------------------
# Test-only ops: one with no rule, one whose rule has a check, one with a wrong rule
# ---------------------------------------------------------------------------------


@torch.library.custom_op("dynajax_captest::norule", mutates_args=())
def norule(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@norule.register_fake
def _(x):
    return torch.empty_like(x)


norule.register_autograd(lambda ctx, grad: norule(grad))  # d(3x)/dx = 3


@torch.library.custom_op("dynajax_captest::reduce_rows", mutates_args=())
def reduce_rows(x: torch.Tensor, mode: str) -> torch.Tensor:
    return x.sum(0) if mode == "sum" else x.amax(0)


@reduce_rows.register_fake
def _(x, mode):
    return x.new_empty(x.shape[1:])


CALLS: list[type] = []


def _reduce_rows_check(x, mode):
    return None if mode == "sum" else f"reduction mode {mode!r} not supported (only 'sum')"


def _reduce_rows_rule(x, mode):
    CALLS.append(type(x))
    return jnp.sum(x, axis=0)


def _wrong_dtype_rule(x, mode):
    return jnp.sum(x, axis=0).astype(jnp.float64)  # PyTorch keeps float32


def _shape_error_rule(x, mode):
    return jnp.sum(x, axis=0) + jnp.ones((7,), x.dtype)  # cannot broadcast


def _buggy_rule(x, mode):
    return x.no_such_attribute


def _own_type_error_rule(x, mode):
    return x + mode  # str + array: a TypeError raised by the rule, not by JAX


@pytest.fixture
def rule_for_reduce_rows(monkeypatch):
    """Registers a JAX rule for reduce_rows for one test (the table itself is global)."""
    registry.supported_ops()  # load the table before patching it
    op = torch.ops.dynajax_captest.reduce_rows.default

    def install(fn, check=None):
        monkeypatch.setitem(registry._TABLE, op, registry.Rule(op, fn, check))

    CALLS.clear()
    return install


def _by_target(report, target):
    return [f for f in report.fallbacks if f.target == target]


# ---------------------------------------------------------------------------------
# Supported (NO_LOWERING, for a custom and an ATen op: tests/test_fallback.py)
# ---------------------------------------------------------------------------------


def test_supported_nodes_carry_supported_verdicts() -> None:
    report = compare_with_eager(lambda x: torch.sin(x) * 2 + 1, torch.randn(8))
    assert report.fallbacks == []
    [graph] = report.graphs
    verdicts = [n.meta[META_KEY] for n in graph.snapshot.nodes if n.op == "call_function"]
    assert verdicts and all(isinstance(v, Supported) for v in verdicts)


# ---------------------------------------------------------------------------------
# CHECK_REFUSED: by the rule's check, and by abstract evaluation
# ---------------------------------------------------------------------------------


def test_check_refuses_argument_value_without_running_the_rule(rule_for_reduce_rows) -> None:
    rule_for_reduce_rows(_reduce_rows_rule, _reduce_rows_check)

    def f(x):
        return reduce_rows(x.sin(), "sum") + reduce_rows(x.cos(), "max")

    report = compare_with_eager(f, torch.randn(4, 6))
    [fb] = report.fallbacks
    assert fb.reason is Reason.CHECK_REFUSED
    assert fb.detail == "reduction mode 'max' not supported (only 'sum')"
    assert 'reduce_rows(x.cos(), "max")' in fb.source_line
    # The accepted node's rule ran only on JAX tracers (abstract evaluation, jit), never
    # on concrete data, and the refused one never ran at all.
    assert CALLS and all(issubclass(t, jax.core.Tracer) for t in CALLS)


@pytest.mark.parametrize(
    "rule, detail",
    [
        (_wrong_dtype_rule, "rule gives float64[6] where PyTorch gives float32[6]"),
        (_shape_error_rule, "abstract evaluation raised TypeError"),
    ],
    ids=["dtype-mismatch", "shape-error"],
)
def test_abstract_evaluation_refuses(rule_for_reduce_rows, rule, detail) -> None:
    rule_for_reduce_rows(rule)
    report = compare_with_eager(lambda x: reduce_rows(x, "sum") * 2, torch.randn(4, 6))
    [fb] = report.fallbacks
    assert fb.reason is Reason.CHECK_REFUSED
    assert fb.detail.startswith(detail)


def test_a_rule_raising_outside_jax_is_refused_with_a_warning(rule_for_reduce_rows, caplog) -> None:
    rule_for_reduce_rows(_own_type_error_rule)
    with caplog.at_level(logging.WARNING, logger="dynajax.capability"):
        report = compare_with_eager(lambda x: reduce_rows(x, "sum") * 2, torch.randn(4, 6))
    [fb] = report.fallbacks
    assert fb.reason is Reason.CHECK_REFUSED
    assert fb.detail.startswith("the rule itself raised TypeError")
    assert fb.detail.endswith("(likely a bug in the rule)")
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "dynajax_captest.reduce_rows.default" in warning.getMessage()


def test_a_buggy_rule_is_an_error_not_a_refusal(rule_for_reduce_rows) -> None:
    rule_for_reduce_rows(_buggy_rule)
    with pytest.raises(Exception, match="no_such_attribute"):
        torch.compile(lambda x: reduce_rows(x, "sum"), backend=dynajax.Backend())(torch.randn(2, 3))


# ---------------------------------------------------------------------------------
# DATA_DEPENDENT_SHAPE
# ---------------------------------------------------------------------------------

DATA_DEPENDENT = {
    "nonzero": (lambda x: torch.nonzero(x > 0).sum(), "aten.nonzero.default"),
    "masked_select": (lambda x: torch.masked_select(x, x > 0) * 2, "aten.masked_select.default"),
    "bool-mask-index": (lambda x: x[x > 0] + 1, "aten.index.Tensor"),
    "repeat_interleave": (
        lambda x: torch.repeat_interleave(x, (x > 0).long()) - 1,
        "aten.repeat_interleave.Tensor",
    ),
    "unique": (lambda x: torch.unique(x.round()) * 3, "aten._unique2.default"),
    "item": (lambda x: x * (x > 0).sum().item(), "aten._local_scalar_dense.default"),
}


@pytest.mark.parametrize("case", list(DATA_DEPENDENT), ids=list(DATA_DEPENDENT))
def test_data_dependent_ops_run_eagerly(case) -> None:
    fn, target = DATA_DEPENDENT[case]
    with torch._dynamo.config.patch(
        capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True
    ):
        report = compare_with_eager(lambda x: fn(torch.sin(x)), torch.randn(16))
    producers = _by_target(report, target)
    assert producers, report.text(width=None)
    assert all(p.reason is Reason.DATA_DEPENDENT_SHAPE for p in producers)
    assert "only known after running the op" in producers[0].detail
    # The sin before is in JAX; the consumer of the unbacked size stays in PyTorch.
    assert report.partitions
    consumers = [f for f in report.fallbacks if "earlier op" in f.detail]
    assert consumers and all(c.reason is Reason.DATA_DEPENDENT_SHAPE for c in consumers)
    # Size bookkeeping (sym_size, _assert_scalar) is not reported as a fallback.
    assert not [f for f in report.fallbacks if "sym_size" in f.target or "assert" in f.target]


def test_unbacked_size_flowing_into_a_creation_op() -> None:
    def f(x):
        n = torch.nonzero(x > 0).shape[0]
        return torch.ones(n, 2) * x.sum(), x.cos()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        report = compare_with_eager(f, torch.randn(10))
    reasons = {f.target: f.reason for f in report.fallbacks}
    assert reasons["aten.nonzero.default"] is Reason.DATA_DEPENDENT_SHAPE
    taker = [f for f in report.fallbacks if f.target in ("aten.full.default", "aten.ones.default")]
    assert taker and taker[0].reason is Reason.DATA_DEPENDENT_SHAPE
    assert report.graphs[0].host_scalars  # sym_size / asserts, counted apart


def test_index_with_integer_indices_stays_in_jax() -> None:
    # aten.index.Tensor carries the dynamic_output_shape tag; with integer indices its
    # shape is known, so it is not refused.
    report = compare_with_eager(lambda x, i: x[i] * 2, torch.randn(6, 3), torch.tensor([0, 2, 5]))
    assert report.fallbacks == []


# ---------------------------------------------------------------------------------
# DTYPE, USER_FALLBACK, BLOCK_TOO_SMALL
# ---------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_dtype_jax_lacks() -> None:
    from dynajax.lowering.dtypes import TORCH_TO_JAX

    assert torch.complex32 not in TORCH_TO_JAX  # JAX has no complex32

    def f(x):
        return x.to(torch.complex32).to(torch.complex64).real + x.sin()

    report = compare_with_eager(f, torch.randn(5))
    dtype = [fb for fb in report.fallbacks if fb.reason is Reason.DTYPE]
    assert dtype and all("torch.complex32 has no JAX equivalent" in fb.detail for fb in dtype)
    assert all(fb.target == "aten._to_copy.default" for fb in dtype)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_dtype_is_decided_before_the_table() -> None:
    # norule has no JAX rule, but on complex32 a rule could not help either: the report
    # says DTYPE, and the what-if list does not suggest writing a rule.
    def f(x):
        return norule(x.to(torch.complex32)).to(torch.complex64).real

    report = compare_with_eager(f, torch.randn(5))
    reasons = {fb.target: fb.reason for fb in report.fallbacks}
    assert reasons["dynajax_captest.norule.default"] is Reason.DTYPE
    assert report.what_if() == []


def test_a_dtype_eager_refuses_runs_in_eager_and_raises_there() -> None:
    # abs_cpu has no bool kernel (its meta kernel takes bool): the node stays in
    # PyTorch with eager's message as the detail, and the call raises eager's error.
    compiled, backend = compile_with(lambda x: torch.abs(x.sin() > 0))
    with pytest.raises(NotImplementedError, match="not implemented for 'Bool'"):
        compiled(torch.randn(4))
    [fb] = report_of(backend).fallbacks
    assert (fb.target, fb.reason) == ("aten.abs.default", Reason.EAGER_REFUSES)
    assert "abs_cpu" in fb.detail


def test_a_decomposition_steps_aside_where_eager_refuses() -> None:
    # softplus decomposes into exp and log1p, which take int64; kept whole, it is refused.
    compiled, backend = compile_with(lambda x: F.softplus(x * 2))
    with pytest.raises(NotImplementedError, match="softplus_cpu"):
        compiled(torch.tensor([1, -2]))
    [fb] = report_of(backend).fallbacks
    assert (fb.target, fb.reason) == ("aten.softplus.default", Reason.EAGER_REFUSES)


# grad, input, weight, bias sizes, stride, padding, dilation, transposed, output
# padding, groups, output mask: conv2d of (2, 8, 2, 2) by (8, 8, 3, 3), padding 1.
_CONV_BACKWARD = (
    *(torch.ones(2, 8, 2, 2), torch.ones(2, 8, 2, 2), torch.ones(8, 8, 3, 3)),
    *([8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]),
)


# grad, indices, num_weights, padding_idx, scale_grad_by_freq.
_EMBEDDING_BACKWARD = (torch.ones(4, 3), torch.tensor([0, 5, 9, 2]), 10, -1, False)


@pytest.mark.parametrize(
    "op, args, refused",
    [
        (aten.relu.default, (torch.ones(3, dtype=torch.bool),), "Boolean inputs"),
        (
            aten.mm.default,
            (torch.ones(2, 3, dtype=torch.bool), torch.ones(3, 2, dtype=torch.bool)),
            "addmm_impl_cpu_",
        ),
        # Not probed: an op that is not pointwise runs at the node's sizes, up to
        # _EXACT_LIMIT elements a tensor (a documented gap).
        (aten.mm.default, (torch.ones(100, 100, dtype=torch.bool),) * 2, None),
        (aten.relu.default, (torch.ones(3),), None),
        (aten.sub.Tensor, (torch.ones(3, dtype=torch.bool), 1), "Subtraction"),
        # Ops with size arguments, or whose CPU kernel checks sizes its meta kernel
        # does not: probed at the node's own sizes, they pass.
        (aten.view.default, (torch.ones(6, dtype=torch.int64), [2, 3]), None),
        (aten.convolution_backward.default, _CONV_BACKWARD, None),
        (aten.embedding_dense_backward.default, _EMBEDDING_BACKWARD, None),
        # Raises on zeros (an integer division by zero): the values', not the dtype's.
        (aten.remainder.Tensor, (torch.ones(3, dtype=torch.int64),) * 2, None),
    ],
    ids=[
        "relu-bool",
        "mm-bool",
        "mm-bool-large",
        "relu-float32",
        "sub-bool",
        "view-sizes",
        "convolution_backward-sizes",
        "embedding_dense_backward-sizes",
        "remainder-int64",
    ],
)
def test_eager_refusal_asks_the_kernel(op, args, refused) -> None:
    from dynajax.capability.eager_kernel import eager_refusal

    # The node's output, as its fake tensor would record it (the meta kernel).
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    found = eager_refusal(op, args, {}, op(*meta))
    assert found is None if refused is None else refused in found


def test_eager_refusal_of_a_random_op_leaves_the_random_stream_alone() -> None:
    from dynajax.capability.eager_kernel import _probe, eager_refusal

    _probe.cache_clear()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert eager_refusal(aten.bernoulli.default, (torch.ones(4),), {}) is None
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "entry",
    ["aten.cos", "aten.cos.default", aten.cos, aten.cos.default],
    ids=["packet-name", "overload-name", "packet", "overload"],
)
def test_user_fallback(entry) -> None:
    report = compare_with_eager(
        lambda x: torch.cos(torch.sin(x)) + 1, torch.randn(8), fallback_ops=[entry]
    )
    [fb] = report.fallbacks
    assert (fb.target, fb.reason) == ("aten.cos.default", Reason.USER_FALLBACK)
    assert len(report.partitions) == 2


def test_block_too_small() -> None:
    def f(x):
        a = norule(x.sin())
        return norule(a.cos() * a.exp() + 1)

    report = compare_with_eager(f, torch.randn(8), min_block_size=3)
    small = [fb for fb in report.fallbacks if fb.reason is Reason.BLOCK_TOO_SMALL]
    assert [fb.target for fb in small] == ["aten.sin.default"]
    assert "min_block_size=3" in small[0].detail
    assert [p.op_count for p in report.partitions] == [4]


# ---------------------------------------------------------------------------------
# Source lines point at the user's code, forward and backward
# ---------------------------------------------------------------------------------


def test_source_line_skips_library_frames_forward_and_backward() -> None:
    def f(x):
        y = norule(x)
        return F.softmax(y * 2, dim=-1).sum()

    x = torch.randn(3, 5, requires_grad=True)
    backend = dynajax.Backend(fallback_ops=["aten._softmax"])
    torch.compile(f, backend=backend)(x).backward()
    forward, backward = backend.graphs
    assert (forward.kind, backward.kind) == ("forward", "backward")
    lines = {fb.target: fb.source_line for fb in forward.fallbacks}
    # F.softmax's innermost frame is torch/nn/functional.py; the user's line is reported.
    assert lines["aten._softmax.default"].startswith(f"{__file__}:")
    assert "return F.softmax(y * 2, dim=-1).sum()" in lines["aten._softmax.default"]
    assert "y = norule(x)" in lines["dynajax_captest.norule.default"]
    # Backward nodes carry the line of the forward op they differentiate.
    [bw] = [fb for fb in backward.fallbacks if fb.target == "dynajax_captest.norule.default"]
    assert bw.source_line.startswith(f"{__file__}:")
    assert "y = norule(x)" in bw.source_line
    x2 = x.detach().clone().requires_grad_()
    f(x2).backward()
    assert_same(x.grad, x2.grad)


def test_unbacked_sizes_across_forward_and_backward() -> None:
    def f(x, w):
        h = torch.tanh(x @ w)
        picked = h[h > 0]  # data-dependent size u0, differentiated through
        return picked.sum() * torch.nonzero(h > 0).shape[0] + h.square().mean()

    x, w = torch.randn(5, 4), torch.randn(4, 3, requires_grad=True)
    backend = dynajax.Backend()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out = torch.compile(f, backend=backend)(x, w)
        out.backward()
    w2 = w.detach().clone().requires_grad_()
    expected = f(x, w2)
    expected.backward()
    assert_same(out, expected)
    assert_same(w.grad, w2.grad)
    report = dynajax.Report(backend.graphs)
    assert {g.kind for g in report.graphs} == {"forward", "backward"}
    assert all(g.partitions for g in report.graphs)
    forward = next(g for g in report.graphs if g.kind == "forward")
    assert {f.reason for f in forward.fallbacks} == {Reason.DATA_DEPENDENT_SHAPE}


def test_linalg_error_check_runs_on_the_host_after_jax() -> None:
    # linalg.inv is inv_ex in JAX plus an effectful _linalg_check_errors(info): the
    # check reads info on the host and is not a fallback of tensor work. A singular
    # matrix raises eager's own error, message included (checked first: it is what
    # matters on every torch release; torch 2.11 makes no with_effects node of it).
    compiled = torch.compile(torch.linalg.inv, backend=dynajax.Backend())
    with pytest.raises(torch.linalg.LinAlgError) as eager:
        torch.linalg.inv(torch.zeros(3, 3))
    with pytest.raises(torch.linalg.LinAlgError, match="singular") as got:
        compiled(torch.zeros(3, 3))
    assert str(got.value) == str(eager.value)
    report = compare_with_eager(torch.linalg.inv, torch.randn(3, 3) + 3 * torch.eye(3))
    assert report.fallbacks == [], report.text(width=None)
    assert [v.target for v in report.graphs[0].host_scalars] == [
        "torch.ops.higher_order.with_effects"
    ]


# ---------------------------------------------------------------------------------
# Kernels whose outputs differ by device
# ---------------------------------------------------------------------------------


def _batch_norms() -> dict[str, object]:
    return {
        "no_training": lambda x, *p: aten._native_batch_norm_legit_no_training(*(x, *p), 0.1, 1e-5),
        "legit eval": lambda x, *p: aten._native_batch_norm_legit(x, *p, False, 0.1, 1e-5),
        "functional train": lambda x, *p: aten._native_batch_norm_legit_functional(
            x, *p, True, 0.1, 1e-5
        ),
        "functional eval": lambda x, *p: aten._native_batch_norm_legit_functional(
            x, *p, False, 0.1, 1e-5
        ),
        "with_update": lambda x, *p: aten._batch_norm_with_update_functional(x, *p, 0.1, 1e-5),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("form", list(_batch_norms()))
def test_batch_norm_saved_stats_follow_the_device(form: str, device: str, dtype) -> None:
    """Eager's CUDA batch norm saves one statistic per channel in evaluation mode too
    (the CPU's are empty), in float32 for half inputs (the CPU's in the input's dtype).
    The rule follows the device of the node it is checked for: on an H100, ResNet-18
    was cut into 18 partitions when it did not (fake CUDA tensors here: CI has no GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from dynajax.capability.support import CapabilityChecker

    with FakeTensorMode():
        x = torch.empty(2, 3, 4, 4, device=device, dtype=dtype)
        params = [torch.empty(3, device=device) for _ in range(4)]
    gm = make_fx(_batch_norms()[form])(x, *params)
    [node] = [n for n in gm.graph.nodes if n.op == "call_function" and "norm" in str(n.target)]
    saved = node.meta["val"][1]
    training = form in ("functional train", "with_update")
    assert saved.shape == ((3,) if device == "cuda" or training else (0,))
    assert CapabilityChecker().decide(node) == Supported(str(node.target))


def test_batch_norm_eval_saved_stats_on_cuda_are_the_running_ones() -> None:
    """What PyTorch's decomposition gives for CUDA (the kernel leaves them unwritten)."""
    from dynajax.lowering.dtypes import eager_on_cuda

    rule = registry.get_rule(aten._native_batch_norm_legit_no_training.default)
    x = jnp.ones((2, 3, 4, 4), jnp.float16)
    mean, var = jnp.array([0.5, 1.0, 2.0]), jnp.array([1.0, 4.0, 0.25])
    with eager_on_cuda(True):
        _, saved_mean, saved_invstd = rule.fn(x, None, None, mean, var, 0.1, 0.0)
    assert saved_mean.dtype == jnp.float32 and saved_invstd.dtype == jnp.float32
    assert saved_mean.tolist() == [0.5, 1.0, 2.0] and saved_invstd.tolist() == [1.0, 0.5, 2.0]
    _, cpu_mean, _ = rule.fn(x, None, None, mean, var, 0.1, 0.0)
    assert cpu_mean.shape == (0,) and cpu_mean.dtype == jnp.float16
