"""The first call in a second process against the first call in a cold process,
dynajax and inductor side by side.

    python -m benchmarks.cold_start                          # the model and training rows
    python -m benchmarks.cold_start --workloads gpt2,mlp-train --repeats 3
    python -m benchmarks.cold_start --peers dynajax          # without inductor

For each workload of ``benchmarks.workloads`` (the ``model`` and ``training`` rows by
default) and each peer, pairs of fresh processes run one after the other: the first
against empty cache directories (cold), the second against the directories the first
filled (warm). dynajax's cache is ``DYNAJAX_CACHE_DIR``; inductor's is
``TORCHINDUCTOR_CACHE_DIR`` (its FX graph cache and AOT-autograd cache, both on by
default). Each process times the workload's first step (a forward call for model
rows; forward, backward and optimizer step for training rows), imports and model
construction excluded, and then its second step. On the ``*-train-step`` rows dynajax
runs ``dynajax.train_step`` (the peers, their compiled model and fused AdamW); both
steps are shown (an optimizer whose first step computes its state, SGD's momentum,
compiles a second program at the second step).
dynajax's first step is split into:

    dynamo    Dynamo's trace and guards, and the step itself (first - the rest)
    aot       aot_autograd (its tracing, functionalization, min-cut partition), or
              loading its stored graph (an inference graph, warm: aot/cache.py)
    dynajax   dynajax's graph work: passes, capability verdicts, partitioning
    lower     tracing partitions through the rule table and lowering to StableHLO
              (none on a warm hit: executables are found by their program)
    xla       XLA compile and store (cold), or loading the executable (warm)

and, on the ``*-train-step`` rows: aot = the step's trace (the first trace of
``training/graph.py``, which keys its program), dynajax = functionalization, passes and
verdicts, lower = the JAX trace and lowering (none on a warm hit), xla as above.

The ratios are medians over the pairs; warm/cold is per peer, and the last column is
dynajax's warm first step over inductor's. Targets: dynajax warm/cold <= 0.3,
and dynajax's warm first step below inductor's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _timed(owner: object, attr: str, spent: dict[str, float], key: str) -> None:
    """Adds the time of every call of ``owner.attr`` to ``spent[key]``; while it runs,
    ``spent["inside_" + key]`` is 1 (so nested timers can tell where they are)."""
    original = getattr(owner, attr)
    inside = "inside_" + key

    def timed(*a, **k):
        start = time.perf_counter()
        spent[inside] = spent.get(inside, 0) + 1
        try:
            return original(*a, **k)
        finally:
            spent[inside] -= 1
            took = time.perf_counter() - start
            spent[key] += took
            if key in ("aten_s", "xla_s") and spent.get("inside_aot_s"):
                spent[key.replace("_s", "_in_aot_s")] += took

    static = isinstance(inspect.getattr_static(owner, attr), staticmethod)
    setattr(owner, attr, staticmethod(timed) if static else timed)


def child(name: str, peer: str) -> None:
    import torch

    from benchmarks.workloads import WORKLOADS

    workload = WORKLOADS[name]
    spent = {
        "aot_s": 0.0,
        "aten_s": 0.0,
        "aten_in_aot_s": 0.0,
        "exe_s": 0.0,
        "xla_s": 0.0,
        "xla_in_aot_s": 0.0,
    }
    steps: list = []  # the train_steps made (the *-train-step rows)
    if peer == "dynajax":
        import dynajax
        import dynajax.backend
        from dynajax.runtime import cache, executables
        from dynajax.training import graph as step_graph
        from dynajax.training import program as train

        _timed(dynajax.backend, "aot_compile", spent, "aot_s")
        _timed(dynajax.Backend, "compile_aten_graph", spent, "aten_s")
        _timed(executables.Executables, "compile", spent, "exe_s")
        for attr in ("_compile", "_load", "_store"):
            _timed(cache.ExecutableCache, attr, spent, "xla_s")
        # train_step: its trace (in the aot column), functionalization, passes and
        # verdicts (dynajax), the JAX trace and lowering (lower), XLA (xla).
        _timed(train, "trace_step", spent, "aot_s")
        _timed(step_graph.StepGraph, "functional", spent, "aten_s")
        _timed(train, "lower", spent, "aten_s")
        _timed(train.StepPrograms, "_compile", spent, "exe_s")
        made = dynajax.train_step

        def train_step(*a, **k):
            steps.append(made(*a, **k))
            return steps[-1]

        dynajax.train_step = train_step
        backend = dynajax.Backend()

        def compile(m):
            return torch.compile(m, backend=backend)
    else:

        def compile(m):
            return torch.compile(m, backend="inductor")

    compile.peer = peer  # (the *-train-step rows run dynajax.train_step for dynajax)
    with torch.no_grad() if workload.no_grad else torch.enable_grad():
        step = workload.setup(compile)
        start = time.perf_counter()
        step()
        first = time.perf_counter() - start
        spent = dict(spent)  # (the split of the first step)
        start = time.perf_counter()
        step()
        second = time.perf_counter() - start
    result = {"first_s": first, "second_s": second}
    if peer == "dynajax":
        stats = dynajax.Report(backend.graphs).compile_stats
        for made_step in steps:
            stats += made_step.compile_stats
        # aot_compile's time includes the forward (or inference) graph's
        # compile_aten_graph; a backward's runs later, inside the first backward call.
        # Executables compile at a partition's first call, after aot_compile returned.
        # A train_step's trace loads its program where it finds it (``at_update``): that
        # load is XLA's time, not the trace's.
        aot = spent["aot_s"] - spent["aten_in_aot_s"] - spent["xla_in_aot_s"]
        lower = spent["exe_s"] - spent["xla_s"]
        if steps:
            lower -= aot + spent["aten_s"]
        result.update(
            aot_s=aot,
            aten_s=spent["aten_s"],
            lower_s=lower,
            xla_s=spent["xla_s"],
            xla_compiles=stats.xla_compiles,
            cache_hits=stats.cache_hits,
        )
    print(json.dumps(result))


def _run(name: str, peer: str, cache_dir: str) -> dict:
    env = dict(
        os.environ,
        DYNAJAX_CACHE_DIR=os.path.join(cache_dir, "dynajax"),
        TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cold_start", "--child", name, "--peers", peer],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from benchmarks.workloads import WORKLOADS, default_rows

    rows = [n for n in default_rows() if WORKLOADS[n].group in ("model", "training")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(rows))
    parser.add_argument("--peers", default="dynajax,inductor")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.peers)
    peers = args.peers.split(",")
    print(
        "first step (s); dynajax's split: dynamo (trace, guards, the step) + aot (aot_autograd)\n"
        "+ dynajax (passes, verdicts, partitions) + lower (trace+lower) + xla (compile or load)\n"
    )
    print(
        f"{'workload':<19} {'peer':<8} {'cold':>7} {'warm':>7} {'warm/cold':>9} "
        f"{'2nd cold':>8} {'2nd warm':>8}   "
        f"{'warm split: dynamo':>18} {'aot':>6} {'dynajax':>7} {'lower':>6} {'xla':>6}"
    )
    summary = []
    for name in args.workloads.split(","):
        runs: dict[str, list[tuple[dict, dict]]] = {p: [] for p in peers}
        for _ in range(args.repeats):
            for peer in peers:  # interleaved: one pair of each peer per repeat
                with tempfile.TemporaryDirectory() as d:
                    runs[peer].append((_run(name, peer, d), _run(name, peer, d)))
        warm_first = {}
        for peer in peers:
            pairs = runs[peer]
            cold = statistics.median(c["first_s"] for c, _ in pairs)
            warm = statistics.median(w["first_s"] for _, w in pairs)
            ratio = statistics.median(w["first_s"] / c["first_s"] for c, w in pairs)
            warm_first[peer] = warm
            second_cold = statistics.median(c["second_s"] for c, _ in pairs)
            second_warm = statistics.median(w["second_s"] for _, w in pairs)
            line = (
                f"{name:<19} {peer:<8} {cold:>7.2f} {warm:>7.2f} {ratio:>9.2f} "
                f"{second_cold:>8.2f} {second_warm:>8.2f}"
            )
            if peer == "dynajax":
                w = min((w for _, w in pairs), key=lambda r: r["first_s"])
                dynamo = w["first_s"] - w["aot_s"] - w["aten_s"] - w["lower_s"] - w["xla_s"]
                line += (
                    f"   {dynamo:>18.2f} {w['aot_s']:>6.2f} {w['aten_s']:>7.2f} "
                    f"{w['lower_s']:>6.2f} {w['xla_s']:>6.2f}   "
                    f"(warm: {w['xla_compiles']} compiles, {w['cache_hits']} hits)"
                )
            print(line, flush=True)
        if {"dynajax", "inductor"} <= set(peers):
            vs = warm_first["dynajax"] / warm_first["inductor"]
            summary.append((name, vs))
            print(f"{name:<19} dynajax warm / inductor warm: {vs:.2f}", flush=True)
    if summary:
        print("\ndynajax warm first step / inductor warm first step:")
        for name, vs in summary:
            print(f"  {name:<19} {vs:.2f}")


if __name__ == "__main__":
    main()
