"""Users' passes (option ``passes``, at the stages ``pre_aot``, ``post_aot`` and
``post_passes``) and pattern rewrites (option ``rewrites``): each runs where documented,
changes what is compiled (the persistent cache included), and the report shows the
rewrites; bad options are refused with a clear message.

    pytest -q tests/passes/test_user.py
"""

from __future__ import annotations

import math
import pathlib

import jax.numpy as jnp
import pytest
import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

import dynajax
from dynajax.errors import OptionsError
from dynajax.passes.user import CallablePass
from tests.helpers import assert_no_fallbacks, compile_with, partition_ops, report_of
from tests.tolerances import assert_same

aten = torch.ops.aten


def _sin_to_cos(gm: torch.fx.GraphModule) -> None:
    """A pass in place: every aten.sin becomes aten.cos."""
    for node in gm.graph.nodes:
        if node.target is aten.sin.default:
            node.target = aten.cos.default


def _alias_before_sin(gm: torch.fx.GraphModule) -> None:
    """Puts a no-op alias before each sin (dynajax's RemoveNoopOps takes it out)."""
    for node in list(gm.graph.nodes):
        if node.target is aten.sin.default:
            with gm.graph.inserting_before(node):
                alias = gm.graph.call_function(aten.alias.default, (node.args[0],))
            alias.meta["val"] = node.args[0].meta["val"]
            node.replace_input_with(node.args[0], alias)


