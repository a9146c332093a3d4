"""InputCache on an accelerator's terms, and results that cross back as their arrays.

CI has no GPU: these run the accelerator's logic on CPU tensors (``same_layout_reuse``
off, DLPack imports counted), which is what a partition on a GPU builds.
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dynajax.runtime import conversion
from dynajax.runtime.conversion import dlpack_to_jax, fast_to_jax, from_source_or
from dynajax.runtime.inputs import InputCache


@pytest.fixture(autouse=True)
def _jax_on_the_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


class _Imports:
    """``make_cached`` of a partition on an accelerator (``zero_copy_array``'s DLPack
    import: contiguous tensors only), counted."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> jax.Array | None:
        self.tensors.append(t)
        return dlpack_to_jax(t) if t.is_contiguous() else None


def _assert_values(arrays: list, tensors: list[torch.Tensor]) -> None:
    for a, t in zip(arrays, tensors, strict=True):
        np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_in_place_updates_cost_one_import_per_call_not_one_per_tensor() -> None:
    """An optimizer step bumps every parameter's version. On an accelerator the next
    call re-imports one of them (its definition event orders the whole execution after
    torch's stream) and keeps the other arrays, which are the same memory."""
    imports = _Imports()
    cache = InputCache(3, fast_to_jax, imports, same_layout_reuse=False, fence_writes=True)
    ws = [torch.randn(4) for _ in range(3)]
    first = cache.arrays(ws)
    assert len(imports.tensors) == 3
    snap = cache.current
    assert cache.arrays(ws) == first and cache.hit(ws) is snap and len(imports.tensors) == 3

    ws[0].add_(1)
    ws[2].mul_(2)
    # The direct path (hit) cannot pass a fence: it declines, and leaves the snapshot be.
    assert cache.hit(ws) is None and cache.hit_guarded(ws) is None
    fenced = cache.arrays(ws)
    assert len(imports.tensors) == 4 and imports.tensors[-1] is ws[0]
    assert fenced[0] is not first[0] and fenced[1] is first[1] and fenced[2] is first[2]
    _assert_values(fenced, ws)
    assert cache.current is snap  # no rebuilt snapshot

    # No write since: no import, the direct path's test passes again.
    assert cache.arrays(ws) == first and cache.hit(ws) is snap
    assert len(imports.tensors) == 4


def test_a_changed_layout_is_still_a_refresh() -> None:
    imports = _Imports()
    cache = InputCache(2, fast_to_jax, imports, same_layout_reuse=False, fence_writes=True)
    ws = [torch.randn(4, 4), torch.randn(3)]
    cache.arrays(ws)
    ws[0].t_()  # same memory, other strides: the array's layout is wrong now
    out = cache.arrays(ws)
    assert imports.tensors[-1] is ws[0]  # tried again, refused: converted per call
    _assert_values(out, ws)
    _assert_values(cache.arrays(ws), ws)


def test_on_the_cpu_in_place_updates_import_nothing() -> None:
    imports = _Imports()
    cache = InputCache(2, fast_to_jax, imports)
    ws = [torch.randn(4), torch.randn(4)]
    cache.arrays(ws)
    ws[0].add_(1)
    _assert_values(cache.arrays(ws), ws)
    assert len(imports.tensors) == 2


# -- results crossing back -------------------------------------------------------------

_remembered = conversion.remembering(conversion.to_torch)


def _convert_counted() -> tuple[list[torch.Tensor], object]:
    seen: list[torch.Tensor] = []

    def convert(t: torch.Tensor) -> object:
        seen.append(t)
        return fast_to_jax(t)

    return seen, from_source_or(convert)


def test_a_result_crosses_back_as_its_array_while_untouched() -> None:
    seen, cross = _convert_counted()
    a = jnp.arange(12.0).reshape(3, 4) * 2
    t = _remembered(a)
    assert cross(t) is a and not seen
    view = t[1:]  # another tensor object, not a result: converted
    cross(view)
    assert seen == [view]
    t.add_(1)  # torch wrote to it: the array is no longer its value
    got = cross(t)
    assert seen[-1] is t
    np.testing.assert_array_equal(np.asarray(got), t.numpy())


def test_a_result_with_other_metadata_converts() -> None:
    seen, cross = _convert_counted()
    square = _remembered(jnp.arange(16.0).reshape(4, 4) + 1)
    square.t_()  # same shape, other strides
    cross(square)
    assert seen == [square]
    flat = _remembered(jnp.arange(6.0) + 1)
    flat.resize_(2, 3)
    np.testing.assert_array_equal(np.asarray(cross(flat)), flat.numpy())


def test_the_entry_goes_with_the_tensor() -> None:
    gc.collect()
    before = len(conversion._SOURCES)
    t = _remembered(jnp.ones(3) * 3)
    assert len(conversion._SOURCES) == before + 1
    del t
    gc.collect()
    assert len(conversion._SOURCES) == before


def test_a_saved_activation_crosses_into_the_backward_as_its_array() -> None:
    """aot_autograd saves a forward's activations with ``save_for_backward``; autograd
    keeps the saved tensor's Python object, so the backward's partition gets the array
    the forward's produced, without an import."""
    seen, cross = _convert_counted()
    found: list[object] = []

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            doubled = _remembered(jnp.asarray(x.detach().numpy()) * 2)
            ctx.save_for_backward(doubled)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (doubled,) = ctx.saved_tensors
            found.append(cross(doubled))
            return grad * doubled

    x = torch.randn(5, requires_grad=True)
    Square.apply(x).sum().backward()
    gc.collect()
    assert not seen and isinstance(found[0], jax.Array)
    torch.testing.assert_close(x.grad, 2 * x.detach())


# -- whole programs, with a GPU's crossings on CPU partitions ----------------------------


