"""The first call in a second process against the first call in a cold process.

    python -m benchmarks.cold_start                      # mlp, encoder, gpt2
    python -m benchmarks.cold_start --workloads encoder --repeats 3

For each workload, pairs of fresh processes run one after the other: the first against
an empty cache directory (cold: trace, lower, XLA compile, store), the second against
the directory the first filled (warm: trace, lower, load). Each process times its first
call (imports excluded) and splits it: dynajax's graph work (``compile_aten_graph``),
tracing and lowering the partitions to StableHLO (with the cache key), getting the
executables (XLA compile + store when cold, load when warm), and the rest, which is
torch's (Dynamo, aot_autograd) plus the run itself. The target is warm/cold <= 0.3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _workload(name: str):
    import torch

    from tests.models import gpt2, mlp, tokens

    torch.manual_seed(0)
    if name == "mlp":
        return mlp().eval(), (torch.randn(8, 32),)
    if name == "encoder":
        enc = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        return enc.eval(), (torch.randn(8, 16, 64),)
    if name == "gpt2":
        return gpt2().eval(), (tokens(2, 32),)
    raise SystemExit(f"unknown workload {name!r}")


def _timed(owner: type, attr: str, spent: dict[str, float], key: str) -> None:
    original = getattr(owner, attr)

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent[key] += time.perf_counter() - start

    setattr(owner, attr, timed)


def child(name: str) -> None:
    import torch

    import dynajax
    from dynajax.runtime import cache, executables

    model, args = _workload(name)
    spent = {"aten_s": 0.0, "lower_s": 0.0, "xla_s": 0.0}
    _timed(dynajax.Backend, "compile_aten_graph", spent, "aten_s")
    _timed(executables.Executables, "compile", spent, "lower_s")
    _timed(cache.ExecutableCache, "compile", spent, "xla_s")
    backend = dynajax.Backend()
    f = torch.compile(model, backend=backend)
    with torch.no_grad():
        start = time.perf_counter()
        f(*args)
        first = time.perf_counter() - start
    stats = dynajax.Report(backend.graphs).compile_stats
    spent["lower_s"] -= spent["xla_s"]  # trace + lower + key, without compile/load
    print(
        json.dumps(
            {
                "first_s": first,
                **spent,
                "xla_compiles": stats.xla_compiles,
                "cache_hits": stats.cache_hits,
            }
        )
    )


def _run(name: str, cache_dir: str) -> dict:
    env = dict(os.environ, DYNAJAX_CACHE_DIR=cache_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cold_start", "--child", name],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,encoder,gpt2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    print(
        "first call = torch (Dynamo, aot_autograd, the run) + dynajax graph work (passes,\n"
        "capability, partition) + trace/lower/key + executables (XLA compile+store, or load)\n"
    )
    head = f"{'workload':<9} {'':<5} {'first call':>10} {'torch':>7} {'dynajax':>7} "
    print(head + f"{'lower':>7} {'xla':>7}   compiles, hits")
    for name in args.workloads.split(","):
        ratios, colds, warms = [], [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                cold = _run(name, d)
                warm = _run(name, d)
            colds.append(cold)
            warms.append(warm)
            ratios.append(warm["first_s"] / cold["first_s"])
        for label, runs in (("cold", colds), ("warm", warms)):
            r = min(runs, key=lambda r: r["first_s"])
            torch_s = r["first_s"] - r["aten_s"] - r["lower_s"] - r["xla_s"]
            print(
                f"{name:<9} {label:<5} {r['first_s']:>9.2f}s {torch_s:>6.2f}s "
                f"{r['aten_s']:>6.2f}s {r['lower_s']:>6.2f}s {r['xla_s']:>6.2f}s   "
                f"{r['xla_compiles']}, {r['cache_hits']}"
            )
        print(
            f"{name:<9} warm/cold first call: {statistics.median(ratios):.2f} "
            f"(median of {args.repeats} pairs; target <= 0.3)"
        )


if __name__ == "__main__":
    main()
