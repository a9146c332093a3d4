"""What eager PyTorch's CPU kernels depend on besides their inputs.

A few of eager's CPU kernels round half-precision values differently by where an
element falls in the kernel's loop: its vectorized body or its scalar tail. Which
elements those are depends on two settings of the process, read here when a rule is
traced (and both are part of a program's cache key, ``runtime/programs.py``):

* the vector width of the CPU capability eager dispatched to
  (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` can
  lower): 64 bytes under AVX-512, 32 bytes under AVX2 and the x86 default build
  (measured on one AMD EPYC with ``ATEN_CPU_CAPABILITY=avx512|avx2|default``);
* the number of threads of eager's pool (``torch.get_num_threads()``), over which
  ``at::parallel_for`` with a grain size of 0 splits a range into equal chunks.

Other platforms (aarch64's NEON and SVE, POWER's VSX) are not measured here: they
are given 32 bytes, a guess that can put an element's rounding an ulp from eager's.
"""

from __future__ import annotations

import torch


def capability() -> str:
    """The CPU capability eager's kernels dispatch to ("AVX512", "AVX2", "DEFAULT", ...)."""
    return torch.backends.cpu.get_cpu_capability()


def vector_bytes() -> int:
    """The width of one of eager's ``Vectorized<T>`` registers, in bytes."""
    return 64 if capability() == "AVX512" else 32


def threads() -> int:
    """How many threads ``at::parallel_for`` splits a range over."""
    return torch.get_num_threads()


def settings() -> str:
    """Both, as text for a program's cache key."""
    return f"cpu_capability={capability()} threads={threads()}"