class _Crossings:
    """Every CPU partition built meanwhile crosses as on an accelerator
    (``CompiledPartition.cross_as_on_an_accelerator``); counts what a GPU would import."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from dynajax.runtime import compiled

        self.imports = 0  # DLPack imports a GPU would make: fences and new tensors
        self.from_source = 0
        init = compiled.CompiledPartition.__init__

        def imported(t: torch.Tensor) -> object:
            self.imports += 1
            return fast_to_jax(t)

        def cached(t: torch.Tensor) -> object:
            self.imports += 1
            return conversion.zero_copy_array(t)

        def patched(part, *args, **kwargs) -> None:
            init(part, *args, **kwargs)
            part.cross_as_on_an_accelerator(imported, cached)

        def counted_from_source_or(convert):
            cross = conversion.from_source_or(convert)

            def count(t: torch.Tensor) -> object:
                a = cross(t)
                self.from_source += conversion._SOURCES.get(id(t), (None, None))[1] is a
                return a

            return count

        monkeypatch.setattr(compiled.CompiledPartition, "__init__", patched)
        monkeypatch.setattr(compiled, "from_source_or", counted_from_source_or)


@pytest.fixture
def crossings(monkeypatch: pytest.MonkeyPatch) -> _Crossings:
    return _Crossings(monkeypatch)


@pytest.mark.parametrize(
    "name", ["mlp-sgd_momentum", "mlp-adam", "cnn_batchnorm-sgd_momentum", "encoder-sgd_momentum"]
)
def test_training_matches_eager_with_an_accelerators_crossings(crossings, name: str) -> None:
    """Saved activations reach the backward as their arrays, parameters updated by the
    optimizer cost one fenced import per call, and the answers are eager's (losses,
    gradients, parameters, BatchNorm's buffers)."""
    from tests.training.test_parity import test_training_matches_eager

    test_training_matches_eager(name)
    assert crossings.imports > 0 and crossings.from_source > 0


def test_compiled_optimizer_step_with_an_accelerators_crossings(crossings) -> None:
    from tests.training.test_parity import test_compiled_optimizer_step

    test_compiled_optimizer_step("adam")


def test_values_between_partitions_with_an_accelerators_crossings(crossings) -> None:
    """A result of one partition, through an op kept in eager, into the next; an input
    written in place between calls (the fence) and a result written by the user."""
    from tests.helpers import compile_with

    def f(x, w, buf):
        h = torch.sin(x @ w)
        h = torch.ops.aten.nonzero(h > 0).float().sum() + h  # an eager op between
        buf.add_(1)
        return h.cos() + buf

    x, w, buf = torch.randn(5, 4), torch.randn(4, 4), torch.zeros(4)
    w_eager, buf_eager = w.clone(), buf.clone()
    compiled, _ = compile_with(f)
    for _ in range(3):
        got = compiled(x, w, buf)
        want = f(x, w_eager, buf_eager)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(buf, buf_eager)
        w.mul_(1.5)  # a write between calls: the next call must see it
        w_eager.mul_(1.5)
        got.add_(100)  # the caller owns its result


# -- results into torch, the lean way ---------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_results_importer_gives_what_from_dlpack_gives(dtype) -> None:
    importer = conversion.torch_importer(torch.device("cpu"))
    assert importer is not conversion.dlpack_to_torch  # the internal is there: lean path
    with jax.enable_x64(True):
        a = jax.device_put(np.arange(12).reshape(3, 4).astype(dtype), jax.devices("cpu")[0])
        got, want = importer(a), torch.from_dlpack(a)
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    assert got.data_ptr() == want.data_ptr() == a.unsafe_buffer_pointer()
    assert torch.equal(got, want)


def test_results_importer_falls_back_to_the_public_path(monkeypatch) -> None:
    from dynajax.runtime import jax_internals

    conversion.torch_importer.cache_clear()
    try:
        monkeypatch.setattr(jax_internals, "dlpack_exporter", lambda: None)
        assert conversion.torch_importer(torch.device("cpu")) is conversion.dlpack_to_torch
        monkeypatch.undo()
        conversion.torch_importer.cache_clear()
        if not torch.cuda.is_available():  # no GPU for JAX or torch: nothing to probe
            importer = conversion.torch_importer(torch.device("cuda", 0))
            assert importer is conversion.dlpack_to_torch
    finally:
        conversion.torch_importer.cache_clear()


@torch.library.custom_op("dynajax_inputs_test::first_of", mutates_args=())
def first_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2


@first_of.register_fake
def _(x, y):
    return torch.empty_like(x)


def test_an_input_the_program_never_reads_stays_an_argument(crossings) -> None:
    """The fence may be any input written in place, also one the program does not read
    (here ``y``, which the rule ignores): jax.jit would drop it, and XLA would not wait
    for it. On an accelerator the executables keep every input."""
    import dynajax
    from dynajax.runtime import jax_internals
    from dynajax.runtime.compiled import CompiledPartition
    from tests.helpers import compile_with

    dynajax.register_rule("dynajax_inputs_test::first_of")(lambda x, y: x * 2)
    try:
        x, y = torch.randn(4), torch.zeros(4)
        compiled, backend = compile_with(lambda x, y: first_of(x, y) + 1)
        for _ in range(2):
            torch.testing.assert_close(compiled(x, y), x * 2 + 1)
            y.add_(1)  # only y moved: y is the fence
        gm = backend.graphs[0].graph_module
        [part] = [m for m in gm.children() if isinstance(m, CompiledPartition)]
        assert part.executables.keep_unused
        found = jax_internals.direct_executor(part._compiled)
        assert found is not None and found.kept == [0, 1]
    finally:
        dynajax.unregister_rule("dynajax_inputs_test::first_of")
