"""Every private JAX internal dynajax uses, in one place, each with a public fallback.

The per-call path of a partition is a few microseconds, and three of JAX's internals
take a measurable part of it off (``benchmarks/overhead.py`` measures the layers):

* ``X64``: the thread-local switch behind ``jax.enable_x64()``, flipped around each
  call (about 1 µs cheaper than entering the public context manager). Public fallback:
  ``jax.enable_x64(True)`` entered and exited by hand.
* ``dispatch_of(compiled)``: the C++ dispatch function a ``jax.stages.Compiled`` sets up
  at its first call and looks up on every later one (``Compiled._call``); calling it
  directly saves a Python frame. Public fallback: the ``Compiled`` object itself.
* ``direct_executor(compiled)``: the loaded XLA executable's own entry point
  (``Compiled._executable.xla_executable.execute_sharded``, with the indices of the
  arguments XLA kept, ``_kept_var_idx``, and the C++ result handlers the dispatch path
  builds its output arrays with), which skips the per-argument checks of the dispatch
  path when the caller has already checked the arguments. Public fallback: None (the
  caller stays on the dispatch path).
* ``array_putter(shape, dtype, device)``: the C++ ``batched_device_put`` that the
  dispatch path itself uses for a NumPy argument (zero-copy where aligned, ~3.5 µs;
  ``jax.device_put`` costs ~28 µs), so that a call whose other inputs are cached can
  take the direct entry point with a new tensor among them. Public fallback: None (such
  a call stays on the dispatch path).

* ``dlpack_exporter()``: ``export(array, stream)``, the C function behind
  ``jax.Array.__dlpack__`` (``buffer_to_dlpack_managed_tensor``), which makes the DLPack
  capsule of a single-device array and, given a consumer's stream, has that stream wait
  for the array. ``torch.from_dlpack`` reaches it through ~20 µs of Python in torch and
  JAX per array on an H100 (device queries, stream objects, checks); the per-call path
  of a partition on a GPU knows the answers to those already. Public fallback: None
  (the caller uses ``torch.from_dlpack``).

* ``dlpack_importer()``: ``import_(capsule, device, stream, kind)``, the C function
  behind ``jax.dlpack.from_dlpack`` (``dlpack_managed_tensor_to_buffer``), whose
  arguments changed with jaxlib's extension version 467. ``jax.dlpack.from_dlpack``
  reaches it through ~40 µs of Python per tensor on this CPU (~100 µs per tensor on an
  H100), most of it in the producer's ``__dlpack__`` and JAX's device lookups; a caller
  that knows the device and stream needs neither. Public fallback: None (the caller
  uses ``jax.dlpack.from_dlpack``).

* ``backends_started()``: whether JAX has created its clients yet (a setting of the
  CPU client, ``runtime/cpu_client.py``, only takes effect before). Public fallback:
  None (unknown; the caller leaves the setting alone).

* ``lapack_initializer()``: ``jax._src.lax.linalg.initialize_lapack``, which points
  jaxlib's LAPACK kernels at their functions (JAX calls it when it lowers a linear-
  algebra op). A cached executable that calls those kernels, loaded into a process that
  lowered none, crashes the process when it runs (SIGSEGV, jaxlib 0.10.2), so the
  persistent cache calls it before loading one (``runtime/cache.py``). Public fallback:
  None (no public way; the cache then recompiles such executables instead of loading
  them).

* ``jax_trace_state()``: the object whose ``profile_session`` is set while
  ``jax.profiler`` traces (``jax._src.profiler._profile_state``), so that a call opens
  its ``TraceAnnotation`` only then (a read of one attribute; the annotation costs
  ~0.5 µs). Public fallback: None (the caller names its calls in torch's profiler only).

``status()`` says which internals this JAX release has; the test suite asserts that all
are present, so a JAX release that moves one fails loudly in CI instead of silently
slowing every call, and it runs the fallbacks too. Nothing else in dynajax imports
``jax._src`` or reads a private attribute of a JAX object.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax


class _X64Switch:
    """Turns 64-bit types on for the current thread and restores the previous state.

        token = X64.enable()
        try: ...
        finally: X64.restore(token)

    With the internal switch, ``enable`` and ``restore`` are its own methods (bound once
    here), so the per-call path pays no extra Python frame for going through the shim.
    """

    enable: Callable[[], Any]
    restore: Callable[[Any], None]

    def __init__(self, private: bool = True) -> None:
        state = _private_x64_state() if private else None
        self.uses_internal = state is not None
        if state is not None:
            self.enable = functools.partial(state.swap_local, True)
            self.restore = state.set_local
        else:
            self.enable = _enter_x64
            self.restore = _exit_x64


def _enter_x64() -> Any:
    ctx = jax.enable_x64(True)
    ctx.__enter__()
    return ctx


def _exit_x64(ctx: Any) -> None:
    ctx.__exit__(None, None, None)


def _private_x64_state() -> Any | None:
    try:
        from jax._src.config import enable_x64 as state
    except ImportError:
        return None
    if not (
        callable(getattr(state, "swap_local", None)) and callable(getattr(state, "set_local", None))
    ):
        return None
    return state


X64 = _X64Switch()


def dispatch_of(compiled: jax.stages.Compiled) -> Callable[..., Any]:
    """After ``compiled``'s first call: its C++ dispatch function, else ``compiled``."""
    fast = getattr(compiled, "_call", None)
    return fast if callable(fast) else compiled


