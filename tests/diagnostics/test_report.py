"""The report: what-if list, DOT picture, logging once, structured trace artifact."""

from __future__ import annotations

import logging
import shutil
import sys

import jax.numpy as jnp
import pytest
import torch

import dynajax
from dynajax import DynajaxError, Reason
from dynajax.diagnostics.logs import ARTIFACT_NAME, forget_logged_fallbacks
from dynajax.lowering import registry
from tests.helpers import compare_with_eager


@torch.library.custom_op("dynajax_diagtest::first", mutates_args=())
def first(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@first.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("dynajax_diagtest::second", mutates_args=())
def second(x: torch.Tensor) -> torch.Tensor:
    return x - 1


@second.register_fake
def _(x):
    return torch.empty_like(x)


def chain(x):
    # JAX partitions today: sin | cos | exp | tanh (4).
    a = first(torch.sin(x))  # + rule for first: sin, first, cos -> 3 partitions
    b = second(torch.cos(a))  # + rule for second: cos, second, exp, second, tanh -> 2
    return torch.tanh(second(torch.exp(b)))


# ---------------------------------------------------------------------------------
# What-if
# ---------------------------------------------------------------------------------


def test_what_if_ranks_missing_rules_by_partitions_merged() -> None:
    report = compare_with_eager(chain, torch.randn(8))
    [graph] = report.graphs
    assert len(graph.partitions) == 4
    best, runner_up = graph.what_if
    assert (best.op, best.nodes, best.partitions_before, best.partitions_after) == (
        "dynajax_diagtest.second.default",
        2,
        4,
        2,
    )
    assert (best.merged, best.ops_gained) == (2, 2)
    assert (runner_up.op, runner_up.merged, runner_up.ops_gained) == (
        "dynajax_diagtest.first.default",
        1,
        1,
    )
    # The baseline re-run agrees with the partitions actually compiled.
    assert best.jax_ops_before == graph.jax_ops
    text = report.text(width=None)
    assert "what-if (a rule for this op would give):" in text
    assert "dynajax_diagtest.second.default  4 -> 2 partitions (merges 2), +2 ops" in text


def test_what_if_prediction_matches_compiling_with_the_rule(monkeypatch) -> None:
    [predicted] = [
        w
        for w in compare_with_eager(chain, torch.randn(8)).what_if()
        if w.op.endswith("second.default")
    ]
    registry.supported_ops()
    op = torch.ops.dynajax_diagtest.second.default
    monkeypatch.setitem(registry._TABLE, op, registry.Rule(op, lambda x: x - jnp.ones((), x.dtype)))
    torch._dynamo.reset()
    after = compare_with_eager(chain, torch.randn(8))
    assert len(after.partitions) == predicted.partitions_after
    assert after.jax_ops == predicted.jax_ops_after


def test_what_if_leaves_out_ops_a_rule_cannot_help() -> None:
    def f(x):
        return torch.nonzero(x.sin() > 0).sum() + first(x).sum()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        report = compare_with_eager(f, torch.randn(8))
    assert [w.op for w in report.what_if()] == ["dynajax_diagtest.first.default"]


def test_report_lists_partitions_fallbacks_and_source_lines() -> None:
    text = str(compare_with_eager(chain, torch.randn(8)))
    assert "graph 0 (inference): 7 ATen ops, 4 JAX partition(s), 3 op(s) in PyTorch" in text
    assert "jax_0        1 ops   sin.default x1" in text
    assert "dynajax_diagtest.first.default   first     NO_LOWERING" in text
    assert "at tests/diagnostics/test_report.py:" in text
    assert "(a = first(torch.sin(x))" in text


# ---------------------------------------------------------------------------------
# Pictures
# ---------------------------------------------------------------------------------


def test_to_dot_colours_partitions_and_marks_fallbacks() -> None:
    report = compare_with_eager(chain, torch.randn(8), fallback_ops=["aten.tanh"])
    dot = report.to_dot()
    assert dot.startswith("digraph dynajax {")
    assert 'subgraph cluster_0 {\n    label="graph 0 (inference)";' in dot
    # JAX nodes are filled with their partition's colour; four partitions, four colours.
    assert (
        'g0_sin [label="sin\\nsin.default\\n[jax_0]", shape="box", style="filled,rounded", '
        'fillcolor="#a6cee3"];' in dot
    )
    assert 'g0_exp [label="exp\\nexp.default\\n[jax_2]"' in dot
    for color in ("#a6cee3", "#b2df8a", "#fdbf6f"):
        assert f'fillcolor="{color}"' in dot
    # Fallbacks are red octagons naming their reason, with detail and line as tooltip.
    assert (
        'g0_first [label="first\\ndynajax_diagtest.first.default\\nNO_LOWERING", '
        'shape="octagon"' in dot
    )
    assert 'g0_tanh [label="tanh\\ntanh.default\\nUSER_FALLBACK"' in dot
    assert "test_report.py:" in dot
    assert "g0_sin -> g0_first;" in dot
    assert dot.count(" -> ") >= 7


def test_save_svg_without_pydot_names_the_extra(monkeypatch, tmp_path) -> None:
    report = compare_with_eager(chain, torch.randn(8))
    monkeypatch.setitem(sys.modules, "pydot", None)  # import pydot -> ImportError
    with pytest.raises(DynajaxError, match=r"pip install dynajax\[viz\]"):
        report.save_svg(tmp_path / "r.svg")


def test_save_svg_without_graphviz_says_how_to_install(monkeypatch, tmp_path) -> None:
    pytest.importorskip("pydot", reason="pydot is the viz extra: pip install dynajax[viz]")
    report = compare_with_eager(chain, torch.randn(8))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(DynajaxError, match="Graphviz's `dot` program"):
        report.save_svg(tmp_path / "r.svg")


@pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="Graphviz's dot binary is not installed (apt-get install graphviz)",
)
def test_save_svg_renders(tmp_path) -> None:
    pytest.importorskip("pydot", reason="pydot is the viz extra: pip install dynajax[viz]")
    report = compare_with_eager(chain, torch.randn(8))
    path = tmp_path / "report.svg"
    report.save_svg(path)
    svg = path.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "NO_LOWERING" in svg and "jax_3" in svg


