"""Zero-copy conversion at the torch/JAX boundary.

On CPU both directions go through NumPy's buffer protocol: ``tensor.numpy()`` is a view
of the tensor's storage, and ``jax.jit`` takes a suitably aligned NumPy array without
copying (a 64 MiB input costs the same as a 4-byte one). Back, ``np.asarray`` of a CPU
``jax.Array`` is a view of the XLA buffer, which ``torch.from_numpy`` wraps. Tensors on
other devices go through DLPack (zero-copy on the same device, stream-synchronized by
the DLPack protocol).

Measured on the 2-core CPU box (µs per tensor, 1-element float32, medians):

    tensor.numpy() into jax.jit                     ~3  (0.5 numpy view + ~2.6 inside jit)
    cached jax.Array into jax.jit                   ~1  (what ``InputCache`` passes)
    jax.dlpack.from_dlpack(tensor)                  ~25-80
    jax_importer(device)(tensor)                    ~5  (the C calls under it)
    np.asarray(jax.Array) + torch.from_numpy        ~2
    torch.from_dlpack(jax.Array)                    ~6

Copies happen only where the layout requires one: tensors with a lazy conjugate or
negative bit are resolved first, and JAX copies misaligned or non-contiguous NumPy
views itself.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from dynajax.errors import ConversionError
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.runtime import jax_internals

_BF16 = np.dtype(TORCH_TO_JAX[torch.bfloat16])


def to_jax(t: torch.Tensor) -> Any:
    """A JAX-consumable view of ``t`` (a NumPy view on CPU, a jax.Array elsewhere).

    The general path, for any tensor; ``fast_to_jax`` is the per-call one.
    """
    if t.dtype not in TORCH_TO_JAX:
        raise ConversionError(
            f"a {t.dtype} tensor cannot cross into JAX; dynajax runs ops on such tensors "
            "in eager PyTorch, so this is a dynajax bug: please report it."
        )
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        return dlpack_to_jax(t.contiguous())
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16) if t.dim() else _bf16_scalar(t)
    return t.numpy()


def dlpack_to_jax(t: torch.Tensor) -> jax.Array:
    """A ``jax.Array`` sharing ``t``'s memory through DLPack, on ``t``'s device.

    The path of tensors on accelerators (``to_jax``, ``dynajax.call_jax``); it works
    on CPU tensors too, which is how CI, without a GPU, exercises it. Pass a
    contiguous tensor without a lazy conjugate or negative bit (``to_jax`` makes it so):
    DLPack would hand JAX other strides as a layout, and drops the lazy bits.
    """
    return jax_importer(t.device)(row_major(t))


_DL_KIND = {"cpu": 1, "cuda": 2}  # DLPack's device types: kDLCPU, kDLCUDA


def _jax_device_of(device: torch.device) -> tuple[jax.Device, int] | None:
    """The JAX device holding ``device``'s memory and the CUDA ordinal (0 on the CPU),
    for the lean DLPack crossings; None where they do not apply (ROCm, whose streams
    follow other conventions; a device JAX does not have; other device types)."""
    if device.type == "cpu":
        return cpu_device(), 0
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    gpus = [d for d in jax.devices() if d.platform == "gpu" and d.id == index]
    return (gpus[0], index) if gpus else None


@functools.cache
def jax_importer(device: torch.device) -> Callable[[torch.Tensor], jax.Array]:
    """``jax.dlpack.from_dlpack`` for tensors on ``device``, without its Python.

    ``jax.dlpack.from_dlpack`` costs ~40 µs per tensor on this CPU and ~100 µs on an
    H100, most of it Python (the tensor's ``__dlpack__``, JAX's device lookups); the C
    calls under it take ~5 µs. Here the device, JAX's stream for external ready events
    and torch's handle on that stream are looked up once; per tensor, that stream waits
    for torch's current stream (what ``__dlpack__(stream=...)`` does), torch's capsule
    goes to JAX's importer (``jax_internals.dlpack_importer``), and 64-bit types are
    canonicalized as ``from_dlpack`` does when x64 is off. ``jax.dlpack.from_dlpack``
    itself where an internal is missing, on ROCm, or where a probe of both disagrees.
    """
    import_ = jax_internals.dlpack_importer()
    to_capsule = getattr(torch._C, "_to_dlpack", None)
    found = _jax_device_of(device)
    if import_ is None or to_capsule is None or found is None:
        return jax.dlpack.from_dlpack
    jax_device, index = found
    kind = _DL_KIND[device.type]
    fence: Callable[[], Any] | None = None
    stream = None
    if device.type == "cuda":
        try:
            stream = jax_device.get_stream_for_external_ready_events()
        except Exception:  # UNIMPLEMENTED on some clients: the public path knows
            return jax.dlpack.from_dlpack
        ready = torch.cuda.ExternalStream(stream, device=torch.device("cuda", index))

        def fence() -> Any:
            return ready.wait_stream(torch.cuda.current_stream(index))

    def import_tensor(t: torch.Tensor) -> jax.Array:
        if fence is not None:
            fence()
        a = import_(to_capsule(t), jax_device, stream, kind)
        canonical = jax.dtypes.canonicalize_dtype(a.dtype)
        return a if canonical == a.dtype else jax.numpy.asarray(a, dtype=canonical)

    try:
        probe = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3)
        got, want = import_tensor(probe), jax.dlpack.from_dlpack(probe)
        same = (
            got.shape == want.shape
            and got.dtype == want.dtype
            and got.devices() == want.devices()
            and got.unsafe_buffer_pointer() == want.unsafe_buffer_pointer() == probe.data_ptr()
        )
    except Exception:  # an internal that changed its contract: the public path
        same = False
    return import_tensor if same else jax.dlpack.from_dlpack


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) with the strides of a row-major layout, the same memory.

    PyTorch calls a tensor contiguous whatever the strides of its size-1 dimensions
    (a ``[None]`` or a transpose leaves them as they were), and DLPack passes strides
    on: on a GPU, JAX read them as another layout, and an executable compiled for the
    row-major one refused the array (seen on an H100, in a decode step with a KV cache:
    ``float32[1,8,1,32]`` with major_to_minor (0, 2, 1, 3)).
    """
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    strides.reverse()
    if t.stride() == tuple(strides):
        return t
    return t.as_strided(t.shape, strides, t.storage_offset())


