"""Eager's precision for float32 products, as JAX's settings.

PyTorch multiplies float32 matrices in float32 unless asked otherwise
(``torch.set_float32_matmul_precision``: "highest" by default); JAX's own default on a
GPU is TF32 (on the CPU both are float32), which eager never uses unless asked to
("high"). Eager's float32 convolutions on CUDA tensors are cuDNN's, which use TF32
while ``torch.backends.cudnn.allow_tf32`` is set (PyTorch's default), whatever the
matmul precision. Both drivers trace their programs under ``eager_precision``: the
backend's partitions (``runtime/executables.py``) and the whole-graph programs
(``program/driver.py``: ``jax_function``, ``export``, torch's backward in JAX,
``train_step``). The setting is part of the lowered program, so of any cache key.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import jax
import torch

from dynajax.lowering import conv_algorithms

# torch.get_float32_matmul_precision() -> JAX's precision for float32 dots.
_MATMUL_PRECISION = {"highest": "highest", "high": "tensorfloat32", "medium": "bfloat16"}


def matmul_precision() -> str:
    """JAX's name for PyTorch's current float32 matmul precision."""
    return _MATMUL_PRECISION.get(torch.get_float32_matmul_precision(), "highest")


def conv_precision(on_cuda: bool) -> str:
    """JAX's name for the precision of eager's float32 convolutions.

    On an NVIDIA GPU (``on_cuda``: the tensors eager computes on are CUDA tensors)
    eager's convolutions are cuDNN's, which use TF32 while
    ``torch.backends.cudnn.allow_tf32`` is set (PyTorch's default), whatever the matmul
    precision. On the CPU (oneDNN) a float32 convolution is float32, also when dynajax
    places the program on a GPU: the matmul precision's name is kept.
    """
    if not on_cuda:
        return matmul_precision()
    with warnings.catch_warnings():  # (a torch release may deprecate the flag's name)
        warnings.simplefilter("ignore")
        tf32 = bool(torch.backends.cudnn.allow_tf32)
    return "tensorfloat32" if tf32 else "highest"


def describe(on_cuda: bool) -> str:
    """The two settings as one name, for cache keys: ``highest``, or
    ``highest conv=tensorfloat32`` where they differ."""
    precision, conv = matmul_precision(), conv_precision(on_cuda)
    return precision if conv == precision else f"{precision} conv={conv}"


@contextlib.contextmanager
def eager_precision(on_cuda: bool) -> Iterator[None]:
    """Traces under eager's precision for float32 matmuls and convolutions (``on_cuda``:
    eager computes on CUDA tensors)."""
    with (
        jax.default_matmul_precision(matmul_precision()),
        conv_algorithms.for_convolutions(conv_precision(on_cuda)),
    ):
        yield
