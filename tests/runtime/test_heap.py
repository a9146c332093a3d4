"""``release_freed_heap``: the heap pages a compile freed leave the resident set (on
Linux with glibc, where the project's tests run, as the memory workers do)."""

from __future__ import annotations

import json

from tests.helpers import run_python

# Fragments the heap as a trace does (many small allocations, a few kept between the
# freed ones), frees them, and reports the resident set before and after the release.
_FRAGMENT = """
import json, re
from dynajax.runtime.heap import release_freed_heap

def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10

blocks = [bytearray(2000) for _ in range(100_000)]  # 200 MB in glibc's heap
kept = blocks[::500]
del blocks
before = rss()
released = release_freed_heap()
print(json.dumps({"before": before, "after": rss(), "released": released}))
"""


def test_the_freed_heap_leaves_the_resident_set() -> None:
    out = json.loads(run_python("-c", _FRAGMENT))
    assert out["released"]
    # Most of the 200 MB freed was still resident (glibc keeps a fragmented heap's
    # free pages); the release returns it.
    assert out["before"] - out["after"] > 100 << 20, out
