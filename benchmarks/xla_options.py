"""Candidate XLA:CPU compile choices for dynajax's executables, side by side on the
benchmark's model rows.

    python -m benchmarks.xla_options                          # mlp, encoder-layer, gpt2
    python -m benchmarks.xla_options --workloads mlp,mlp-train --rounds 40
    python -m benchmarks.xla_options --candidates default,ynn-dot

Each candidate is the same model compiled by dynajax with one change: extra compiler
options for every executable (``dynajax.runtime.cache.COMPILER_OPTIONS`` swapped while
that candidate compiles; the options are part of the persistent cache key, and the cache
is off here), or a different rule for ``aten.mm``/``aten.bmm``. All candidates of a row
are built in one process and timed in interleaved rounds (each call timed alone after
one untimed call); the table gives the median and the 10th percentile per call and both
ratios to ``default``. A candidate wins only if it wins on every row.

Candidates:

* ``default``: what dynajax compiles today (XLA hands dots whose left operand is
  contracted on its last dimension to YNNPACK, one dot per fusion; other dots to Eigen).
* ``ynn-dot``: ``xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT``: YNNPACK
  fusions that take the elementwise ops around a dot too (bias, ReLU).
* ``eigen``: YNNPACK off (``xla_cpu_experimental_ynn_fusion_type=""``): every dot on
  XLA's Eigen runtime.
* ``lhs-copy``: the left operand of ``mm``/``bmm`` behind an optimization barrier, so a
  transposed one (a weight gradient, ``g^T @ x``) is copied row-major and the dot goes
  to YNNPACK instead of Eigen.
* ``vec512``: XLA's own loop fusions (bias, ReLU, layer norm, softmax) vectorized for
  512-bit registers (``xla_cpu_prefer_vector_width=512``; the default is 256).
* ``concurrency-scheduler``: ``xla_cpu_enable_concurrency_optimized_scheduler``, an
  instruction order meant to let independent thunks run concurrently.

oneDNN fusions (``xla_cpu_experimental_onednn_fusion_type``) and XNNPACK graph fusion
are accepted as options by jaxlib 0.10.2 but leave every dot as it was (YNNPACK or
Eigen) on this build, so they are not candidates.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

CANDIDATES: dict[str, dict[str, Any]] = {
    "default": {},
    "ynn-dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "eigen": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "lhs-copy": {},
    "vec512": {"xla_cpu_prefer_vector_width": 512},
    "concurrency-scheduler": {"xla_cpu_enable_concurrency_optimized_scheduler": True},
}


@contextmanager
def _candidate(name: str) -> Iterator[None]:
    import jax
    import torch

    from dynajax.lowering import registry
    from dynajax.lowering.linalg import products
    from dynajax.runtime import cache

    saved_options = dict(cache.COMPILER_OPTIONS)
    ops = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
    saved_rules = {op: registry._TABLE[op] for op in ops}
    cache.COMPILER_OPTIONS.update(CANDIDATES[name])
    if name == "lhs-copy":

        def mm(a: Any, b: Any) -> Any:
            return products._matmul(jax.lax.optimization_barrier(a), b)

        for op, rule in saved_rules.items():
            registry._TABLE[op] = dataclasses.replace(rule, fn=mm)
    try:
        yield
    finally:
        cache.COMPILER_OPTIONS.clear()
        cache.COMPILER_OPTIONS.update(saved_options)
        registry._TABLE.update(saved_rules)


def _steps(workload: str, names: list[str]) -> dict[str, Callable[[], Any]]:
    from benchmarks import harness
    from benchmarks.workloads import WORKLOADS

    w = WORKLOADS[workload]
    steps = {}
    for name in names:
        with _candidate(name):
            step = harness.build_step(w, "dynajax")
            assert step is not None
            step()  # compiles under this candidate's options and rules
            step()
        steps[name] = step
    return steps


def _time(steps: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in steps}
    keys = list(steps)
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            steps[k]()  # settle: the previous candidate's threads
            for _ in range(2):
                t0 = time.perf_counter()
                steps[k]()
                times[k].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="mlp,encoder-layer,gpt2")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    os.environ["DYNAJAX_CACHE_DIR"] = ""  # every candidate compiles
    names = args.candidates.split(",")
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown candidate(s) {unknown}; known: {list(CANDIDATES)}")
    if names[0] != "default" and "default" not in names:
        names.insert(0, "default")
    print(f"load average {os.getloadavg()[0]:.1f}; ms per call: median (p10); ratio to default")
    for workload in args.workloads.split(","):
        times = _time(_steps(workload, names), args.rounds)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        p10 = {k: statistics.quantiles(v, n=10)[0] * 1e3 for k, v in times.items()}
        cells = "  ".join(
            f"{k} {med[k]:.2f} ({p10[k]:.2f}) {med[k] / med['default']:.2f}/"
            f"{p10[k] / p10['default']:.2f}"
            for k in names
        )
        print(f"{workload:14} {cells}", flush=True)


if __name__ == "__main__":
    main()
