"""Warm starts: executables found by their program, before tracing (runtime/programs.py).

A second process (or a second compile) loads each partition's executable without
tracing it through the rule table, lowering it or compiling it, and must give eager's
answers all the same: inference, a training step's forward and backward, a fallback op
between partitions, dynamic shapes, value checks (whose list the trace used to record),
and a tampered or stale entry, which is a miss with its reason and is compiled again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import dynajax
from dynajax import store
from dynajax.lowering import interpreter
from tests.helpers import count_calls, run_worker
from tests.tolerances import assert_same


@pytest.fixture
def traces(monkeypatch):
    """Counts the partitions traced through the rule table (``[n]``)."""
    return count_calls(monkeypatch, interpreter.JaxInterpreter, "run")


def _compile(cache_dir, fn, *args, dynamic=None, **options):
    torch._dynamo.reset()
    backend = dynajax.Backend(cache_dir=str(cache_dir), **options)
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    return compiled, backend


def _stats(backend):
    return dynajax.Report(backend.graphs).compile_stats


def _worker(cache_dir: Path) -> dict:
    return run_worker("tests.cache.warm_worker", str(cache_dir), timeout=300)


def test_second_process_traces_nothing_and_gives_eagers_answers(tmp_path) -> None:
    # inference (an MLP) and a training step (conv + batch norm: forward and backward
    # graphs, a buffer update); the worker checks outputs and gradients against eager
    cold = _worker(tmp_path)
    warm = _worker(tmp_path)
    assert cold["compiles"] >= 3 and cold["hits"] == 0 and cold["traces"] >= 3
    assert warm["compiles"] == 0 and warm["misses"] == {}
    assert warm["hits"] == cold["compiles"]
    assert warm["traces"] == 0  # nothing traced through the rule table, nothing lowered
    assert warm["graphs"] == cold["graphs"] == ["inference", "forward", "backward"]
    assert not cold["inductor_lowerings"] and not warm["inductor_lowerings"]
    # the report shows the same verdicts and partitions
    for key in ("partitions", "nodes", "fallbacks"):
        assert warm[key] == cold[key], key


def _sort_between(x: torch.Tensor) -> torch.Tensor:
    return torch.sort(torch.sin(x) * 2, dim=-1).values.exp() + 1


def test_fallback_between_partitions(tmp_path, traces) -> None:
    x = torch.randn(4, 6)
    f, cold = _compile(tmp_path, _sort_between, x, fallback_ops=["aten.sort"])
    assert_same(f(x), _sort_between(x))
    assert len(dynajax.Report(cold.graphs).partitions) == 2
    traced = traces[0]
    f, warm = _compile(tmp_path, _sort_between, x, fallback_ops=["aten.sort"])
    assert_same(f(x), _sort_between(x))
    assert traces[0] == traced
    assert _stats(warm).cache_hits == 2 and _stats(warm).xla_compiles == 0
    assert (
        dynajax.Report(warm.graphs).text(width=None).split("compile")[0]
        == dynajax.Report(cold.graphs).text(width=None).split("compile")[0]
    )


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return (x * x.shape[0]).cumsum(0).tanh()


def test_dynamic_shapes(tmp_path, traces) -> None:
    xs = [torch.randn(n, 3) for n in (5, 7)]
    f, _ = _compile(tmp_path, _scaled, dynamic=True)
    for x in xs:
        assert_same(f(x), _scaled(x))
    traced = traces[0]
    f, warm = _compile(tmp_path, _scaled, dynamic=True)
    for x in xs:
        assert_same(f(x), _scaled(x))
    assert traces[0] == traced
    assert _stats(warm).cache_hits == 2 and _stats(warm).xla_compiles == 0
    # another size is another program
    f(torch.randn(9, 3))
    assert _stats(warm).xla_compiles == 1


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x[idx].sin()


def test_value_checks_of_a_loaded_program_raise_eagers_error(tmp_path, traces) -> None:
    x, idx = torch.randn(5, 3), torch.tensor([0, 4])
    f, _ = _compile(tmp_path, _gather)
    assert_same(f(x, idx), _gather(x, idx))
    traced = traces[0]
    f, warm = _compile(tmp_path, _gather)
    assert_same(f(x, idx), _gather(x, idx))
    assert traces[0] == traced and _stats(warm).cache_hits == 1
    bad = torch.tensor([0, 5])
    with pytest.raises(IndexError) as eager:
        _gather(x, bad)
    with pytest.raises(IndexError) as ours:
        f(x, bad)
    assert str(ours.value) == str(eager.value)


def _f(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + x.exp()


def test_tampered_entry_warns_and_recompiles(tmp_path) -> None:
    x = torch.randn(4, 3)
    f, _ = _compile(tmp_path, _f)
    f(x)
    [entry] = tmp_path.glob("*.bin")
    blob = bytearray(entry.read_bytes())
    blob[-100] ^= 1  # one bit of the pickled executable
    entry.write_bytes(bytes(blob))
    f, warm = _compile(tmp_path, _f)
    with pytest.warns(RuntimeWarning, match="failed authentication"):
        out = f(x)
    assert_same(out, _f(x))
    assert dict(_stats(warm).cache_misses) == {"unauthenticated entry": 1}
    assert _stats(warm).xla_compiles == 1
    f, again = _compile(tmp_path, _f)  # written anew
    assert_same(f(x), _f(x))
    assert _stats(again).cache_hits == 1


def test_entry_of_another_version_is_a_stale_miss(tmp_path, monkeypatch, caplog) -> None:
    x = torch.randn(4, 3)
    f, _ = _compile(tmp_path, _f)
    f(x)
    upgraded = tuple(
        (name, value + "+edited" if name == "dynajax sources" else value)
        for name, value in store.versions()
    )
    monkeypatch.setattr(store, "versions", lambda: upgraded)
    f, warm = _compile(tmp_path, _f)
    with caplog.at_level(logging.DEBUG, logger="dynajax.cache"):
        assert_same(f(x), _f(x))
    why = "stale entry (dynajax sources changed)"
    assert dict(_stats(warm).cache_misses) == {why: 1}
    assert any(why in r.getMessage() for r in caplog.records if r.name == "dynajax.cache")
    assert len(list(tmp_path.glob("*.bin"))) == 1  # overwritten, not kept beside it
    f, again = _compile(tmp_path, _f)
    assert_same(f(x), _f(x))
    assert _stats(again).cache_hits == 1


def test_key_covers_global_settings(tmp_path) -> None:
    x = torch.randn(8, 8)
    mm = lambda a: (a @ a).relu()  # noqa: E731
    f, _ = _compile(tmp_path, mm)
    f(x)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        f, other = _compile(tmp_path, mm)
        f(x)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert _stats(other).cache_hits == 0 and _stats(other).xla_compiles == 1
