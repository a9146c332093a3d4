"""Mutated inputs written back as the indexed updates they are (passes/writes.py).

A KV cache updated in place reaches dynajax as a functional update whose whole result
the graph used to return and ``copy_`` back; the graph now returns what the update
wrote, and the write-back applies it in place. Every call must leave every input as
eager leaves it, on the first call (through aot_autograd's wrapper) and the later ones
(dynajax's own write-back), loaded from the cache too, and raise eager's error where
eager's kernel raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import dynajax
from dynajax.passes import writes
from tests.tolerances import assert_same


def _compile(fn: Callable[..., Any], **options: Any):
    torch._dynamo.reset()
    backend = dynajax.Backend(**options)
    seen: list[list[writes.Write]] = []
    real = writes.rewrite_writes

    def recording(gm, mutated):
        out = real(gm, mutated)
        seen.append(out)
        return out

    return torch.compile(fn, backend=backend), backend, seen, real, recording


def _run(fn, make_state, make_args, steps=4, **options):
    """Calls ``fn`` compiled and eagerly on equal state, step after step, comparing the
    results and every state tensor after each call; returns the writes chosen."""
    compiled, backend, seen, real, recording = _compile(fn, **options)
    mp = pytest.MonkeyPatch()
    mp.setattr("dynajax.aot.compile.rewrite_writes", recording)
    try:
        state, state_eager = make_state(), make_state()
        for step in range(steps):
            args = make_args(step)
            got = compiled(*state, *args)
            want = fn(*state_eager, *args)
            assert_same(got, want)
            for i, (a, b) in enumerate(zip(state, state_eager, strict=True)):
                assert_same(a, b, path=f"state {i} after step {step}")
    finally:
        mp.undo()
    return seen, backend


def _kv_step(k_cache, v_cache, pos, k, v):
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    scores = (k_cache * v_cache).sum(-1)
    return scores.softmax(-1)


def _kv_state():
    return torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4)


def _kv_args(step):
    g = torch.Generator().manual_seed(step)
    return (
        torch.tensor([step]),
        torch.randn(1, 2, 1, 4, generator=g),
        torch.randn(1, 2, 1, 4, generator=g),
    )


def test_index_copy_cache_writes_only_the_new_rows() -> None:
    seen, _ = _run(_kv_step, _kv_state, lambda s: _kv_args(s))
    [chosen] = seen
    assert [(w.kind, w.args) for w in chosen] == [("index_copy", (2,))] * 2
    # the position is the call's own input, read from it: only the values are returned
    # (its position among the graph's inputs is Dynamo's choice)
    assert all(w.indices[0][0] == "in" for w in chosen)
    assert [w.n_outputs for w in chosen] == [1, 1]


class _Counter:
    """HF's static cache: the position computed in the graph from a counter it bumps."""

    @staticmethod
    def step(cache, counter, x):
        pos = torch.arange(x.shape[0]) + counter
        counter.add_(x.shape[0])
        cache.index_copy_(0, pos, x)
        return cache.cumsum(0)


def test_index_computed_in_the_graph_is_returned_with_the_values() -> None:
    seen, _ = _run(
        _Counter.step,
        lambda: (torch.zeros(8, 3), torch.zeros((), dtype=torch.int64)),
        lambda s: (torch.full((2, 3), float(s + 1)),),
    )
    [chosen] = seen
    kinds = {w.kind for w in chosen}
    assert kinds == {"copy", "index_copy"}  # the counter whole, the cache by its rows
    [put] = [w for w in chosen if w.kind == "index_copy"]
    assert put.indices == (("out", 0),) and put.n_outputs == 2


def _scatter_points(grid, rows, cols, v):
    grid[rows, cols] = v  # two index tensors, values broadcast: index_put_ itself
    return grid.sum(0)


def test_advanced_index_assignment_writes_with_index_put() -> None:
    seen, _ = _run(
        _scatter_points,
        lambda: (torch.zeros(4, 5),),
        lambda s: (torch.tensor([0, 2, 3]), torch.tensor([s, 1, 4]), torch.tensor(float(s + 1))),
    )
    [chosen] = seen
    assert [w.kind for w in chosen] == ["index_put"]
    assert [i[0] for i in chosen[0].indices] == ["in", "in"]