def dlpack_to_torch(a: jax.Array) -> torch.Tensor:
    """A tensor sharing the buffer of ``a`` through DLPack, on ``a``'s device (the
    DLPack protocol synchronizes the producer's stream). Works on CPU arrays too."""
    return torch.from_dlpack(a)


@functools.cache
def torch_importer(device: torch.device) -> Callable[[jax.Array], torch.Tensor]:
    """``dlpack_to_torch`` for arrays known to be on ``device`` (a partition's results).

    ``torch.from_dlpack`` spends ~20 µs per array on an H100 in Python (the array's
    device, torch's current stream as an object, JAX's checks) before two C calls; here
    the stream is the one it would pass (torch's current stream on ``device``, 1 for the
    legacy default stream, none on the CPU), read by the C call inductor's own code
    uses, and the capsule comes from JAX's exporter (``jax_internals.dlpack_exporter``).
    ``dlpack_to_torch`` itself where an internal is missing, on ROCm (other stream
    conventions), or where a probe of both paths on ``device`` disagrees.
    """
    export = jax_internals.dlpack_exporter()
    from_capsule = getattr(torch._C, "_from_dlpack", None)
    found = _jax_device_of(device)
    if export is None or from_capsule is None or found is None:
        return dlpack_to_torch
    jax_device, index = found
    importer: Callable[[jax.Array], torch.Tensor]
    if device.type == "cpu":

        def importer(a: jax.Array) -> torch.Tensor:
            return from_capsule(export(a, None))  # type: ignore[no-any-return]

    else:
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw_stream is None:
            return dlpack_to_torch

        def importer(a: jax.Array) -> torch.Tensor:
            return from_capsule(export(a, raw_stream(index) or 1))  # type: ignore[no-any-return]

    try:
        probe = jax.device_put(np.arange(6, dtype=np.float32).reshape(2, 3), jax_device)
        got, want = importer(probe), dlpack_to_torch(probe)
        same = (got.device, got.dtype, got.shape, got.stride(), got.data_ptr()) == (
            want.device,
            want.dtype,
            want.shape,
            want.stride(),
            want.data_ptr(),
        )
    except Exception:  # an internal that changed its contract: the public path
        same = False
    return importer if same else dlpack_to_torch


def fast_to_jax(t: torch.Tensor) -> Any:
    """``to_jax`` for the per-call path: one C call for the common CPU case.

    ``Tensor.numpy()`` refuses exactly the cases ``to_jax`` handles (grad-requiring,
    conjugate/negative bit, bfloat16, other devices), so its refusal routes there.
    """
    try:
        return t.numpy()
    except (RuntimeError, TypeError):
        return to_jax(t)


def _bf16_scalar(t: torch.Tensor) -> np.ndarray:
    return t.reshape(1).view(torch.int16).numpy().view(_BF16).reshape(())