class DirectExecutor(NamedTuple):
    """A loaded executable's own entry point: ``execute(arrays).consume_with_handlers(
    handlers)`` is the list of its output arrays, ``arrays`` being the arguments at
    the positions ``kept`` (XLA drops unused ones)."""

    kept: list[int]
    execute: Callable[[Sequence[jax.Array]], Any]
    handlers: list[Any]


def direct_executor(compiled: jax.stages.Compiled) -> DirectExecutor | None:
    """The executable's own entry point, or None where this JAX release does not expose
    it or where the dispatch path does more than execute and wrap the results (effects
    and host callbacks need runtime tokens, mutable arrays write back, ``jax_debug_nans``
    checks each output): callers then keep the dispatch path.
    """
    inner = getattr(compiled, "_executable", None)
    kept = getattr(inner, "_kept_var_idx", None)
    xla = getattr(inner, "xla_executable", None)
    execute = getattr(xla, "execute_sharded", None)
    call = getattr(inner, "unsafe_call", None)
    handlers = getattr(getattr(call, "out_handler", None), "handlers", None)
    if kept is None or not callable(execute) or handlers is None:
        return None
    if (
        getattr(call, "ordered_effects", True)
        or getattr(call, "has_unordered_effects", True)
        or getattr(call, "has_host_callbacks", True)
        or getattr(call, "mut", True) is not None
        or jax.debug_nans.value
        or jax.debug_infs.value
    ):
        return None
    return DirectExecutor(sorted(kept), execute, list(handlers))


def array_putter(
    shape: tuple[int, ...], dtype: Any, device: jax.Device
) -> Callable[[Any], jax.Array] | None:
    """``put(view)``: a NumPy array of ``shape`` and ``dtype`` as a ``jax.Array`` on
    ``device`` (its memory where aligned, as the dispatch path takes NumPy arguments;
    64-bit types stay 64-bit), or None where this JAX release lacks the internal."""
    try:
        from jax._src import core
        from jax._src.lib import xla_client
    except ImportError:
        return None
    batched = getattr(xla_client, "batched_device_put", None)
    make_aval = getattr(core, "ShapedArray", None)
    if batched is None or make_aval is None:
        return None
    aval = make_aval(shape, dtype)
    sharding = jax.sharding.SingleDeviceSharding(device)
    devices = [device]

    def put(view: Any) -> jax.Array:
        return batched(aval, sharding, [view], devices, True, enable_x64=True)  # type: ignore[no-any-return]

    return put


def _jaxlib_function(name: str) -> Any | None:
    """A function of jaxlib's extension module, or None where it has no such name."""
    try:
        from jax._src.lib import _jax
    except ImportError:
        return None
    return getattr(_jax, name, None)


def dlpack_exporter() -> Callable[[jax.Array, int | None], Any] | None:
    """``export(array, stream)`` -> a DLPack capsule of a single-device ``array``, the
    consumer's ``stream`` (a CUDA stream pointer, 1 for the legacy default stream, or
    None on the CPU) made to wait for it; None where this JAX release lacks it."""
    return _jaxlib_function("buffer_to_dlpack_managed_tensor")  # type: ignore[no-any-return]


def dlpack_importer() -> Callable[[Any, jax.Device, int | None, int], jax.Array] | None:
    """``import_(capsule, device, stream, kind)`` -> the ``jax.Array`` over a DLPack
    capsule's memory on ``device`` (``kind``: the DLPack device type; ``stream``: the
    stream the producer made wait, or None); None where this JAX release lacks it."""
    make = _jaxlib_function("dlpack_managed_tensor_to_buffer")
    if make is None:
        return None
    from jax._src.lib import jaxlib_extension_version

    takes_kind = jaxlib_extension_version >= 467  # the DLPack device type, since then

    def import_(capsule: Any, device: jax.Device, stream: int | None, kind: int) -> Any:
        if takes_kind:
            return make(capsule, device, stream, None, kind)
        return make(capsule, device, stream, None)

    return import_


def backends_started() -> bool | None:
    """Whether JAX has created its backends (clients) in this process; None if unknown."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return None
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else None


def lapack_initializer() -> Callable[[], None] | None:
    try:
        from jax._src.lax import linalg
    except ImportError:
        return None
    found = getattr(linalg, "initialize_lapack", None)
    return found if callable(found) else None


def jax_trace_state() -> Any | None:
    try:
        from jax._src import profiler
    except ImportError:
        return None
    state = getattr(profiler, "_profile_state", None)
    return state if state is not None and hasattr(state, "profile_session") else None


def status() -> dict[str, bool]:
    """Which private internals this JAX release has (all True on a supported one)."""
    probe = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((1,), "float32")).compile()
    probe(jax.numpy.zeros((1,), "float32"))  # the dispatch function exists after a call
    return {
        "x64_switch": _private_x64_state() is not None,
        "dispatch": dispatch_of(probe) is not probe,
        "direct_executor": direct_executor(probe) is not None,
        "array_putter": array_putter((1,), "float32", jax.devices("cpu")[0]) is not None,
        "backends_started": backends_started() is not None,
        "dlpack_exporter": dlpack_exporter() is not None,
        "dlpack_importer": dlpack_importer() is not None,
        "lapack_initializer": lapack_initializer() is not None,
        "jax_trace_state": jax_trace_state() is not None,
    }
