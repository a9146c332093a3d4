"""Measurement: peers, interleaved steady-state timing, cold first calls, memory.

Steady state: every peer's step is built and warmed up, then timed in rounds that
interleave the peers (in a new seeded order each round, so that no peer always follows
the same one), so load from other processes falls on all of them alike; each peer's
time is the median over its samples. A peer's turn starts with untimed calls for at
least ``SETTLE_S``, which outlast the previous peer's threads still spinning (see
time_steady): the numbers are each peer's own steady state. Ratios taken within one
run are the numbers to trust on a shared machine.

First call: each (workload, peer) runs in a fresh process with empty compile caches
(inductor: a new TORCHINDUCTOR_CACHE_DIR, FX graph and autograd caches off; dynajax:
persistent XLA cache off). Both peers first compile an unrelated tiny function, so the
number is the cost of compiling this workload, not of importing a compiler.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from benchmarks.workloads import WORKLOADS, Step, Workload, device

# "dynajax-jax": dynajax with perf_fallbacks=False, every op with a rule in JAX (where
# the default keeps an op measured faster in PyTorch there: capability/cost.py).
# "dynajax-defaults": dynajax with measure_costs=False, the cost choices the defaults
# make (a large CPU attention and the fused encoder layer in PyTorch's kernels): beside
# dynajax-jax, both paths of the choice dynajax measures (the cost-choice rows).
PEERS = ("eager", "inductor", "dynajax", "dynajax-jax", "dynajax-defaults", "jax")

# Untimed calls at the start of each peer's turn, for at least this long: PyTorch's
# OpenMP workers spin for about 4 ms after each parallel op (measured: a 2-core process
# burns 4 ms of CPU in any sleep after an addmm), taking a core from the next peer.
SETTLE_S = 0.01


def settle(step: Callable[[], Any], seconds: float = SETTLE_S) -> None:
    """Untimed calls of ``step`` for at least ``seconds`` (at least one call)."""
    until = time.perf_counter() + seconds
    step()
    while time.perf_counter() < until:
        step()


# -- peers -----------------------------------------------------------------------------


def compile_fn(peer: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The peer's ``compile``, tagged with its name (``.peer``: the train_step rows
    build a whole step per peer, not only a compiled model)."""
    fn = _compile_fn(peer)
    fn.peer = peer  # type: ignore[attr-defined]
    return fn