def zero_copy_array(t: torch.Tensor) -> jax.Array | None:
    """A ``jax.Array`` that *is* ``t``'s memory, or None where JAX would copy.

    Only such arrays may be cached across calls: they see every later in-place write to
    the tensor exactly as eager PyTorch does, whether or not the write bumped the
    version counter. Call under ``jax.enable_x64(True)`` (int64 stays int64).
    """
    if t.numel() == 0 or t.is_conj() or t.is_neg() or t.dtype not in TORCH_TO_JAX:
        return None
    if t.is_inference():  # no version counter: changes to it cannot be detected
        return None
    t = t.detach()  # a new tensor object: the array does not keep ``t`` itself alive
    if t.device.type == "cpu":
        view = to_jax(t)
        arr = jax.device_put(view, cpu_device(), may_alias=True)
    else:
        if not t.is_contiguous():
            # DLPack would keep the strides as a layout the executable was not
            # compiled for; to_jax makes a row-major copy instead.
            return None
        try:
            arr = dlpack_to_jax(t)
        except (RuntimeError, TypeError, ValueError, BufferError):
            return None
    try:
        same = arr.unsafe_buffer_pointer() == t.data_ptr()
    except (RuntimeError, NotImplementedError):
        same = False
    return arr if same else None


def committed_cpu(t: torch.Tensor) -> jax.Array:
    """``t`` (a CPU tensor) as an array committed to JAX's CPU device, where JAX's
    default backend is an accelerator (a NumPy view would land there)."""
    return jax.device_put(to_jax(t), cpu_device(), may_alias=True)


def accelerator_array(t: torch.Tensor) -> jax.Array | None:
    """``zero_copy_array`` for a partition on an accelerator: a CPU tensor there (a
    0-dim one PyTorch lets meet a GPU's) is not cached as a CPU array, and crosses per
    call (the executable puts it on its device)."""
    return None if t.device.type == "cpu" else zero_copy_array(t)


_CPU = None


def cpu_device() -> Any:
    """This process's first JAX CPU device (in a multi-process run ``jax.devices()``
    lists every process's devices, and only local ones can hold this process's memory)."""
    global _CPU
    if _CPU is None:
        _CPU = jax.local_devices(backend="cpu")[0]
    return _CPU


def to_torch(a: jax.Array) -> torch.Tensor:
    """A torch tensor viewing the buffer of the JAX array ``a`` (blocks until ready)."""
    if a.platform() != "cpu":
        return dlpack_to_torch(a)
    if not _warned:
        quiet_readonly_warning()
    return cpu_to_torch(a)


# Tensors made by ``remembering(...)``, by id: (weak reference, array, version,
# pointer). A side table, not an attribute: ``torch.save`` and ``copy.deepcopy`` carry a
# tensor's ``__dict__``, and would carry the array with it.
_SOURCES: dict[int, tuple[weakref.ref, jax.Array, int, int]] = {}


def remembering(
    to_torch: Callable[[jax.Array], torch.Tensor],
) -> Callable[[jax.Array], torch.Tensor]:
    """``to_torch``, remembering which array each tensor views (``from_source_or``).

    For partitions on accelerators, where a tensor crosses into JAX by a DLPack import
    (~100 µs on an H100, most of it Python in torch and JAX): a result handed back to a
    partition unchanged (a forward's saved activations into its backward, a value
    between two partitions) crosses as the very array it came from. The entry goes when
    the tensor does (autograd keeps a saved tensor's Python object alive with it).
    """

    def to_torch_remembered(a: jax.Array) -> torch.Tensor:
        t = to_torch(a)
        key = id(t)

        def forget(ref: weakref.ref) -> None:
            entry = _SOURCES.get(key)
            if entry is not None and entry[0] is ref:
                del _SOURCES[key]

        _SOURCES[key] = (weakref.ref(t, forget), a, t._version, t.data_ptr())
        return t

    return to_torch_remembered


def from_source_or(convert: Any) -> Any:
    """``convert``, except for a tensor made by ``remembering(...)`` and untouched
    since (same version, pointer, shape, row-major strides): that one is its array.

    Safe on any device: the array is the tensor's memory and torch has not written to
    it (a write bumps the version counter, which views share); JAX orders its own
    reads after the computation that defined the array.
    """

    def cross(t: torch.Tensor) -> Any:
        entry = _SOURCES.get(id(t))
        if entry is not None:
            ref, a, version, ptr = entry
            if (
                ref() is t
                and t._version == version
                and t.data_ptr() == ptr
                and a.shape == t.shape
                and t.is_contiguous()
            ):
                return a
        return convert(t)

    return cross


def cpu_to_torch(a: jax.Array) -> torch.Tensor:
    """``to_torch`` for an array known to be on CPU, once ``quiet_readonly_warning``
    has run (``CompiledPartition`` runs it when it is built)."""
    arr = np.asarray(a)
    if arr.dtype == _BF16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def quiet_readonly_warning() -> None:
    """Consumes torch's once-per-process warning about wrapping read-only NumPy arrays.

    The NumPy view of an XLA output buffer is read-only to NumPy, but that buffer
    belongs to this output alone (XLA copies any output that would be an input or a
    constant, and dynajax donates no input buffer), so the caller may write to the
    tensor. Called at compile time so the per-call path never pays for a warnings
    context; changes no warning filter.
    """
    global _warned
    if _warned:
        return
    ro = np.zeros(1, np.float32)
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        torch.from_numpy(ro)
    _warned = True


_warned = False
