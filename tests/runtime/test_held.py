"""Process-wide switches held across threads (``dynajax/runtime/held.py``): two blocks
in two threads that overlap leave the process as it was, whichever leaves first."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch.utils.deterministic as deterministic

from dynajax.runtime.held import Held


def _overlapping(block: Callable[[], object], during: Callable[[], object]) -> list[object]:
    """Thread A enters ``block``, thread B enters it, A leaves, B leaves: what ``during``
    read in A, in B after A left, and after both left."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[object] = []

    def a() -> None:
        with block():  # type: ignore[attr-defined]
            a_in.set()
            b_in.wait(5)
            seen.append(during())
        a_out.set()

    def b() -> None:
        a_in.wait(5)
        with block():  # type: ignore[attr-defined]
            b_in.set()
            a_out.wait(5)
            seen.append(during())

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    seen.append(during())
    return seen


def test_a_held_change_lasts_until_the_last_thread_leaves() -> None:
    value = {"flag": False}

    def make() -> Callable[[], None]:
        old = value["flag"]
        value["flag"] = True
        return lambda: value.update(flag=old)

    held = Held(make)
    assert _overlapping(held, lambda: value["flag"]) == [True, True, False]


@pytest.mark.parametrize("fill", [False, True])
def test_train_steps_tracing_in_two_threads_leave_the_fill_setting(fill: bool) -> None:
    from dynajax.training.program import _unfilled

    old = deterministic.fill_uninitialized_memory
    deterministic.fill_uninitialized_memory = fill
    try:
        seen = _overlapping(_unfilled, lambda: deterministic.fill_uninitialized_memory)
        assert seen == [False, False, fill]
    finally:
        deterministic.fill_uninitialized_memory = old