def _compile_fn(peer: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    if peer == "eager":
        return lambda f: f
    if peer == "inductor":
        return lambda f: torch.compile(_own_code(f, peer))
    if peer == "dynajax-jax":
        import dynajax

        return lambda f: torch.compile(
            _own_code(f, "dynajax_jax"), backend=dynajax.Backend(perf_fallbacks=False)
        )
    if peer == "dynajax-defaults":
        import dynajax

        return lambda f: torch.compile(
            _own_code(f, "dynajax_defaults"), backend=dynajax.Backend(measure_costs=False)
        )
    if peer == "dynajax":
        import dynajax

        def compile_dynajax(f: Callable[..., Any]) -> Callable[..., Any]:
            backend = dynajax.Backend()  # what backend="dynajax" builds, kept for its report
            dynajax_backends.append(backend)
            return torch.compile(_own_code(f, peer), backend=backend)

        return compile_dynajax
    raise ValueError(f"unknown peer {peer!r}")


# Every backend the dynajax peer compiled with, newest last (time_steady summarizes a
# row's from them: graphs, partitions, fallbacks).
dynajax_backends: list[Any] = []


def graph_summary(*backends: Any) -> str:
    """dynajax's graphs, partitions, fallbacks and XLA compiles, in one line."""
    import dynajax

    report = dynajax.Report([g for b in backends for g in b.graphs])
    parts = [len(g.partitions) for g in report.graphs]
    why: dict[str, str] = {}  # each op kept out of JAX, with its first node's reason
    for f in report.fallbacks:
        why.setdefault(str(f.target), f"{f.reason.name}: {f.detail}"[:80])
    fallbacks = "; ".join(f"{op} ({reason})" for op, reason in sorted(why.items()))
    # The choices between XLA and a PyTorch kernel measured at the compile, as timed.
    costs = "".join(f"; cost choice {c.op}: {c.describe()}" for c in report.cost_choices)
    return (
        f"{len(report.graphs)} graph(s), partitions per graph {parts}, "
        f"{report.compile_stats.xla_compiles} XLA compile(s), fallbacks {fallbacks or 'none'}"
        f"{costs}"
    )


_codes = itertools.count()


def _own_code(f: Callable[..., Any], peer: str) -> Callable[..., Any]:
    """``f`` behind a function with a code object of its own.

    Dynamo caches compiled frames on the code object. Peers compiling the same code
    (one lambda, or ``Sequential.forward``) would share a cache: each call would check
    the other backend's entry first, and a ``torch._dynamo.reset()`` for one peer would
    drop the other's. A fresh code object per compile keeps the peers apart.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        return f(*args, **kwargs)

    code = call.__code__.replace(co_name=f"{peer}_{next(_codes)}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def build_step(w: Workload, peer: str) -> Step | None:
    """The step for ``peer``; None where the peer has no version of this workload."""
    if peer == "jax":
        return w.jax_setup() if w.jax_setup is not None else dynajax_lowered_step(w)
    inner = w.setup(compile_fn(peer))
    step = synchronized(in_grad_mode(w, inner))
    if hasattr(inner, "parts"):  # an interleaved row's per-call times, kept by the step
        step.parts = inner.parts  # type: ignore[attr-defined]
    return step


def synchronized(step: Step) -> Step:
    """``step`` that returns once the device has finished its work (on a GPU, kernels run
    after the call returns: a timing without this measures the launches only). The JAX
    floors block on their results themselves; dynajax's outputs are torch tensors over
    XLA's buffers, and a device-wide synchronize waits for XLA's streams too."""
    if device().type != "cuda":
        return step

    def synced() -> Any:
        out = step()
        torch.cuda.synchronize()
        return out

    return synced


def in_grad_mode(w: Workload, step: Step) -> Step:
    """``step`` run in the workload's grad mode (under ``no_grad`` for inference rows)."""
    if not w.no_grad:
        return step

    def no_grad_step() -> Any:
        with torch.no_grad():
            return step()

    return no_grad_step


class Recorder:
    """Stands in for a partition's InputCache once, to capture the tensors of a call and
    the JAX arguments made of them (it sends the call down the regular path)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tensors: list[Any] = []
        self.seen: list[Any] | None = None

    def hit(self, ts: Any) -> None:
        return None  # take the regular path, through ``arrays``

    def hit_guarded(self, ts: Any) -> None:
        return None  # the same from the guarded entry (CompiledPartition.run_guarded)

    def arrays(self, ts: Any) -> list[Any]:
        self.tensors = list(ts)
        out = self.inner.arrays(ts)
        self.seen = list(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def dynajax_lowered_step(w: Workload) -> Step | None:
    """The JAX function dynajax built for ``w``, called on jax.Arrays (no torch edge).

    Only for graphs that are one JAX partition and nothing else; None otherwise.
    """
    import jax
    import jax.numpy as jnp

    import dynajax
    from dynajax.runtime.compiled import CompiledPartition

    backend = dynajax.Backend()
    step = w.setup(lambda f: torch.compile(f, backend=backend))
    ctx = torch.no_grad() if w.no_grad else nullcontext()
    with ctx:
        step()
    parts = []
    for report in backend.graphs:
        gm = report.graph_module
        subs = [m for _, m in gm.named_children() if isinstance(m, CompiledPartition)]
        ops = [
            n for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)
        ]
        if len(subs) != 1 or ops:
            return None
        parts.append(subs[0])
    if len(parts) != 1 or parts[0].needs_seed:
        return None
    part = parts[0]
    part.inputs = recorder = Recorder(part.inputs)
    with ctx:
        step()
    part.inputs = recorder.inner
    with jax.enable_x64(True):
        args = [jnp.array(a) for a in recorder.seen]  # device copies: plain jax.Arrays
    jitted = part.jitted

    def floor() -> Any:
        with jax.enable_x64(True):
            return jax.block_until_ready(jitted(*args))

    return floor


# -- steady state ----------------------------------------------------------------------


def time_steady(
    w: Workload,
    peers: list[str],
    *,
    repeats: int,
    warmup: int,
    budget_s: float,
) -> dict[str, dict[str, Any]]:
    """Median seconds per call for each peer, interleaved; errors are recorded."""
    steps: dict[str, Step] = {}
    results: dict[str, dict[str, Any]] = {}
    firsts: dict[str, Any] = {}
    built = len(dynajax_backends)
    for peer in peers:
        try:
            step = build_step(w, peer)
            if step is None:
                results[peer] = {"status": "n/a"}
                continue
            firsts[peer] = step()
            for _ in range(warmup - 1):
                step()
            steps[peer] = step
            results[peer] = {"status": "ok", "samples": []}
        except Exception as e:  # a peer failing is a result, not a crash of the run
            results[peer] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    if w.no_grad and "eager" in firsts:  # training rows' first steps differ by dropout
        for peer, out in firsts.items():
            if peer != "eager":
                results[peer]["max_abs_diff_vs_eager"] = max_abs_diff(out, firsts["eager"])
    del firsts
    if results.get("dynajax", {}).get("status") == "ok":
        results["dynajax"]["graphs"] = graph_summary(*dynajax_backends[built:])
    order = list(steps)
    shuffle = random.Random(0).shuffle
    start = time.perf_counter()
    gc.collect()
    for r in range(repeats):
        # A new order each round: rotating a fixed order keeps every peer behind the
        # same neighbour (dynajax was always timed right after inductor).
        shuffle(order)
        for peer in order:
            step, samples = steps[peer], results[peer]["samples"]
            # Untimed calls first, for SETTLE_S: PyTorch's OpenMP workers keep spinning
            # after an eager or inductor call and take a core from XLA's threads in the
            # next peer's first calls (the MLP row's JAX floor measured 1.38 ms right
            # after PyTorch's peers against 1.20 ms alone, one untimed call apart).
            settle(step)
            parts = getattr(step, "parts", None)  # an interleaved row's calls, each timed
            for _ in range(w.inner):  # each call timed alone: preemptions stay outliers
                t0 = time.perf_counter()
                step()
                samples.append(time.perf_counter() - t0)
                if parts:
                    kept = results[peer].setdefault("part_samples", {})
                    for k, v in parts.items():
                        kept.setdefault(k, []).append(v[-1])
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    for peer in order:
        s = results[peer]["samples"]
        results[peer]["median_s"] = statistics.median(s)
        results[peer]["p25_s"] = statistics.quantiles(s, n=4)[0] if len(s) > 1 else s[0]
        results[peer]["min_s"] = min(s)
        results[peer]["n"] = len(s)
        del results[peer]["samples"]
        kept = results[peer].pop("part_samples", None)
        if kept:
            results[peer]["parts_median_s"] = {k: statistics.median(v) for k, v in kept.items()}
    if w.memory_calls and "dynajax" in steps:
        results["dynajax"]["memory"] = measure_memory(steps["dynajax"], w.memory_calls)
    return results


def _host_leaves(out: Any) -> list[np.ndarray]:
    """The arrays of a step's result (torch tensors, JAX arrays, nested), on the host."""
    import jax
    from torch.utils import _pytree

    leaves = []
    for leaf in _pytree.tree_leaves(out):
        for x in jax.tree_util.tree_leaves(leaf):
            if isinstance(x, torch.Tensor):  # float64 on the host: NumPy has no bfloat16
                x = x.detach().cpu()
                x = x.double() if x.is_floating_point() else x
            leaves.append(np.asarray(x))
    return leaves


def max_abs_diff(out: Any, expected: Any) -> float | None:
    """The largest absolute difference between two results' arrays (float64); None when
    their structures or shapes differ."""
    a, b = _host_leaves(out), _host_leaves(expected)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return None
    diffs = [
        float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)), initial=0.0))
        for x, y in zip(a, b, strict=True)
    ]
    return max(diffs, default=0.0)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_memory(step: Step, calls: int) -> dict[str, Any]:
    """RSS and live JAX buffers before and after ``calls`` more calls (after 100 warm)."""
    import jax

    for _ in range(100):
        step()
    gc.collect()
    rss0, live0 = _rss_bytes(), len(jax.live_arrays())
    for _ in range(calls):
        step()
    gc.collect()
    rss1, live1 = _rss_bytes(), len(jax.live_arrays())
    return {
        "calls": calls,
        "rss_before_mib": rss0 / 2**20,
        "rss_after_mib": rss1 / 2**20,
        "rss_delta_mib": (rss1 - rss0) / 2**20,
        "live_arrays_before": live0,
        "live_arrays_after": live1,
        "flat": live1 <= live0 and (rss1 - rss0) < 2 * 2**20,
    }