def _slice_and_row(buf, x, y):
    buf[:, 1:3] = x  # slice_scatter
    buf[0] = y  # a where() over the whole buffer
    return buf.sum()


def test_chained_updates_of_one_input_are_copied_whole() -> None:
    seen, _ = _run(
        _slice_and_row,
        lambda: (torch.zeros(4, 5),),
        lambda s: (torch.full((4, 2), float(s)), torch.full((5,), -float(s))),
    )
    [chosen] = seen
    # two updates of one buffer: the second updates the first's result, not the input
    assert [w.kind for w in chosen] == ["copy"]


def _one_slice(buf, x):
    buf[:, 1:3] = x
    return buf * 2


def test_slice_assignment_is_recognized() -> None:
    seen, _ = _run(_one_slice, lambda: (torch.zeros(4, 5),), lambda s: (torch.full((4, 2), s),))
    assert [(w.kind, w.args) for w in seen[0]] == [("slice", (1, 1, 3, 1))]


def _accumulate(buf, idx, x):
    buf.index_put_((idx,), x, accumulate=True)
    return buf.sum()


def test_accumulating_update_is_copied_whole() -> None:
    seen, _ = _run(
        _accumulate,
        lambda: (torch.zeros(5),),
        lambda s: (torch.tensor([1, 1, 3]), torch.ones(3) * (s + 1)),
    )
    assert [w.kind for w in seen[0]] == ["copy"]


def test_index_out_of_range_raises_eagers_error_and_writes_nothing() -> None:
    compiled, *_ = _compile(_kv_step)
    k_cache, v_cache = _kv_state()
    compiled(k_cache, v_cache, *_kv_args(0))
    before = (k_cache.clone(), v_cache.clone())
    pos, k, v = _kv_args(1)
    with pytest.raises(IndexError) as compiled_error:
        compiled(k_cache, v_cache, torch.tensor([9]), k, v)
    with pytest.raises(IndexError) as eager_error:
        _kv_step(*_kv_state(), torch.tensor([9]), k, v)
    assert str(compiled_error.value) == str(eager_error.value)
    assert_same(k_cache, before[0])
    assert_same(v_cache, before[1])


def test_loaded_graph_is_rewritten_the_same_way(tmp_path) -> None:
    first, _ = _run(_kv_step, _kv_state, _kv_args, cache_dir=str(tmp_path))
    again, backend = _run(_kv_step, _kv_state, _kv_args, cache_dir=str(tmp_path))
    assert backend.graphs[0].aot == "loaded from the cache (not traced)"
    assert again == first


def test_new_values_are_the_whole_updates() -> None:
    """What aot_autograd's wrapper receives on a graph's first call: each input's whole
    new value, computed from the written values as the graph would have."""
    base = torch.arange(12.0).reshape(3, 4)
    plan = [
        writes.Write(0, "index_put", indices=(("in", 1),), n_outputs=1),
        writes.Write(0, "index_copy", indices=(("in", 1),), args=(0,), n_outputs=1),
        writes.Write(0, "slice", args=(1, 1, 3, 1)),
        writes.Write(0, "copy"),
    ]
    idx = torch.tensor([2, 0])
    rows, cols, whole = torch.ones(2, 4), torch.zeros(3, 2), base * 3
    got = writes.new_values(plan, [base, idx], [rows, rows, cols, whole])
    want = [
        base.index_put((idx,), rows),
        base.index_copy(0, idx, rows),
        base.slice_scatter(cols, 1, 1, 3),
        whole,
    ]
    assert_same(got, want)
    assert_same(base, torch.arange(12.0).reshape(3, 4))  # nothing written
    for w, out, expected in zip(plan, [[rows], [rows], [cols], [whole]], want, strict=True):
        target = base.clone()
        writes.apply([w], [target, idx], out)
        assert_same(target, expected)
