"""Mutation and aliasing behave exactly as in eager PyTorch.

aot_autograd functionalizes the graph and replays mutations and views around the
compiled function; these tests pin down that the whole path (including dynajax's
zero-copy outputs and its input cache) keeps eager's semantics.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dynajax
from tests.tolerances import assert_same


def _compile(fn):
    return torch.compile(fn, backend=dynajax.Backend())


# -- mutated inputs ----------------------------------------------------------------------


def test_in_place_mutation_of_an_input_returns_the_input() -> None:
    def f(x):
        return x.add_(1)

    x_e, x_c = torch.zeros(3), torch.zeros(3)
    cf = _compile(f)
    for _ in range(3):
        out_e, out_c = f(x_e), cf(x_c)
        assert_same(x_c, x_e)
        assert_same(out_c, out_e)
    assert out_c is x_c


def test_mutation_of_an_input_view_and_another_output() -> None:
    def f(x, y):
        x[0].mul_(2)
        y.add_(x.sum())
        return (x * y).sin()

    args_e = (torch.arange(1.0, 7.0).reshape(2, 3), torch.ones(3))
    args_c = tuple(a.clone() for a in args_e)
    cf = _compile(f)
    for _ in range(2):
        assert_same(cf(*args_c), f(*args_e))
        assert_same(args_c, args_e)


def test_mutation_of_an_int64_counter() -> None:
    def f(x, n):
        n.add_(1)
        return x * n

    x = torch.randn(4)
    n_e, n_c = torch.tensor(0), torch.tensor(0)
    cf = _compile(f)
    for _ in range(3):
        assert_same(cf(x, n_c), f(x, n_e))
    assert n_c.item() == 3 and n_c.dtype == torch.int64


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_batchnorm_running_stats_in_train_mode(momentum) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum))
    compiled_model = copy.deepcopy(eager)
    cf = _compile(compiled_model)
    for i in range(3):
        x = torch.randn(2, 3, 6, 6) + i
        assert_same(cf(x), eager(x), model=True)
    assert_same(dict(compiled_model.named_buffers()), dict(eager.named_buffers()), model=True)
    assert compiled_model[1].num_batches_tracked.item() == 3
    eager.eval()
    compiled_model.eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        assert_same(_compile(compiled_model)(x), eager(x), model=True)


# -- aliased outputs ---------------------------------------------------------------------


def test_duplicate_outputs_are_one_tensor_as_in_eager() -> None:
    def f(x):
        y = x.sin() + 1
        return y, y

    x = torch.randn(3)
    a, b = _compile(f)(x)
    e_a, e_b = f(x)
    assert_same((a, b), (e_a, e_b))
    a.mul_(10)
    e_a.mul_(10)
    assert_same(b, e_b)  # in eager both names are one tensor: the write shows in both


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x.view(-1)[1:],
        lambda x: x.t(),
        lambda x: x[:, 1],
        lambda x: x.unsqueeze(0),
    ],
    ids=["flat-slice", "transpose", "select", "unsqueeze"],
)
def test_output_view_of_an_input_sees_later_writes(view) -> None:
    def f(x):
        return view(x), x.cos()

    x = torch.randn(2, 3)
    v, c = _compile(f)(x)
    assert_same(v, view(x))
    assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    x.add_(5)
    assert_same(v, view(x))  # a real view: the caller's later write shows through
    v.mul_(0)  # and writes through it reach the input, as in eager
    assert (view(x) == 0).all()


def test_writing_an_output_does_not_corrupt_later_calls() -> None:
    def f(x):
        return x + 1, x.clone(), torch.ones(3), x.new_zeros(3)

    x = torch.randn(3)
    x_before = x.clone()
    cf = _compile(f)
    first = cf(x)
    for t in first:
        t.add_(100)
    assert_same(x, x_before)  # x untouched by writes to x.clone()'s output
    assert_same(cf(x), f(x))


def test_outputs_own_their_buffers() -> None:
    def f(x):
        y = x * 2
        return y, y.clone(), x.clone()

    x = torch.randn(4)
    x_before = x.clone()
    outs = _compile(f)(x)
    ptrs = {o.data_ptr() for o in outs} | {x.data_ptr()}
    assert len(ptrs) == 4
    outs[2].zero_()
    assert_same(x, x_before)


# -- cached inputs see in-place updates ------------------------------------------------


class TestCachedParameters:
    def _pair(self):
        torch.manual_seed(0)
        eager = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        mine = copy.deepcopy(eager)
        return eager, mine, _compile(mine)

    def _check(self, eager, cf):
        x = torch.randn(5, 8)
        with torch.no_grad():
            assert_same(cf(x), eager(x), model=True)

    def test_in_place_update_between_calls(self) -> None:
        eager, mine, cf = self._pair()
        self._check(eager, cf)
        self._check(eager, cf)
        with torch.no_grad():
            for m in (eager, mine):
                m[0].weight.add_(0.5)
                m[2].bias.mul_(-3)
        self._check(eager, cf)

    def test_update_through_data_without_a_version_bump(self) -> None:
        eager, mine, cf = self._pair()
        self._check(eager, cf)
        self._check(eager, cf)
        v = mine[0].weight._version
        for m in (eager, mine):
            m[0].weight.data.mul_(2)
        assert mine[0].weight._version == v
        self._check(eager, cf)

    def test_write_through_numpy(self) -> None:
        eager, mine, cf = self._pair()
        self._check(eager, cf)
        self._check(eager, cf)
        for m in (eager, mine):
            m[2].bias.detach().numpy()[:] = 7.0
        self._check(eager, cf)

    def test_replaced_data(self) -> None:
        eager, mine, cf = self._pair()
        self._check(eager, cf)
        self._check(eager, cf)
        new = torch.randn(16, 8)
        eager[0].weight.data = new.clone()
        mine[0].weight.data = new.clone()
        self._check(eager, cf)

    def test_optimizer_steps(self) -> None:
        eager, mine, cf = self._pair()
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, mine)]
        torch.manual_seed(1)
        for _ in range(3):
            x = torch.randn(5, 8)
            losses = []
            for fwd, opt in ((eager, opts[0]), (cf, opts[1])):
                opt.zero_grad()
                loss = fwd(x).square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            assert_same(losses[1], losses[0], model=True)
        self._check(eager, cf)

    def test_params_are_cached_and_activations_are_not(self) -> None:
        backend = dynajax.Backend()
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        cf = torch.compile(model, backend=backend)
        with torch.no_grad():
            for _ in range(3):
                cf(torch.randn(2, 8))
        (report,) = backend.graphs
        part = report.graph_module.jax_0
        names = [n.name for n in part.graph_module.graph.nodes if n.op == "placeholder"]
        cached = part.inputs.cached_positions
        assert len(cached) == 2, (names, cached)  # weight and bias, not the input


def test_input_cache_does_not_keep_inputs_alive() -> None:
    import gc
    import weakref

    cf = _compile(lambda x: x * 2)
    x = torch.randn(64)
    ref = weakref.ref(x)
    cf(x)
    cf(x)
    del x
    gc.collect()
    assert ref() is None


def test_inputs_from_inference_mode() -> None:
    model = nn.Linear(4, 4)
    with torch.inference_mode():
        x = torch.randn(3, 4)
        cf = _compile(model)
        for _ in range(2):
            assert_same(cf(x), model(x), model=True)


def test_reused_input_mutated_in_place_between_calls() -> None:
    cf = _compile(lambda x: x.exp())
    x = torch.randn(5)
    for _ in range(3):
        assert_same(cf(x), x.exp())
        x.mul_(0.5)
    x.numpy()[0] = 3.0  # no version bump: the cached array is x's own memory
    assert_same(cf(x), x.exp())


def test_misaligned_and_strided_inputs() -> None:
    base = torch.randn(65)
    x = base[1:].view(8, 8)  # storage offset of 4 bytes: not zero-copy, never cached
    y = torch.randn(8, 16)[:, ::2]
    cf = _compile(lambda x, y: x @ y + 1)
    for _ in range(3):
        assert_same(cf(x, y), x @ y + 1)
        x.add_(1)


def test_many_calls_keep_live_buffers_flat() -> None:
    import gc

    import jax

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    cf = _compile(model)
    with torch.no_grad():
        for _ in range(20):
            cf(torch.randn(4, 8))
        gc.collect()
        before = len(jax.live_arrays())
        for _ in range(200):
            cf(torch.randn(4, 8))
        gc.collect()
        assert len(jax.live_arrays()) <= before


def test_many_cached_inputs_take_the_direct_path_and_see_updates() -> None:
    from dynajax.runtime.direct import DIRECT_MIN_INPUTS

    n = max(DIRECT_MIN_INPUTS, 6) + 2  # the test updates inputs 0, 1, 3 and 5

    def f(*xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = acc * 0.5 + x
        return acc, xs[1] - xs[2]

    backend = dynajax.Backend()
    cf = torch.compile(f, backend=backend)
    xs = [torch.randn(4) for _ in range(n)]
    for _ in range(3):
        assert_same(cf(*xs), f(*xs))
    part = backend.graphs[-1].graph_module.jax_0
    assert part._direct is not None  # every input cached: the executable is called as is
    xs[3].add_(1)  # version bump, same memory
    assert_same(cf(*xs), f(*xs))
    xs[0].numpy()[:] = 2.0  # no version bump
    assert_same(cf(*xs), f(*xs))
    xs[1].data = torch.randn(4)  # new memory, same object
    assert_same(cf(*xs), f(*xs))
    out = cf(*xs)
    out[0].add_(100)  # caller writes an output: later calls unaffected
    assert_same(cf(*xs), f(*xs))
    xs[5] = torch.randn(4)  # a new object at one position
    assert_same(cf(*xs), f(*xs))


def test_input_demoted_by_a_new_object_is_cached_again_once_it_stays() -> None:
    """``generate()`` makes a new KV cache per call: its first step demotes the cache's
    positions (a new object where the last call had another), and the cache then comes
    back, the same object, for the whole generation. It is cached again within two
    probes (``InputCache._probe``), and every call still sees its in-place writes."""
    from dynajax.runtime.inputs import _PROBE_EVERY

    def step(cache, x, pos, w):
        cache.index_copy_(0, pos, x * w)
        return cache.sum(0)

    backend = dynajax.Backend()
    cf = torch.compile(step, backend=backend)
    calls = 2 * _PROBE_EVERY + 2
    w = torch.randn(3)  # a parameter: the same object in every call
    for generation in range(3):
        cache, eager = torch.zeros(calls, 3), torch.zeros(calls, 3)
        for i in range(calls):
            x, pos = torch.full((1, 3), float(generation * 100 + i)), torch.tensor([i])
            assert_same(cf(cache, x, pos, w), step(eager, x, pos, w))
            assert_same(cache, eager)
        part = backend.graphs[-1].graph_module.jax_0
        arrays = part.inputs.resident
        held = [i for i, a in arrays.items() if a.unsafe_buffer_pointer() == cache.data_ptr()]
        # the cache and w, not the x and pos made anew each call
        assert len(held) == 1 and len(arrays) == 2, (generation, arrays)


def test_temporary_made_anew_each_call_is_not_cached() -> None:
    """A tensor made anew for every call may get the last one's id (its memory reused):
    the probe's weak reference tells it is another object, and it stays per call."""
    from dynajax.runtime.inputs import _PROBE_EVERY

    w = torch.randn(4)
    backend = dynajax.Backend()
    cf = torch.compile(lambda x, w: x * w, backend=backend)
    base = torch.randn(4)
    for _ in range(3 * _PROBE_EVERY):
        assert_same(cf(base.clone(), w), base * w)
    part = backend.graphs[-1].graph_module.jax_0
    assert len(part.inputs.cached_positions) == 1  # w only


def test_input_that_cannot_be_cached_is_not_probed_again() -> None:
    """A tensor with no zero-copy array (its storage offset is misaligned) comes back
    call after call: the probe must not rebuild the snapshot for it every 17 calls."""
    from dynajax.runtime.inputs import _PROBE_EVERY

    backend = dynajax.Backend()
    cf = torch.compile(lambda x, w: x * w, backend=backend)
    x, w = torch.randn(65)[1:], torch.randn(64)  # x: 4 bytes past an aligned address
    assert_same(cf(x, w), x * w)
    part = backend.graphs[-1].graph_module.jax_0
    snap = part.inputs.current
    for _ in range(3 * _PROBE_EVERY):
        assert_same(cf(x, w), x * w)
    assert part.inputs.current is snap  # never rebuilt
    assert len(part.inputs.cached_positions) == 1  # w only
