"""Matrix products of the model rows: PyTorch eager (MKL), what dynajax runs (XLA's
choice of runtime for the rule's dot), and XLA's Eigen dot, per shape.

    python -m benchmarks.matmul                 # every shape, all CPUs
    python -m benchmarks.matmul --threads 1     # pinned to one CPU (fair per-core kernels)
    python -m benchmarks.matmul --rounds 40
    python -m benchmarks.matmul --cpu-time      # CPU seconds per call: work, not waiting

The shapes are the products of the benchmark's MLP (512-2048-512, batch 64) and
encoder layer (256 wide, 1024 tokens) rows, forward and backward, and of a decode step
(one token through a LLaMA layer of width 256): ``x @ W^T`` for a
linear layer, ``g @ W`` for its input gradient, ``g^T @ x`` for its weight gradient.
Each operand is laid out as in those graphs (a transposed operand is a transposed view
of a row-major array, as aot_autograd's ``t``/``permute`` leaves it).

Columns: ``runtime`` is the library XLA hands the dot to in dynajax's executable
(``ynn``: a YNNPACK fusion; ``eigen``: XLA's Eigen dot; XLA takes YNNPACK only where
the left operand is contracted on its last dimension); ``dynajax`` is the product as
a partition traces it, a transposed operand folded into the dot's contracting
dimension (``dynajax/lowering/transposes.py``), ``unfolded`` the same rule on the
materialized transpose (a ``transpose`` then a ``dot``, as before the folding); times
are the median and the minimum over interleaved rounds (a new seeded order each round),
each call timed alone after untimed calls for 10 ms (so the previous peer's spinning
threads are absorbed).
The minimum is the better estimate of a kernel's own speed on a loaded machine; compare
ratios within one run.

``--cpu-time`` reports the process's CPU time (user + system) per call instead, over
batches of calls: the work a kernel does, which other processes' load does not
inflate (waiting for a core is not CPU time). PyTorch's OpenMP workers spin after each
parallel region and would count their spinning, so that mode runs with
``OMP_WAIT_POLICY=PASSIVE`` (the script restarts itself with it). It does not show
parallel efficiency: a kernel that splits poorly over the cores takes more wall time
for the same CPU time.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness import settle

# (name, stored shape of a, stored shape of b, a transposed, b transposed):
# the product op(a) @ op(b).
SHAPES: list[tuple[str, tuple[int, int], tuple[int, int], bool, bool]] = [
    ("MLP fc1 x@W^T 64x512x2048", (64, 512), (2048, 512), False, True),
    ("MLP fc2 h@W^T 64x2048x512", (64, 2048), (512, 2048), False, True),
    ("MLP dX g@W 64x512x2048", (64, 512), (512, 2048), False, False),
    ("MLP dW1 g^T@x 2048x64x512", (64, 2048), (64, 512), True, False),
    ("MLP dW2 g^T@h 512x64x2048", (64, 512), (64, 2048), True, False),
    ("enc qkv x@W^T 1024x256x768", (1024, 256), (768, 256), False, True),
    ("enc ff1 x@W^T 1024x256x1024", (1024, 256), (1024, 256), False, True),
    ("enc ff2 h@W^T 1024x1024x256", (1024, 1024), (256, 1024), False, True),
    ("enc dX ff2 g@W 1024x256x1024", (1024, 256), (256, 1024), False, False),
    ("enc dW ff2 g^T@h 256x1024x1024", (1024, 256), (1024, 1024), True, False),
    ("enc dW qkv g^T@x 768x1024x256", (1024, 768), (1024, 256), True, False),
    # A decode step's linear layers (benchmarks/decode.py: one token, M = 1).
    ("decode q x@W^T 1x256x256", (1, 256), (256, 256), False, True),
    ("decode up x@W^T 1x256x1024", (1, 256), (1024, 256), False, True),
    ("decode down x@W^T 1x1024x256", (1, 1024), (256, 1024), False, True),
]

_EIGEN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def _steps(sa, sb, ta, tb) -> tuple[dict[str, Callable[[], Any]], str]:
    import jax
    import jax.numpy as jnp
    import torch

    from dynajax.lowering import transposes
    from dynajax.lowering.registry import get_rule
    from dynajax.runtime.cache import COMPILER_OPTIONS

    torch.manual_seed(0)
    a, b = torch.randn(sa), torch.randn(sb)
    a_op, b_op = (a.t() if ta else a), (b.t() if tb else b)
    rule = get_rule(torch.ops.aten.mm.default)
    assert rule is not None
    t = torch.ops.aten.t.default

    def unfolded(x: Any, y: Any) -> Any:
        return rule.fn(x.T if ta else x, y.T if tb else y)

    def product(x: Any, y: Any) -> Any:
        # As the interpreter runs ``mm(t(x), y)``: the transpose noted, then folded.
        with transposes.tracing():
            xt, yt = (x.T if ta else x), (y.T if tb else y)
            if ta:
                transposes.note(t, (x,), xt)
            if tb:
                transposes.note(t, (y,), yt)
            return rule.fn(xt, yt)

    xa, ya = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
    lowered = jax.jit(product).lower(xa, ya)
    chosen = lowered.compile(compiler_options=dict(COMPILER_OPTIONS))
    plain = jax.jit(unfolded).lower(xa, ya).compile(compiler_options=dict(COMPILER_OPTIONS))
    eigen = lowered.compile(compiler_options={**COMPILER_OPTIONS, **_EIGEN})
    runtime = "ynn" if "__ynn_fusion" in chosen.as_text() else "eigen"
    steps = {
        "eager": lambda: torch.mm(a_op, b_op),
        "dynajax": lambda: chosen(xa, ya).block_until_ready(),
        "unfolded": lambda: plain(xa, ya).block_until_ready(),
        "xla eigen": lambda: eigen(xa, ya).block_until_ready(),
    }
    return steps, runtime


def _time(steps: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in steps}
    for f in steps.values():
        f()
        f()
    keys = list(steps)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(keys)
        for k in keys:
            settle(steps[k])  # the previous peer's threads still spin
            for _ in range(3):
                t0 = time.perf_counter()
                steps[k]()
                times[k].append(time.perf_counter() - t0)
    return times


def _cpu_time(steps: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    times: dict[str, list[float]] = {k: [] for k in steps}
    for f in steps.values():
        f()
        f()
    keys = list(steps)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(keys)
        for k in keys:
            steps[k]()
            c0 = cpu()
            for _ in range(10):
                steps[k]()
            times[k].append((cpu() - c0) / 10)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, help="pin the process to this many CPUs")
    ap.add_argument("--cpu-time", action="store_true", help="CPU time per call, not wall time")
    args = ap.parse_args(argv)
    if args.cpu_time and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        # libgomp reads the policy once, when torch loads it: restart with it set.
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        cmd = [sys.executable, "-m", "benchmarks.matmul", *(sys.argv[1:] if argv is None else argv)]
        os.execve(sys.executable, cmd, env)
    if args.threads:
        # Before torch and jax start their thread pools, which size themselves to the
        # CPUs this process may run on.
        cpus = sorted(os.sched_getaffinity(0))[: args.threads]
        os.sched_setaffinity(0, cpus)
    import jax
    import torch

    what = "CPU µs per call (10-call batches)" if args.cpu_time else "µs per call"
    print(
        f"CPUs {sorted(os.sched_getaffinity(0))}, torch threads {torch.get_num_threads()}, "
        f"jax {jax.__version__}; {args.rounds} rounds, {what}: median (min)"
    )
    head = (
        f"{'product (M x K x N)':32} {'runtime':>7} {'eager':>13} {'dynajax':>13} "
        f"{'unfolded':>13} {'xla eigen':>13} {'dj/eager':>8} {'min':>5}"
    )
    print(head)
    print("-" * len(head))
    for name, sa, sb, ta, tb in SHAPES:
        steps, runtime = _steps(sa, sb, ta, tb)
        times = (_cpu_time if args.cpu_time else _time)(steps, args.rounds)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        low = {k: min(v) * 1e6 for k, v in times.items()}
        cells = " ".join(f"{med[k]:6.0f} ({low[k]:4.0f})" for k in steps)
        print(
            f"{name:32} {runtime:>7} {cells} {med['dynajax'] / med['eager']:8.2f} "
            f"{low['dynajax'] / low['eager']:5.2f}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