# ---------------------------------------------------------------------------------
# Logging and the structured trace
# ---------------------------------------------------------------------------------


def test_each_distinct_fallback_is_logged_once(caplog) -> None:
    forget_logged_fallbacks()

    def g(x):
        return first(x.cos()) * 3

    with caplog.at_level(logging.INFO, logger="dynajax.capability"):
        compare_with_eager(chain, torch.randn(8))
        torch._dynamo.reset()
        compare_with_eager(g, torch.randn(8))
        compare_with_eager(chain, torch.randn(8), fallback_ops=["aten.sin"])
    messages = [r.getMessage() for r in caplog.records if r.name == "dynajax.capability"]
    first_logs = [m for m in messages if m.startswith("dynajax_diagtest.first.default")]
    second_logs = [m for m in messages if m.startswith("dynajax_diagtest.second.default")]
    user = [m for m in messages if "USER_FALLBACK" in m]
    # chain has two 'second' nodes and g another 'first': one line per (op, reason).
    assert len(first_logs) == 1 and len(second_logs) == 1 and len(user) == 1
    assert "NO_LOWERING" in first_logs[0] and "runs in eager PyTorch" in first_logs[0]
    assert "test_report.py" in first_logs[0]


def test_report_is_a_structured_trace_artifact() -> None:
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record)

    trace_log = torch._logging._internal.trace_log
    handler = Capture()
    trace_log.addHandler(handler)
    try:
        compare_with_eager(chain, torch.randn(8))
    finally:
        trace_log.removeHandler(handler)
    ours = [r for r in records if r.metadata.get("artifact", {}).get("name") == ARTIFACT_NAME]
    [record] = ours
    assert record.metadata["artifact"]["encoding"] == "string"
    assert "dynajax_diagtest.first.default" in record.payload
    assert "what-if" in record.payload


def test_reasons_are_data() -> None:
    assert {r.name for r in Reason} >= {
        "NO_LOWERING",
        "CHECK_REFUSED",
        "DATA_DEPENDENT_SHAPE",
        "DTYPE",
        "BLOCK_TOO_SMALL",
        "USER_FALLBACK",
    }
    assert not Reason.HOST_SCALAR.is_fallback


def test_picture_partitions_are_the_compiled_partitions() -> None:
    import collections
    import operator

    def f(x):
        y = first(x.sin() * 2)
        return second(y.cos().exp()), y.tanh()

    report = compare_with_eager(f, torch.randn(8), min_block_size=2)
    [graph] = report.graphs
    nodes = {n.name: n for n in graph.snapshot.nodes}
    drawn = collections.Counter(
        part
        for name, part in graph.node_partition.items()
        if nodes[name].target is not operator.getitem
    )
    assert drawn == {p.name: p.op_count for p in graph.partitions}
    assert "legend" in report.to_dot() and "jax_0: 2 ops in JAX" in report.to_dot()


def test_explain_returns_the_report_of_every_graph() -> None:
    report = dynajax.explain(chain, torch.randn(8))
    assert isinstance(report, dynajax.Report)
    assert [w.op for w in report.what_if()][0] == "dynajax_diagtest.second.default"
    assert isinstance(report.what_if()[0], dynajax.WhatIf)
    assert "graph 0 (inference)" in report.text(width=None)
