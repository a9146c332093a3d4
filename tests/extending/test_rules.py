"""``dynajax.register_rule``: JAX rules for users' own ops, in the one lowering table.

A custom op with a user rule runs inside the JAX partition, forward and backward (its
gradient from ``jax.vjp`` of the rule, or from the op's own formula when it has one),
matching eager; keys resolve as documented; built-in rules are replaced only with
``override=True`` (and a warning); ``unregister_rule`` puts everything back.

    pytest -q tests/extending/test_rules.py
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import pytest
import torch

import dynajax
from dynajax.capability import Reason
from dynajax.lowering import registry
from tests.helpers import assert_no_fallbacks, compile_with, report_of
from tests.tolerances import assert_same

# -- test ops (namespace dynajax_test_rules; defined once per process) ----------------------


@torch.library.custom_op("dynajax_test_rules::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    return limit * torch.tanh(x / limit)


@soft_clip.register_fake
def _soft_clip_fake(x: torch.Tensor, limit: float) -> torch.Tensor:
    return torch.empty_like(x)


def torch_soft_clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    """The same function in differentiable torch ops: the reference for gradients."""
    return limit * torch.tanh(x / limit)


def jax_soft_clip(x, limit):
    return limit * jnp.tanh(x / limit)


# An op with two outputs, a list input and a dtype argument.
@torch.library.custom_op("dynajax_test_rules::mix", mutates_args=())
def mix(
    xs: list[torch.Tensor], w: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    total = sum(xs) * w
    return total.to(dtype), total.sum(-1)


@mix.register_fake
def _mix_fake(xs, w, dtype):
    total = torch.empty_like(xs[0])
    return total.to(dtype), total.sum(-1)


def torch_mix(xs, w, dtype):
    total = sum(xs) * w
    return total.to(dtype), total.sum(-1)


def jax_mix(xs, w, dtype):
    total = sum(xs) * w
    return total.astype(dtype), total.sum(-1)


# An op with its own autograd formula, whose backward is another custom op.
@torch.library.custom_op("dynajax_test_rules::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@cube.register_fake
def _cube_fake(x):
    return torch.empty_like(x)


@torch.library.custom_op("dynajax_test_rules::cube_backward", mutates_args=())
def cube_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return 3 * x * x * grad


@cube_backward.register_fake
def _cube_backward_fake(x, grad):
    return torch.empty_like(x)


def _cube_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _cube_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return cube_backward(x, grad)


cube.register_autograd(_cube_grad, setup_context=_cube_setup)


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Ops named in the list are unregistered after the test (whatever it did)."""
    names: list[str] = []
    yield names
    for name in names:
        for op in dynajax.extending.resolve_ops(name):
            rule = registry.get_rule(op)
            if rule is not None and rule.user:
                dynajax.unregister_rule(op)


# -- forward and backward in one partition ------------------------------------------------


