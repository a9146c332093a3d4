"""The per-call path Dynamo runs: aot_autograd's runtime wrapper only where it has work
(dynajax/aot/compile.py), the partition called through its guarded entry point
(CompiledPartition.run_guarded), and eager's answer after every kind of change to the
inputs between calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import dynajax
from dynajax.diagnostics import profile
from dynajax.partition import stitch
from tests.tolerances import assert_same


def _compile(f: Callable[..., Any]) -> tuple[Callable[..., Any], list[Any]]:
    """``f`` compiled by dynajax, and the callables the backend handed Dynamo."""
    backend = dynajax.Backend(cache_dir="")
    handed: list[Any] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        fn = backend(gm, example_inputs)
        handed.append(fn)
        return fn

    return torch.compile(f, backend=capture), handed


def _skips_wrapper(fn: Any) -> bool:
    if getattr(fn, "__module__", None) == profile.__name__:
        # the check whether a profiler records (``ranged_when_recording``): what it calls
        # when none does (through dynajax's own check for overlapping inputs, where
        # there is one: ``functools.wraps`` gave it the check's name)
        if "plain" not in fn.__code__.co_freevars:
            fn = fn.__wrapped__
        cells = zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True)
        fn = {name: cell.cell_contents for name, cell in cells}["plain"]
    return getattr(fn, "__module__", None) == stitch.__name__


def test_inference_graph_without_wrapper_work_is_called_directly() -> None:
    def f(x, y):
        return torch.sin(x) + y, (x * y).sum()

    compiled, handed = _compile(f)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(3):  # the first call goes through aot_autograd's wrapper, then not
        assert_same(compiled(x, y), f(x, y))
    [fn] = handed
    assert _skips_wrapper(fn)


def _returns_input_view(x):
    return x.view(-1), x + 1


def _mutates_a_leaf_that_requires_grad(x):
    x.data.add_(1)
    return x * 2


@pytest.mark.parametrize(
    "f",
    [_returns_input_view, _mutates_a_leaf_that_requires_grad],
    ids=["output-view-of-input", "mutates-leaf-requiring-grad"],
)
def test_wrapper_kept_where_it_has_work(f: Callable[..., Any]) -> None:
    compiled, handed = _compile(f)
    x = torch.randn(2, 3, requires_grad=f is _mutates_a_leaf_that_requires_grad)
    x_eager = x.detach().clone().requires_grad_(x.requires_grad)
    for _ in range(3):
        got, want = compiled(x), f(x_eager)
        assert_same(got, want)
        assert_same(x, x_eager)
    assert not any(_skips_wrapper(fn) for fn in handed)


def _writes_two_inputs(cache, pos, x, counter):
    cache.index_copy_(0, pos, x)
    counter.add_(1)
    return cache.sum(0) * counter


def test_input_mutations_are_written_back_without_the_wrapper() -> None:
    """An inference graph that writes into inputs (a KV cache, a counter) is handed to
    Dynamo without aot_autograd's runtime wrapper: dynajax's own write-back
    (``passes/writes.py``) writes the new values in, on every call."""
    compiled, handed = _compile(_writes_two_inputs)
    cache, counter = torch.zeros(4, 3), torch.zeros(())
    cache_eager, counter_eager = cache.clone(), counter.clone()
    for step in range(4):
        pos, x = torch.tensor([step]), torch.randn(1, 3)
        got = compiled(cache, pos, x, counter)
        assert_same(got, _writes_two_inputs(cache_eager, pos, x, counter_eager))
        assert_same(cache, cache_eager)
        assert_same(counter, counter_eager)
    [fn] = handed
    assert _skips_wrapper(fn)


def test_failed_value_check_writes_no_input_back() -> None:
    """Without the wrapper too: a value check that fails raises eager's error before any
    new value is written into an input."""

    def f(x, idx):
        x.add_(1)
        return x[idx]

    compiled, handed = _compile(f)
    x = torch.zeros(3)
    assert_same(compiled(x, torch.tensor([0])), torch.ones(1))
    assert_same(compiled(x, torch.tensor([2])), torch.full((1,), 2.0))
    with pytest.raises(IndexError):
        compiled(x, torch.tensor([7]))
    assert_same(x, torch.full((3,), 2.0))
    [fn] = handed
    assert _skips_wrapper(fn)


def test_autocast_gives_eager_answer_on_every_call() -> None:
    # Dynamo records autocast in the graph (the wrapper turns nothing off around it)
    def f(x, w):
        return x @ w, (x + 1).sum()

    compiled, _ = _compile(f)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            assert_same(compiled(x, w), f(x, w))


def test_training_graph_keeps_wrapper() -> None:
    def f(x, w):
        return (x @ w).tanh().sum()

    compiled, handed = _compile(f)
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    compiled(x, w).backward()
    assert not any(_skips_wrapper(fn) for fn in handed)


def test_guarded_path_follows_every_change_of_the_inputs() -> None:
    """Between calls: in-place updates (version bump, same memory), writes that bypass
    the version counter, new memory under the same object, in-place layout changes
    that keep the data pointer (Dynamo's guards recompile), new objects."""

    def f(a, b, c):
        return a * 2 + b, a.sum(0) - c

    compiled, handed = _compile(f)
    a, b, c = torch.randn(3, 3), torch.randn(3, 3), torch.randn(3)

    def check() -> None:
        assert_same(compiled(a, b, c), f(a, b, c))

    for _ in range(3):
        check()
    assert _skips_wrapper(handed[0])
    a.add_(1)  # version bump, same memory
    check()
    b.numpy()[:] = 5.0  # no version bump
    check()
    c.data = torch.randn(3)  # new memory, same object
    check()
    a.t_()  # same pointer, strides swapped: a guard fails, Dynamo recompiles
    check()
    check()
    a.t_()  # back to the first layout: the first graph's cached arrays are still right
    a.mul_(3)
    check()
    c.resize_(3)  # a no-op resize: same pointer, same layout
    check()
    b = torch.randn(3, 3)  # a new object at one position
    check()
    check()


def test_guarded_check_is_by_data_pointer() -> None:
    """Under Dynamo's guards a call checks its cached arrays by data pointer alone:
    another tensor object over the same memory, with the layout the guards fixed (a
    view, ``p.data`` set to one), reads the bytes the cached array reads, and keeps it.
    A cached tensor that dies drops the snapshot at once, before the allocator can hand
    its memory to a new tensor at the same address."""

    def f(a, b):
        return a * 2 + b

    backend = dynajax.Backend(cache_dir="")
    compiled = torch.compile(f, backend=backend)
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    for _ in range(3):
        assert_same(compiled(a, b), f(a, b))
    part = backend.graphs[0].graph_module.jax_0
    snap = part.inputs.current
    assert snap is not None and all(x is not None for x in snap.arrays)

    view = a.view(3, 3)  # another object over the same memory
    assert view is not a and view.data_ptr() == a.data_ptr()
    assert part.inputs.hit_guarded([view, b]) is snap
    a.add_(1)  # through the first object: the view sees it, as the cached array does
    assert_same(compiled(view, b), f(view, b))
    assert part.inputs.current is snap

    del b  # its death drops the snapshot that cached its array
    assert part.inputs.current is None
    assert part.inputs.hit_guarded([a, torch.zeros(3, 3)]) is None
    b = torch.full((3, 3), 7.0)  # may land at b's old address
    assert_same(compiled(a, b), f(a, b))
    assert_same(compiled(a, b), f(a, b))

    moved = torch.randn(3, 3)  # other memory at a cached position
    assert part.inputs.current is not None and part.inputs.current.arrays[0] is not None
    assert part.inputs.hit_guarded([moved, b]) is None
    assert_same(compiled(moved, b), f(moved, b))


def test_inputs_updated_in_place_every_call_keep_their_arrays() -> None:
    """A graph that writes into an input every call (a static KV cache at a position
    advanced in place): aot_autograd's wrapper stays (it copies the update back), so the
    partition checks its cached inputs by version, and versions move on every call. The
    arrays are the tensors' memory, so they are kept while sizes and strides are
    unchanged, and the executable's direct entry point stays in use; a resize at the
    same pointer is caught, and every answer is eager's."""

    def step(cache, pos, x):
        cache.index_copy_(0, pos, x)
        return cache.sum(0) * 2

    backend = dynajax.Backend(cache_dir="")
    compiled = torch.compile(step, backend=backend)
    cache, ref = torch.zeros(4, 3), torch.zeros(4, 3)
    pos, x = torch.tensor([0]), torch.randn(1, 3)
    for _ in range(4):
        assert_same(compiled(cache, pos, x), step(ref, pos, x))
        assert_same(cache, ref)
        pos.add_(1)
        x.mul_(-1.5)
    [report] = backend.graphs
    part = report.graph_module.jax_0
    snap = part.inputs.current
    assert snap is not None and snap.arrays[0] is not None  # the cache's own array, kept
    assert part.inputs.hit([cache, pos, x]) is snap
    if part._direct is not None:
        assert part._direct.snap is snap
    pos.zero_()
    new_x = torch.randn(1, 3)  # a new object: converted per call, the others kept
    assert_same(compiled(cache, pos, new_x), step(ref, pos, new_x))
    assert part.inputs.resident.get(0) is snap.arrays[0]
    cache.resize_(2, 3)  # same pointer, new sizes: Dynamo recompiles
    ref.resize_(2, 3)
    assert_same(compiled(cache, pos, x), step(ref, pos, x))
    assert_same(cache, ref)


class _Tagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(idx) + x).relu()


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_new_tensors_every_call_take_the_direct_entry_point(
    layout: str, dtype: torch.dtype
) -> None:
    """A model called with new input tensors on every call (a token, a batch): its
    parameters are cached, the new tensors are put into arrays per call
    (``runtime/direct.py``), and the executable's direct entry point runs
    them with the cached ones; every answer is eager's (int64 indices included)."""
    model = _Tagger().to(dtype).eval()
    backend = dynajax.Backend(cache_dir="")
    compiled = torch.compile(model, backend=backend)

    def inputs(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor([[i % 10, (3 * i) % 10, 9]])
        torch.manual_seed(i)
        if layout == "transposed":
            return idx, torch.randn(6, 3, dtype=dtype).t().unsqueeze(0)
        return idx, torch.randn(1, 3, 6, dtype=dtype)

    with torch.no_grad():
        assert_same(compiled(*inputs(0)), model(*inputs(0)))
        [report] = backend.graphs
        part = report.graph_module.jax_0
        direct_calls = 0
        run_direct = part._run_direct

        def counting(*args: Any) -> Any:
            nonlocal direct_calls
            direct_calls += 1
            return run_direct(*args)

        part._run_direct = counting
        for i in range(1, 6):
            idx, x = inputs(i)
            assert_same(compiled(idx, x), model(idx, x))
    assert part._direct is not None and len(part._direct.fresh) == 2
    assert direct_calls == 4  # the second call builds the entry point and checks it
