"""OpInfo samples that dynajax gets wrong today: data with a reason, a list that only
shrinks. Keys are ``(op name, variant test name, dtype)`` as in PyTorch's OpInfo
database; the value says why. ``tests/test_opinfo.py`` fails when a listed entry passes
every one of its samples (remove it then), and ``python -m tests.opinfo_full`` lists
those entries after a run.
"""

from __future__ import annotations

EXPECTED_FAILURES: dict[tuple[str, str, str], str] = {}
