"""Resident state on a JAX device: per-call time of a model compiled with ``device=``.

    python -m benchmarks.placement              # runs itself with two JAX CPU devices
    python -m benchmarks.placement --rounds 7

The model runs on JAX's second CPU device (``device="cpu:1"``), which stands in for an
accelerator PyTorch has no backend for: parameters must be copied there. Three ways,
timed side by side (interleaved rounds, median per call):

* ``default``: no ``device``; CPU tensors are used where they are, zero-copy;
* ``device, resident``: ``device="cpu:1"``; parameters copied once, kept between calls;
* ``device, copied per call``: the same, but every parameter's version counter is
  bumped before each call (``p.add_(0)``, also timed alone and subtracted), so every
  call copies every parameter again: what a compiled program that does not own its
  state pays.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def _per_call_s(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _rows(rounds: int, calls: int) -> None:
    torch.manual_seed(0)
    models = {
        "MLP 512-2048-512, batch 8": (
            torch.nn.Sequential(
                torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
            ),
            torch.randn(8, 512),
        ),
    }
    print(f"{'model':<28} {'way':<26} {'ms/call':>9} {'x default':>10}")
    for name, (model, x) in models.items():
        with torch.no_grad():
            med = _time_ways(model, x, rounds, calls)
        for way, s in med.items():
            print(f"{name:<28} {way:<26} {s * 1e3:>9.3f} {s / med['default']:>10.2f}")


def _time_ways(model: torch.nn.Module, x: torch.Tensor, rounds: int, calls: int) -> dict:
    """Median seconds per call of each way, interleaved round by round."""
    import dynajax

    params = list(model.parameters())
    default = torch.compile(model, backend=dynajax.Backend(cache_dir=""))
    placed = torch.compile(model, backend=dynajax.Backend(cache_dir="", device="cpu:1"))

    def bump() -> None:
        for p in params:
            p.add_(0)

    def copied() -> Any:
        bump()
        return placed(x)

    runs: dict[str, Callable[[], Any]] = {
        "default": lambda: default(x),
        "device, resident": lambda: placed(x),
        "device, copied per call": copied,
        "(version bump alone)": bump,
    }
    for f in runs.values():
        for _ in range(20):
            f()
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            samples[k].append(_per_call_s(f, calls))
    med = {k: statistics.median(v) for k, v in samples.items()}
    med["device, copied per call"] -= med.pop("(version bump alone)")
    return med


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
        cmd = [sys.executable, "-m", "benchmarks.placement", "--worker"]
        cmd += ["--rounds", str(args.rounds), "--calls", str(args.calls)]
        return subprocess.run(cmd, env=env, check=False).returncode
    _rows(args.rounds, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