def test_custom_op_runs_inside_the_partition_forward_and_backward(registered) -> None:
    dynajax.register_rule("dynajax_test_rules::soft_clip")(jax_soft_clip)
    registered.append("dynajax_test_rules::soft_clip")

    def f(x, w):
        return soft_clip(x @ w, 2.0).sin().sum(), None

    def reference(x, w):
        return torch_soft_clip(x @ w, 2.0).sin().sum()

    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    compiled, backend = compile_with(f, cache_dir="")
    out, _ = compiled(x, w)
    out.backward()
    got = (out.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    expected = reference(x, w)
    expected.backward()
    assert_same(got, (expected.detach(), x.grad, w.grad))

    report = report_of(backend)
    assert_no_fallbacks(report)
    assert {g.kind for g in report.graphs} == {"forward", "backward"}
    for graph in report.graphs:
        assert len(graph.partitions) == 1, report.text(width=None)
    ops = {g.kind: {op for p in g.partitions for op in p.ops} for g in report.graphs}
    assert "dynajax_test_rules.soft_clip.default" in ops["forward"], report.text(width=None)
    assert "dynajax.call_jax.default" in ops["backward"], report.text(width=None)


def test_installed_backward_works_in_eager_and_is_removed(registered) -> None:
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        soft_clip(x, 1.5).sum().backward()
    dynajax.register_rule("dynajax_test_rules::soft_clip")(jax_soft_clip)
    registered.append("dynajax_test_rules::soft_clip")
    (grad,) = torch.autograd.grad(soft_clip(x, 1.5).sum(), x)
    (expected,) = torch.autograd.grad(torch_soft_clip(x, 1.5).sum(), x)
    assert_same(grad, expected)
    dynajax.unregister_rule("dynajax_test_rules::soft_clip")
    with pytest.raises(RuntimeError, match="no autograd formula"):
        soft_clip(x, 1.5).sum().backward()


def test_two_outputs_list_input_and_dtype_argument(registered) -> None:
    dynajax.register_rule(torch.ops.dynajax_test_rules.mix)(jax_mix)
    registered.append("dynajax_test_rules::mix")
    torch.manual_seed(0)
    a, b, w = (torch.randn(3, 4, requires_grad=True) for _ in range(3))

    def f(a, b, w):
        half, rows = mix([a, b], w, torch.float64)
        return half.sum() + rows.pow(2).sum()

    def reference(a, b, w):
        half, rows = torch_mix([a, b], w, torch.float64)
        return half.sum() + rows.pow(2).sum()

    compiled, backend = compile_with(f, cache_dir="")
    out = compiled(a, b, w)
    got = (out, *torch.autograd.grad(out, (a, b, w)))
    expected_out = reference(a, b, w)
    expected = (expected_out, *torch.autograd.grad(expected_out, (a, b, w)))
    assert_same(got, expected)
    assert_no_fallbacks(backend)


def test_own_autograd_formula_is_kept_and_its_backward_op_lowered(registered) -> None:
    dynajax.register_rule("dynajax_test_rules::cube")(lambda x: x * x * x)
    dynajax.register_rule("dynajax_test_rules::cube_backward")(lambda x, g: 3 * x * x * g)
    registered += ["dynajax_test_rules::cube", "dynajax_test_rules::cube_backward"]
    x = torch.randn(6, requires_grad=True)
    compiled, backend = compile_with(lambda x: cube(x).sum(), cache_dir="")
    (grad,) = torch.autograd.grad(compiled(x), x)
    assert_same(grad, 3 * x.detach() ** 2)
    report = report_of(backend)
    assert_no_fallbacks(report)
    ops = {op for g in report.graphs for p in g.partitions for op in p.ops}
    assert "dynajax_test_rules.cube_backward.default" in ops, report.text(width=None)
    assert "dynajax.call_jax.default" not in ops, report.text(width=None)


def test_without_a_rule_the_op_falls_back() -> None:
    x = torch.randn(4)
    compiled, backend = compile_with(lambda x: soft_clip(x.cos(), 2.0) + 1, cache_dir="")
    assert_same(compiled(x), torch_soft_clip(x.cos(), 2.0) + 1)
    (fallback,) = report_of(backend).fallbacks
    assert fallback.reason is Reason.NO_LOWERING
    assert str(fallback.target) == "dynajax_test_rules.soft_clip.default"


def test_check_refuses_like_a_built_in_check(registered) -> None:
    def _soft_clip_check(x, limit):
        return None if limit > 0 else f"limit must be positive, got {limit}"

    dynajax.register_rule("dynajax_test_rules::soft_clip", check=_soft_clip_check)(jax_soft_clip)
    registered.append("dynajax_test_rules::soft_clip")
    x = torch.randn(4)
    compiled, backend = compile_with(lambda x: soft_clip(x, -1.0), cache_dir="")
    assert_same(compiled(x), torch_soft_clip(x, -1.0))
    (fallback,) = report_of(backend).fallbacks
    assert fallback.reason is Reason.CHECK_REFUSED
    assert fallback.detail == "limit must be positive, got -1.0"


def test_rule_with_wrong_shape_is_refused_not_run(registered) -> None:
    dynajax.register_rule("dynajax_test_rules::soft_clip")(lambda x, limit: x.sum())
    registered.append("dynajax_test_rules::soft_clip")
    x = torch.randn(4)
    compiled, backend = compile_with(lambda x: soft_clip(x, 2.0), cache_dir="")
    assert_same(compiled(x), torch_soft_clip(x, 2.0))
    (fallback,) = report_of(backend).fallbacks
    assert fallback.reason is Reason.CHECK_REFUSED
    assert "float32[]" in fallback.detail and "float32[4]" in fallback.detail


# -- keys, overrides, unregistering ---------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "dynajax_test_rules::soft_clip",
        "dynajax_test_rules.soft_clip",
        "torch.ops.dynajax_test_rules.soft_clip",
        "dynajax_test_rules::soft_clip.default",
        torch.ops.dynajax_test_rules.soft_clip,
        torch.ops.dynajax_test_rules.soft_clip.default,
    ],
    ids=["name", "dotted", "torch-ops", "overload-name", "packet", "overload"],
)
def test_keys_name_the_op(key, registered) -> None:
    dynajax.register_rule(key)(jax_soft_clip)
    registered.append("dynajax_test_rules::soft_clip")
    rule = registry.get_rule(torch.ops.dynajax_test_rules.soft_clip.default)
    assert rule is not None and rule.user and rule.fn is jax_soft_clip
    assert "test_rules.py" in rule.where
    dynajax.unregister_rule(key)
    assert registry.get_rule(torch.ops.dynajax_test_rules.soft_clip.default) is None


