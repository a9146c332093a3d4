"""Why it compiled again: the report's ``recompiles`` block and ``CompileStats.events``.

A partition's new executable for a new shape, bucket or one its LRU dropped; Dynamo's
recompile for a new dtype or another backend (its guard failure); a persistent-cache
entry refused; a train_step's retraces. Each compile is an event with its seconds.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import dynajax
from dynajax import store
from dynajax.runtime.cache import CompileStats, stats_of
from tests.helpers import compile_with, report_of
from tests.tolerances import assert_same

NEW_SHAPE = "new shape (no executable for it yet)"


def _sin(x):
    return torch.sin(x) * 2 + 1


def _rows(fn, **options):
    """``fn`` compiled with only dimension 0 of its argument dynamic, without the
    persistent cache (the compiles are this test's own)."""
    compiled, backend = compile_with(fn, cache_dir="", **options)

    def call(x):
        torch._dynamo.mark_dynamic(x, 0)
        return compiled(x)

    return call, backend


def _reasons(backend) -> list[str]:
    return [e.reason for e in report_of(backend).compile_stats.events]


def _recompiles(backend) -> list[str]:
    """The lines of the report's ``recompiles`` blocks (each graph's)."""
    out: list[str] = []
    block = None
    for line in report_of(backend).lines():
        depth = len(line) - len(line.lstrip())
        if block is not None and depth > block:
            out.append(line)
            continue
        block = depth if line.strip() == "recompiles:" else None
    return out


def test_a_new_batch_size_under_dynamic_shapes_is_listed_with_its_shapes() -> None:
    f, backend = compile_with(_sin, dynamic=True, cache_dir="")
    for n in (4, 6, 8, 6):
        x = torch.randn(n, 5)
        assert_same(f(x), _sin(x))
    assert len(backend.graphs) == 1  # one Dynamo graph: the partition compiled again
    assert _reasons(backend) == ["first call", NEW_SHAPE, NEW_SHAPE]
    [line] = _recompiles(backend)
    assert re.fullmatch(
        rf"    jax_0 {re.escape(NEW_SHAPE)} x2: f32\[6,5\]; f32\[8,5\] "
        r"\(compiled in (\d+ ms|\d+\.\d\d s)\)",
        line,
    ), line


def test_an_executable_the_lru_dropped_and_a_new_bucket_are_told_apart() -> None:
    f, backend = _rows(_sin, max_executables=1)
    for n in (4, 6, 4):
        f(torch.randn(n, 3))
    assert _reasons(backend) == ["first call", NEW_SHAPE, "evicted earlier (max_executables=1)"]
    assert "evicted earlier (max_executables=1): f32[4,3]" in report_of(backend).text(width=None)

    torch._dynamo.reset()
    f, backend = _rows(_sin, pad_to_buckets=True)
    for n in (5, 6, 9):  # buckets 8, 8 (no compile), 16
        x = torch.randn(n, 3)
        assert_same(f(x), _sin(x))
    assert _reasons(backend) == ["first call", "new bucket (no executable for it yet)"]
    [line] = _recompiles(backend)
    assert line.startswith("    jax_0 new bucket (no executable for it yet): f32[16,3]"), line


def test_a_new_dtype_lists_dynamos_guard_failure_on_each_graph_it_made() -> None:
    def f(x):
        return (x.cos() * x).sum()

    compiled, backend = compile_with(f, cache_dir="")
    x = torch.randn(4, 3, requires_grad=True)
    compiled(x).backward()
    assert _recompiles(backend) == []  # a first compile: nothing compiled again
    y = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    compiled(y).backward()
    assert [g.kind for g in backend.graphs] == ["forward", "backward"] * 2
    first, again = backend.graphs[0].dynamo, backend.graphs[2].dynamo
    assert first is not None and not first.recompile and first.failures == ()
    assert again is not None and again.recompile
    assert backend.graphs[3].dynamo is again  # the backward carries its forward's
    frame = first.compile_id.split("/")[0]
    assert again.compile_id == f"{frame}/1"
    [failure] = again.failures
    assert failure == f"{frame}/0: tensor 'x' dtype mismatch. expected Float, actual Double"
    text = report_of(backend).text(width=None)
    assert text.count(f"Dynamo compiled the frame again (compile {frame}/1):") == 2, text
    assert text.count(f"      {failure}") == 2, text


def test_a_second_backend_with_another_option_is_listed() -> None:
    x = torch.randn(4, 3)
    torch.compile(_sin, backend=dynajax.Backend(cache_dir=""))(x)
    other = dynajax.Backend(cache_dir="", min_block_size=2)
    torch.compile(_sin, backend=other)(x)
    [graph] = other.graphs
    assert graph.dynamo is not None and graph.dynamo.recompile
    [failure] = graph.dynamo.failures
    assert "BACKEND_MATCH" in failure  # Dynamo's own words, kept as they were
    [reason] = graph.dynamo.reasons()
    assert reason.endswith(
        ": BACKEND_MATCH failure: another backend (options changed: min_block_size 1 -> 2)"
    ), reason
    assert reason in report_of(other).text(width=None)

    same = dynajax.Backend(cache_dir="", min_block_size=2)
    torch.compile(_sin, backend=same)(x)
    [graph] = same.graphs
    assert graph.dynamo is not None
    # against each earlier compile: the first's options differ, the second's do not
    assert [r.split(": ", 1)[1] for r in graph.dynamo.reasons()] == [
        "BACKEND_MATCH failure: another backend (a new dynajax.Backend with the same "
        "options: reuse the first to compile once)",
        "BACKEND_MATCH failure: another backend (options changed: min_block_size 1 -> 2)",
    ]


def test_a_stale_cache_entry_is_listed_with_its_reason(tmp_path, monkeypatch) -> None:
    x = torch.randn(4, 3)
    f, _ = compile_with(_sin, cache_dir=str(tmp_path))
    f(x)
    upgraded = tuple(
        (name, value + "+edited" if name == "dynajax sources" else value)
        for name, value in store.versions()
    )
    monkeypatch.setattr(store, "versions", lambda: upgraded)
    torch._dynamo.reset()
    f, stale = compile_with(_sin, cache_dir=str(tmp_path))
    assert_same(f(x), _sin(x))
    why = "stale entry (dynajax sources changed)"
    [event] = report_of(stale).compile_stats.events
    assert (event.partition, event.reason, event.cache, event.loaded) == (
        "jax_0",
        "first call",
        why,
        False,
    )
    [line] = _recompiles(stale)
    assert line.startswith(f"    jax_0 first call; cache entry refused: {why}: f32[4,3] ("), line

    torch._dynamo.reset()
    f, warm = compile_with(_sin, cache_dir=str(tmp_path))
    f(x)
    [event] = report_of(warm).compile_stats.events
    assert event.loaded and event.cache == ""
    assert _recompiles(warm) == []


def test_compile_seconds_are_positive_and_summed() -> None:
    f, backend = compile_with(_sin, dynamic=True, cache_dir="")
    for n in (4, 6):
        f(torch.randn(n, 5))
    stats = report_of(backend).compile_stats
    assert len(stats.events) == stats.xla_compiles == 2
    assert all(isinstance(e.seconds, float) and e.seconds > 0 for e in stats.events)
    assert stats.seconds == pytest.approx(sum(e.seconds for e in stats.events))
    total = stats_of([stats, CompileStats(), stats])
    assert total.events == stats.events * 2 and total.xla_compiles == 4


def test_a_train_steps_report_lists_its_retraces() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)
    step = dynajax.train_step(model, optimizer, lambda m, x, y: ((m(x) - y) ** 2).mean())
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    step(x, y)
    assert "retraced" not in step.report()
    model[0].requires_grad_(True)
    optimizer.add_param_group({"params": model[0].parameters(), "lr": 0.05})
    step(x, y)
    assert step.retraces == ["the optimizer's param groups changed"]
    report = step.report()
    assert "  programs traced: 2" in report, report
    assert (
        "  retraced for a change of the module, optimizer or loss (step.retraces):\n"
        "    the optimizer's param groups changed"
    ) in report, report
