"""run_passes (``dynajax/passes/pipeline.py``): every pass in order on one graph, the
graph linted, the module recompiled, and the values unchanged.

    pytest -q tests/passes/test_pipeline.py
"""

from __future__ import annotations

import pytest
import torch

from dynajax.passes import run_passes
from dynajax.passes.user import CallablePass
from tests.helpers import GraphCase, count_recompiles, draws, op_counts, run_graph, trace
from tests.tolerances import assert_same

aten = torch.ops.aten

ALIAS, DETACH, COS = "aten.alias.default", "aten.detach.default", "aten.cos.default"
SVD, SYM_SIZE, ADD = "aten._linalg_svd.default", "aten.sym_size.int", "operator.add"


def _noops_dead_code_and_values(a):
    a.cos()  # dead
    return torch.linalg.svdvals(aten.alias.default(a.detach())) * 2


def _kv_cache_step(cache, new):
    c = torch.cat([aten.alias.default(cache), new], dim=1)
    c.exp()  # dead
    return c.view(c.shape[0] * c.shape[1], -1) * 2


PIPELINE = [
    GraphCase(
        "noops-dead-code-and-unused-vectors",
        _noops_dead_code_and_values,
        draws(lambda: (torch.randn(5, 3, dtype=torch.float64),)),
        {ALIAS: 1, DETACH: 1, COS: 1, SVD: 1, "operator.getitem": 3},
        after={ALIAS: 0, DETACH: 0, COS: 0, SVD: 1, "operator.getitem": 1},
        modified=True,
        tracing_mode="fake",
    ),
    GraphCase(
        "sizes-of-a-kv-cache",
        _kv_cache_step,
        lambda: [
            (torch.randn(2, 3, 4), torch.randn(2, 1, 4)),
            (torch.randn(1, 6, 4), torch.randn(1, 1, 4)),
        ],
        {ALIAS: 1, "aten.exp.default": 1, SYM_SIZE: 2, ADD: 0},
        after={ALIAS: 0, "aten.exp.default": 0, SYM_SIZE: 2, ADD: 1},
        modified=True,
        tracing_mode="symbolic",
    ),
    GraphCase(
        "nothing-to-do",
        lambda x, y: (x @ y).relu().sum(-1),
        draws(lambda: (torch.randn(3, 4), torch.randn(4, 2))),
        {"aten.mm.default": 1, "aten.relu.default": 1},
    ),
]


@pytest.mark.parametrize("case", PIPELINE, ids=[c.id for c in PIPELINE])
def test_run_passes(case: GraphCase) -> None:
    gm, inputs = trace(case)
    assert op_counts(gm, case.before) == case.before, gm.graph
    code_before = gm.code
    expected = run_graph(gm, inputs)
    out = run_passes(gm)
    out.graph.lint()
    assert op_counts(out, case.after) == case.after, out.graph
    for node in out.graph.nodes:  # what each pass leaves behind
        if node.target is aten.sym_size.int:
            assert node.args[0].op == "placeholder", node.format_node()
        if node.target is aten._linalg_svd.default:
            assert node.kwargs.get("compute_uv") is False, node.format_node()
    # The module runs the code of its graph as it is now.
    assert out.code == out.graph.python_code("self").src
    assert (out.code != code_before) is case.modified
    assert_same(run_graph(out, inputs), expected)


def test_an_invalid_graph_is_refused_by_the_lint() -> None:
    gm, _ = trace(PIPELINE[-1])
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    mm = relu.args[0]
    relu.append(mm)  # mm now comes after its user
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        run_passes(gm)


def test_the_module_is_recompiled_once_and_fresh_for_a_users_pass(monkeypatch) -> None:
    # Several of dynajax's passes change the graph; its code is made once, at the end
    # (0.17 s a recompile on a deep model's step), and a user's pass after them calls a
    # module whose code is the graph's.
    gm, args = trace(PIPELINE[0])
    counts = count_recompiles(monkeypatch)
    out = run_passes(gm)
    assert counts["recompiles"] == 1
    assert op_counts(out, [COS])[COS] == 0 and "cos" not in out.code  # code fresh

    seen = []

    def users_pass(module: torch.fx.GraphModule) -> None:
        seen.append(("cos" in module.code, module(*args[0])))

    gm, args = trace(PIPELINE[0])
    expected = run_graph(gm, args[:1])[0][0]
    counts["recompiles"] = 0
    run_passes(gm, after=[CallablePass(users_pass)])
    assert counts["recompiles"] == 2  # before the user's pass, and after it
    [(has_cos, values)] = seen
    assert not has_cos
    assert_same(values, expected)
