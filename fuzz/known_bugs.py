"""dynajax bugs the fuzzer has found and that are not fixed yet, by signature.

A failure whose signature (``fuzz.check.signature``: ``kind:op:detail``) is listed here
is reported as known: it is not shrunk, gets no reproducer and does not fail
``tests/test_fuzz.py``. Each cause has a strict-xfail regression test in
``tests/test_fuzz_regressions.py``; remove the entries with the fix (the list only
shrinks). One bug shows under several signatures (each op and dtype it reaches).
"""

from __future__ import annotations

KNOWN_BUGS: dict[str, str] = {}

# ``python -m fuzz --through train_step`` (``fuzz/training.py``): train_step's
# failures against the eager training loop, by signature pattern (``fnmatch``: ``*``
# any text). Empty when train_step agrees with eager on every case.
KNOWN_TRAINING_BUGS: dict[str, str] = {}