def test_a_name_without_overload_names_every_overload() -> None:
    assert dynajax.extending.resolve_ops("aten::sort") == [
        getattr(torch.ops.aten.sort, name) for name in torch.ops.aten.sort.overloads()
    ]


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("dynajax_test_rules::nope", "there is no op dynajax_test_rules::nope"),
        ("dynajax_test_rules::soft_clip.Tensor", "has no overload 'Tensor'"),
        ("soft_clip", "is not an op name"),
    ],
    ids=["no-op", "no-overload", "no-namespace"],
)
def test_bad_keys_raise(key: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dynajax.register_rule(key)


def test_decomposed_ops_are_refused() -> None:
    lib = torch.library.Library("dynajax_test_rules_implicit", "FRAGMENT")
    try:
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
        with pytest.raises(ValueError, match="CompositeImplicitAutograd"):
            dynajax.register_rule("dynajax_test_rules_implicit::twice")
    finally:
        lib._destroy()


@torch.library.custom_op("dynajax_test_rules::add_one_", mutates_args=("x",))
def add_one_(x: torch.Tensor) -> None:
    x.add_(1)


def test_mutating_ops_are_refused() -> None:
    with pytest.raises(ValueError, match="mutates or aliases its arguments"):
        dynajax.register_rule("dynajax_test_rules::add_one_")


def test_registering_over_a_rule_needs_override(registered) -> None:
    with pytest.raises(ValueError, match=r"already has a built-in rule .*override=True"):
        dynajax.register_rule(torch.ops.aten.sin.default)(jnp.cos)
    dynajax.register_rule("dynajax_test_rules::soft_clip")(jax_soft_clip)
    registered.append("dynajax_test_rules::soft_clip")
    with pytest.raises(ValueError, match="already has a rule registered by dynajax.register_rule"):
        dynajax.register_rule("dynajax_test_rules::soft_clip")(jax_soft_clip)
    replacement = dynajax.register_rule("dynajax_test_rules::soft_clip", override=True)(jnp.tanh)
    assert registry.get_rule(torch.ops.dynajax_test_rules.soft_clip.default).fn is replacement
    dynajax.unregister_rule("dynajax_test_rules::soft_clip")  # back to no rule at all
    assert registry.get_rule(torch.ops.dynajax_test_rules.soft_clip.default) is None


def test_override_of_a_built_in_warns_and_unregister_restores_it(registered) -> None:
    builtin = registry.get_rule(torch.ops.aten.sin.default)
    x = torch.randn(8)
    with pytest.warns(dynajax.RuleOverrideWarning, match="replaces dynajax's built-in rule"):
        dynajax.register_rule(torch.ops.aten.sin.default, override=True)(jnp.cos)
    registered.append("aten::sin.default")
    compiled, _ = compile_with(torch.sin, cache_dir="")
    assert_same(compiled(x), torch.cos(x))  # the user's (wrong, planted) rule is used
    dynajax.unregister_rule(torch.ops.aten.sin.default)
    assert registry.get_rule(torch.ops.aten.sin.default) is builtin
    torch._dynamo.reset()
    compiled, _ = compile_with(torch.sin, cache_dir="")
    assert_same(compiled(x), torch.sin(x))


def test_unregister_without_a_user_rule_raises() -> None:
    with pytest.raises(ValueError, match="nothing to unregister"):
        dynajax.unregister_rule(torch.ops.aten.sin.default)


def test_user_rule_serves_jax_function(registered) -> None:
    dynajax.register_rule("dynajax_test_rules::soft_clip")(jax_soft_clip)
    registered.append("dynajax_test_rules::soft_clip")

    class Model(torch.nn.Module):
        def forward(self, x):
            return soft_clip(x * 3, 2.0)

    x = torch.randn(4, 3)
    fn, state = dynajax.jax_function(Model(), x, strict=True)
    out = fn(state, jnp.asarray(x.numpy()))
    assert_same(torch.from_numpy(jax.device_get(out).copy()), torch_soft_clip(x * 3, 2.0))
