"""Runs in subprocesses of tests/cache: compiles graphs against one cache directory.

python -m tests.cache.worker compile <cache_dir> <max_bytes> <go_file> <sizes...>
    waits for <go_file> (so that every worker starts at once), then compiles
    ``graph`` at each size (rows) twice over, checks every answer against eager and
    prints one JSON line of stats.
python -m tests.cache.worker stall <cache_dir> <ready_file>
    compiles ``graph`` on a (4, 3) input, but its cache write stops half way: it
    writes half of the entry, creates <ready_file> and sleeps until killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO

import torch

import dynajax
from dynajax import store
from dynajax.runtime import cache


def graph(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + x.exp()


def compile_sizes(cache_dir: str, max_bytes: int, go: Path, sizes: list[int]) -> None:
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{go} never appeared")
        time.sleep(0.01)
    total = cache.CompileStats()
    for _ in range(2):
        for n in sizes:
            torch._dynamo.reset()
            backend = dynajax.Backend(cache_dir=cache_dir, cache_max_bytes=max_bytes)
            x = torch.randn(n, 3)
            out = torch.compile(graph, backend=backend)(x)
            torch.testing.assert_close(out, graph(x), rtol=1e-5, atol=1e-5)
            total += dynajax.Report(backend.graphs).compile_stats
    print(
        json.dumps(
            {
                "compiles": total.xla_compiles,
                "hits": total.cache_hits,
                "misses": dict(total.cache_misses),
                "evicted": total.cache_evictions,
            }
        )
    )


def stall(cache_dir: str, ready: Path) -> None:
    def half_then_sleep(f: IO[bytes], blob: bytes) -> None:
        f.write(blob[: len(blob) // 2])
        f.flush()
        ready.touch()
        time.sleep(600)

    store._write_entry = half_then_sleep
    torch.compile(graph, backend=dynajax.Backend(cache_dir=cache_dir))(torch.randn(4, 3))
    raise AssertionError("the write should have stalled until the process was killed")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "compile":
        compile_sizes(args[0], int(args[1]), Path(args[2]), [int(a) for a in args[3:]])
    elif command == "stall":
        stall(args[0], Path(args[1]))
    else:
        raise SystemExit(f"unknown command {command!r}; use 'compile' or 'stall'")
