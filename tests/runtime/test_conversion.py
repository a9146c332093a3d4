"""Conversion at the torch/JAX boundary: round trips, zero-copy, odd layouts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from dynajax.runtime.conversion import (
    cpu_to_torch,
    dlpack_to_jax,
    fast_to_jax,
    row_major,
    to_jax,
    to_torch,
    zero_copy_array,
)
from tests.tolerances import assert_same


@pytest.fixture(autouse=True)
def _jax_on_the_cpu():
    """These tests convert CPU tensors, and build JAX arrays from NumPy: on a machine with
    a GPU, JAX would put those on the GPU (its default device), and a round trip would
    come back as a CUDA tensor. tests/runtime/test_devices.py covers the devices."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


LAYOUTS = {
    "0dim": lambda t: t.reshape(()) if t.numel() == 1 else t[0, 0],
    "zero-size": lambda t: t[:0],
    "contiguous": lambda t: t,
    "transposed": lambda t: t.t(),
    "strided": lambda t: t[::2, 1::2],
    "offset": lambda t: t[1:],
    "expanded": lambda t: t[:1].expand(5, 6),
}


def _roundtrip(t: torch.Tensor) -> torch.Tensor:
    with jax.enable_x64(True):
        a = jax.numpy.asarray(fast_to_jax(t))
        return to_torch(a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_roundtrip_exact(dtype: torch.dtype, layout: str) -> None:
    t = LAYOUTS[layout](_sample(dtype, (5, 6)))
    back = _roundtrip(t)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_requires_grad_conj_and_neg_bits_are_resolved(dtype: torch.dtype) -> None:
    t = _sample(dtype, (3, 4)).requires_grad_()
    assert_same(_roundtrip(t), t.detach())
    if dtype.is_complex:
        c = t.detach().conj()
        assert c.is_conj()
        assert_same(_roundtrip(c), c.resolve_conj())
        n = c.imag  # a float tensor with the lazy negative bit
        assert n.is_neg()
        assert_same(_roundtrip(n), n.resolve_neg())


def test_cpu_input_is_a_view_not_a_copy() -> None:
    t = torch.arange(1 << 20, dtype=torch.float32)
    view = fast_to_jax(t)
    assert isinstance(view, np.ndarray)
    assert view.ctypes.data == t.data_ptr()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(8, 1, 32).transpose(0, 1),  # (1, 8, 32), strides (32, 32, 1)
        lambda: torch.randn(8, 32).as_strided((1, 8, 1, 32), (7, 32, 5, 1)),
        lambda: torch.randn(1, 4).t(),  # (4, 1), strides (1, 4)
    ],
)
def test_size_one_dimensions_cross_dlpack_row_major(make) -> None:
    # Contiguous to PyTorch, but DLPack would pass the size-1 dimensions' strides on
    # as a layout (a GPU executable refused one): the same memory, row-major strides.
    t = make()
    assert t.is_contiguous() and t.stride() != row_major(t).stride()
    r = row_major(t)
    assert r.data_ptr() == t.data_ptr() and torch.equal(r, t)
    assert r.stride() == torch.empty(t.shape).stride()
    a = dlpack_to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_output_views_the_xla_buffer() -> None:
    with jax.enable_x64(True):
        a = jax.jit(lambda x: x * 2)(np.arange(1 << 16, dtype=np.int64))
    out = cpu_to_torch(a)
    assert out.data_ptr() == a.unsafe_buffer_pointer()
    assert out.dtype == torch.int64
    out.add_(1)  # the caller owns it and may write to it
    assert out[3].item() == 7


def test_bfloat16_output() -> None:
    with jax.enable_x64(True):
        a = jax.numpy.asarray(to_jax(torch.tensor([1.5, -2.0], dtype=torch.bfloat16)))
    out = to_torch(a)
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [1.5, -2.0]


class TestZeroCopyArray:
    def test_aliases_the_tensor(self) -> None:
        t = torch.arange(64, dtype=torch.float32)
        with jax.enable_x64(True):
            a = zero_copy_array(t)
        assert a is not None and a.unsafe_buffer_pointer() == t.data_ptr()
        t.add_(1)  # in place: the array is the same memory
        assert float(a[0]) == 1.0

    def test_int64_stays_int64(self) -> None:
        with jax.enable_x64(True):
            a = zero_copy_array(torch.arange(8))
        assert a is not None and a.dtype == np.int64

    @pytest.mark.parametrize(
        "make",
        [
            lambda: torch.zeros(65)[1:],  # misaligned: JAX would copy
            lambda: torch.zeros(0),
            lambda: torch.zeros(4, dtype=torch.complex64).conj(),
        ],
        ids=["misaligned", "zero-size", "conj-bit"],
    )
    def test_refuses_what_would_be_a_copy(self, make) -> None:
        with jax.enable_x64(True):
            assert zero_copy_array(make()) is None

    def test_refuses_inference_tensors(self) -> None:
        with torch.inference_mode():
            t = torch.zeros(16)
        with jax.enable_x64(True):
            assert zero_copy_array(t) is None

    def test_does_not_keep_the_tensor_object_alive(self) -> None:
        import gc
        import weakref

        t = torch.zeros(16)
        ref = weakref.ref(t)
        with jax.enable_x64(True):
            a = zero_copy_array(t)
        assert a is not None
        del t
        gc.collect()
        assert ref() is None
        assert float(a[0]) == 0.0  # the storage itself stays valid while the array lives


@pytest.mark.parametrize("x64", [True, False], ids=["x64", "x32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_lean_dlpack_import_gives_what_from_dlpack_gives(dtype: torch.dtype, x64: bool) -> None:
    """``jax_importer`` (JAX's importer without the Python of ``jax.dlpack.from_dlpack``)
    returns the same array: the tensor's memory, its dtype (64-bit types canonicalized
    when x64 is off, as from_dlpack does), on its device."""
    from dynajax.runtime.conversion import jax_importer

    importer = jax_importer(torch.device("cpu"))
    assert importer is not jax.dlpack.from_dlpack  # the internals are there: lean path
    t = _sample(dtype, (5, 6))
    with jax.enable_x64(x64):
        got, want = importer(t), jax.dlpack.from_dlpack(t)
    assert (got.shape, got.dtype, got.devices()) == (want.shape, want.dtype, want.devices())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if got.dtype.itemsize == t.element_size():
        assert got.unsafe_buffer_pointer() == want.unsafe_buffer_pointer() == t.data_ptr()


def test_lean_dlpack_import_falls_back_to_the_public_path(monkeypatch) -> None:
    from dynajax.runtime import jax_internals
    from dynajax.runtime.conversion import jax_importer

    jax_importer.cache_clear()
    try:
        monkeypatch.setattr(jax_internals, "dlpack_importer", lambda: None)
        assert jax_importer(torch.device("cpu")) is jax.dlpack.from_dlpack
        monkeypatch.undo()
        jax_importer.cache_clear()
        if not torch.cuda.is_available():
            assert jax_importer(torch.device("cuda", 0)) is jax.dlpack.from_dlpack
        assert jax_importer(torch.device("meta")) is jax.dlpack.from_dlpack
    finally:
        jax_importer.cache_clear()
