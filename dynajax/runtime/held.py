"""Process-wide settings changed for the length of a block, safely across threads.

Some of what dynajax needs while it traces is a process-wide switch of torch's (a
logger's level, ``torch.compiler``'s compiling flag, ``fill_uninitialized_memory``, an
optimizer module's function patched for the trace). A save and restore per block is
wrong once two threads overlap: the second saves the first's change as "the old value",
and restores it after the first has undone it, leaving the change in place for good.
``Held`` makes the change once for every block inside, in any thread, and undoes it when
the last one leaves. Every such switch of dynajax's goes through one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class Held:
    """A process-wide change held while any block, in any thread, is inside: made by
    the first block to enter and undone by the last to leave.

    Args:
        make: makes the change and returns its undo.
    """

    def __init__(self, make: Callable[[], Callable[[], None]]) -> None:
        self._make = make
        self._undo: Callable[[], None] | None = None
        self._depth = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._undo = self._make()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._undo is not None:
                    self._undo()
                    self._undo = None