class RecordTargets(PassBase):
    """Records the call_function and call_method targets of every graph it sees;
    changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[str]] = []

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        self.seen.append(
            [
                str(n.target)
                for n in graph_module.graph.nodes
                if n.op in ("call_function", "call_method")
            ]
        )
        return PassResult(graph_module, False)


def test_post_aot_pass_changes_the_aten_graph_before_capability() -> None:
    x = torch.randn(8)
    compiled, backend = compile_with(lambda x: x.sin() + 1, passes={"post_aot": _sin_to_cos})
    assert_same(compiled(x), x.cos() + 1)
    assert "aten.cos.default" in partition_ops(backend)
    assert "aten.sin.default" not in partition_ops(backend)


def test_stages_see_their_graphs_forward_and_backward() -> None:
    pre, post_aot, post_passes = RecordTargets(), RecordTargets(), RecordTargets()
    x = torch.randn(4, 4, requires_grad=True)

    def f(x):
        return (x.t().contiguous() * 2).sin().sum()

    compiled, backend = compile_with(
        f,
        passes={
            "pre_aot": pre,
            "post_aot": [_alias_before_sin, post_aot],
            "post_passes": (post_passes,),
        },
    )
    (grad,) = torch.autograd.grad(compiled(x), x)
    assert_same(grad, torch.autograd.grad(f(x), x)[0])
    assert len(pre.seen) == 1 and "aten" not in " ".join(pre.seen[0])  # torch-level graph
    assert "sin" in pre.seen[0]  # call_method sin, as the user wrote it
    assert len(post_aot.seen) == len(post_passes.seen) == 2  # forward and backward
    assert all(t.startswith(("aten.", "<built-in")) for g in post_aot.seen for t in g)
    # dynajax's passes ran between them: the no-op alias is gone after them.
    assert "aten.alias.default" in post_aot.seen[0]
    assert "aten.alias.default" not in post_passes.seen[0]
    assert_no_fallbacks(backend)


def test_a_pass_that_changes_the_graph_changes_the_cache_key(tmp_path: pathlib.Path) -> None:
    x = torch.randn(8)
    compiled, _ = compile_with(lambda x: x.sin() * 3, cache_dir=str(tmp_path))
    assert_same(compiled(x), x.sin() * 3)
    torch._dynamo.reset()
    compiled, backend = compile_with(
        lambda x: x.sin() * 3, cache_dir=str(tmp_path), passes={"post_passes": _sin_to_cos}
    )
    assert_same(compiled(x), x.cos() * 3)
    stats = report_of(backend).compile_stats
    assert stats.cache_hits == 0 and stats.xla_compiles == 1


def test_pass_returning_something_else_is_an_error() -> None:
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(TypeError, match="returned int; a pass changes the GraphModule in place"):
        CallablePass(lambda gm: 42)(gm)
    compiled, _ = compile_with(lambda x: x + 1, passes={"post_aot": lambda gm: 42})
    with pytest.raises(Exception, match="error occurred when running the 'CallablePass' pass"):
        compiled(torch.randn(3))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"passes": {"after_aot": _sin_to_cos}}, r"unknown stage\(s\) \['after_aot'\]"),
        ({"passes": [_sin_to_cos]}, "passes must be a mapping of stage to passes"),
        ({"passes": {"post_aot": [42]}}, "a pass must be a torch.fx PassBase or a function"),
        ({"rewrites": [42]}, r"a rewrite is a dynajax.Rewrite\(pattern, replacement\)"),
        ({"rewrites": [(42, 43)]}, "Rewrite needs a pattern function and a replacement"),
    ],
    ids=["unknown-stage", "not-a-mapping", "not-a-pass", "not-a-rewrite", "not-functions"],
)
def test_bad_options_are_refused(options, message) -> None:
    with pytest.raises(OptionsError, match=message):
        dynajax.Backend(**options)


# -- rewrites -------------------------------------------------------------------------------


def gelu_tanh_pattern(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3))))


def _gelu_tanh_jax(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_tanh_replacement(x):
    return dynajax.call_jax(_gelu_tanh_jax, x)


class TwoGelus(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3))))
        h = self.b(h)
        # a different constant: not this pattern, left as it is
        return 0.5 * h * (1.0 + torch.tanh(0.79 * (h + 0.044715 * torch.pow(h, 3))))


def test_rewrite_replaces_matches_and_the_report_shows_them() -> None:
    torch.manual_seed(0)
    model, x = TwoGelus(), torch.randn(4, 8, requires_grad=True)
    rewrite = dynajax.Rewrite(gelu_tanh_pattern, gelu_tanh_replacement, name="gelu-tanh")
    compiled, backend = compile_with(model, rewrites=[rewrite])
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    expected = model(x)
    assert_same((out, grad), (expected, torch.autograd.grad(expected.sum(), x)[0]))

    report = report_of(backend)
    assert_no_fallbacks(report)
    forward = next(g for g in report.graphs if g.kind == "forward")
    (record,) = forward.rewrites
    assert (record.name, record.matches) == ("gelu-tanh", 1)
    assert "test_user.py" in record.sources[0] and "torch.tanh(0.797" in record.sources[0]
    assert all(not g.rewrites for g in report.graphs if g.kind == "backward")
    text = report.text(width=None)
    assert "gelu-tanh (pattern gelu_tanh_pattern): 1 match(es)" in text
    assert "dynajax.call_jax.default" in partition_ops(report)
    assert "aten.tanh.default" in partition_ops(report)  # the second, unmatched one


def test_rewrite_given_as_a_pair_and_literals_ignored() -> None:
    torch.manual_seed(0)
    model, x = TwoGelus(), torch.randn(4, 8)
    compiled, backend = compile_with(
        model,
        rewrites=[dynajax.Rewrite(gelu_tanh_pattern, gelu_tanh_replacement, ignore_literals=True)],
    )
    with torch.no_grad():
        # both match now, and the second is (knowingly) replaced by the exact constant
        expected = model.b(torch.nn.functional.gelu(model.a(x), approximate="tanh"))
        expected = torch.nn.functional.gelu(expected, approximate="tanh")
        assert_same(compiled(x), expected)
    (record,) = [r for g in report_of(backend).graphs for r in g.rewrites]
    assert record.matches == 2

    torch._dynamo.reset()
    compiled, backend = compile_with(model, rewrites=[(gelu_tanh_pattern, gelu_tanh_replacement)])
    with torch.no_grad():
        assert_same(compiled(x), model(x))
    (record,) = [r for g in report_of(backend).graphs for r in g.rewrites]
    assert record.name == "gelu_tanh_pattern" and record.matches == 1


def test_no_match_records_nothing() -> None:
    x = torch.randn(3)
    compiled, backend = compile_with(
        lambda x: x.cos(), rewrites=[(gelu_tanh_pattern, gelu_tanh_replacement)]
    )
    assert_same(compiled(x), x.cos())
    assert all(not g.rewrites for g in report_of(backend).graphs)
    assert "rewrites" not in report_of(backend).text(width=None)


# -- the same passes and rewrites in jax_function and export ---------------------------


class SinModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.sin(self.lin(x))


def test_jax_function_and_export_apply_post_aot_passes() -> None:
    import jax
    import numpy as np

    torch.manual_seed(0)
    model, x = SinModel(), torch.randn(3, 4)
    seen = RecordTargets()
    fn, state = dynajax.jax_function(
        model, x, passes={"post_aot": _sin_to_cos, "post_passes": seen}
    )
    with torch.no_grad():
        expected = torch.cos(model.lin(x))
    assert_same(torch.from_dlpack(jax.jit(fn)(state, x.numpy())), expected)
    assert "aten.cos.default" in seen.seen[-1] and "aten.sin.default" not in seen.seen[-1]
    assert set(state) == {"lin.weight", "lin.bias"}
    exported = dynajax.export(model, x, passes={"post_aot": [_sin_to_cos]})
    np.testing.assert_allclose(np.asarray(exported.call(x)), expected.numpy(), rtol=1e-6)
    # pre_aot: Dynamo's torch-level graph, as in the backend (torch.sin, not aten.sin).
    torch_level = RecordTargets()
    fn, state = dynajax.jax_function(model, x, passes={"pre_aot": torch_level})
    assert any("sin" in t and "aten" not in t for t in torch_level.seen[0])
    assert set(state) == {"lin.weight", "lin.bias"}


def _add_a_constant(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A post_aot pass that adds a tensor, read by ``get_attr``, to the linear's
    output (before the sine)."""
    gm.register_buffer("_offset", torch.full((4,), 0.5))
    [sin] = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sin.default]
    with gm.graph.inserting_before(sin):
        offset = gm.graph.get_attr("_offset")
        shifted = gm.graph.call_function(torch.ops.aten.add.Tensor, (sin.args[0], offset))
    val = sin.args[0].meta["val"]
    offset.meta["val"] = val.fake_mode.from_tensor(gm._offset)
    shifted.meta["val"] = val  # as a pass must: the value each new node computes
    sin.args = (shifted,)
    gm.recompile()
    return gm


