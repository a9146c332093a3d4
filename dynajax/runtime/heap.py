"""Returning to the system the memory a compile freed.

Tracing, lowering and XLA's compiler allocate many small objects (below glibc's mmap
threshold), which live in malloc's heaps. Freed, they stay in the process's resident
set as free fragments that glibc does not return by itself, so a process that compiled
holds more than one that did not, for as long as it runs. After ``train_step`` builds
a program, dynajax asks glibc to return the free pages (``malloc_trim(0)``; 3-5 ms
after ResNet-18's step, whose steady resident peak falls by 59 MiB,
``benchmarks/RECORD.md``). Where the C library is not glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any


@functools.cache
def _malloc_trim() -> Callable[[int], Any] | None:
    try:
        trim: Callable[[int], Any] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl builds without it)
        return None
    return trim


def release_freed_heap() -> bool:
    """Returns the heap's free pages to the system; whether the C library can."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
