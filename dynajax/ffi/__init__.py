"""PyTorch's kernels inside XLA programs, through XLA's FFI.

One C++ handler (``torch_op.cc``) runs any PyTorch operator as a custom call of an XLA
program: it views XLA's buffers as tensors and calls the operator through the ATen
dispatcher by its name. ``extension.py`` builds it with ``torch.utils.cpp_extension``
against the FFI headers jaxlib ships, once per torch and jax version, and registers it
with JAX; ``call.py`` decides which calls it can run and writes them into a trace
(``jax.ffi.ffi_call``), and turns the handler's errors back into eager's exceptions.

Both drivers use it: the backend runs an op with no JAX rule, or one measured faster
in PyTorch, inside its partition rather than between two (capability), and the
whole-graph driver runs such an op in its program rather than through a Python host
callback (``program/callbacks.py``). Where the extension cannot be built (no C++
compiler) or is turned off (``DYNAJAX_TORCH_KERNELS=0``), both keep their other paths.
"""

from dynajax.ffi.call import (
    Strided,
    call_kernel,
    eager_error,
    flat_outputs,
    kernel_refusal,
    rebuild_outputs,
)
from dynajax.ffi.extension import TARGET, available

__all__ = [
    "TARGET",
    "Strided",
    "available",
    "call_kernel",
    "eager_error",
    "flat_outputs",
    "kernel_refusal",
    "rebuild_outputs",
]