def test_a_tensor_a_users_pass_adds_to_a_jax_function_is_read_when_it_runs() -> None:
    """(The whole-graph driver's constants reach jax_function's calls: before, such a
    graph built and its first call failed.)"""
    import jax
    import numpy as np

    torch.manual_seed(0)
    model, x = SinModel(), torch.randn(3, 4)
    fn, state = dynajax.jax_function(model, x, passes={"post_aot": _add_a_constant})
    with torch.no_grad():
        expected = torch.sin(model.lin(x) + 0.5)
    assert_same(torch.from_numpy(np.asarray(jax.jit(fn)(state, x.numpy()))), expected)


def test_jax_function_applies_rewrites_and_their_gradients() -> None:
    import jax
    import numpy as np

    torch.manual_seed(0)
    model, x = TwoGelus(), torch.randn(4, 8)
    rewrite = dynajax.Rewrite(gelu_tanh_pattern, gelu_tanh_replacement, name="gelu-tanh")
    fn, state = dynajax.jax_function(model, x, rewrites=[rewrite])
    (record,) = fn.rewrites
    assert (record.name, record.matches) == ("gelu-tanh", 1)
    assert "gelu-tanh (pattern gelu_tanh_pattern): 1 match(es)" in fn.report
    assert "dynajax.call_jax.default" in {str(n.target) for n in fn.graph_module.graph.nodes}
    # The state is the model's, by its torch names, not Dynamo's.
    assert set(state) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    with torch.no_grad():
        expected = model(x)
    assert_same(torch.from_dlpack(jax.jit(fn)(state, x.numpy())), expected)
    # jax.grad differentiates the rewritten model (the replacement is JAX's own gelu,
    # equal to the pattern up to rounding): torch.autograd's gradients of the model.
    params, buffers = fn.split_state(state)
    grads = jax.grad(lambda p: fn({**p, **buffers}, x.numpy()).sum())(params)
    model.zero_grad()
    model(x).sum().backward()
    for name, g in grads.items():
        np.testing.assert_allclose(
            np.asarray(g), model.get_parameter(name).grad.numpy(), rtol=1e-5, atol=1e-6
        )
    exported = dynajax.export(model, x, rewrites=[rewrite])
    np.testing.assert_allclose(np.asarray(exported.call(x)), expected.numpy(), rtol=1e-5, atol=1e-6)