# -- first call (one fresh process per workload and peer) -------------------------------


def _warm_compiler(peer: str) -> None:
    """Compile and run an unrelated tiny function: imports and backend init paid."""
    if peer == "jax":
        import jax
        import jax.numpy as jnp

        jax.jit(lambda a: a * 3 - 1)(jnp.ones((3, 5))).block_until_ready()
        return
    f = compile_fn(peer)(lambda a: a * 3 - 1)
    f(torch.ones(3, 5, device=device()))
    torch._dynamo.reset()


def first_call_worker(name: str, peer: str) -> dict[str, Any]:
    """Runs in the child process: seconds of the first and second call."""
    w = WORKLOADS[name]
    _warm_compiler(peer)
    t0 = time.perf_counter()
    step = build_step(w, peer) if peer != "jax" or w.jax_setup else None
    if step is None:
        return {"status": "n/a"}
    ctx = torch.no_grad() if w.no_grad else nullcontext()
    with ctx:
        t1 = time.perf_counter()
        step()
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
    return {
        "status": "ok",
        "setup_s": t1 - t0,
        "first_s": t2 - t1,
        "second_s": t3 - t2,
    }


def time_first_call(name: str, peer: str, timeout_s: float = 900) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dynajax-bench-") as tmp:
        env = dict(os.environ)
        env.update(
            TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
            TORCHINDUCTOR_FX_GRAPH_CACHE="0",
            TORCHINDUCTOR_AUTOGRAD_CACHE="0",
            DYNAJAX_CACHE_DIR="",
            JAX_ENABLE_COMPILATION_CACHE="false",
            TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
        )
        cmd = [sys.executable, "-m", "benchmarks.run", "--first-call-worker", name, peer]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"timed out after {timeout_s}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"status": "error", "error": proc.stderr.strip()[-500:]}
    return json.loads(lines[-1])
