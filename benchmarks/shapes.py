"""Changing shapes: XLA compiles and per-call time over batch sizes 1..64, with and
without power-of-two buckets; and the per-call cost of the AOT executable dynajax
calls against ``jax.jit``'s own dispatch.

    python -m benchmarks.shapes                 # MLP and encoder layer, sizes 1..64
    python -m benchmarks.shapes --max-batch 16 --rounds 3

Every figure of one run is measured in the same process, side by side (the machine is
shared: compare ratios, not absolute times). The persistent cache is off here, so every
executable is an XLA compile.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _models() -> dict[str, tuple[torch.nn.Module, Callable[[int], torch.Tensor]]]:
    from tests.models import mlp

    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).eval()
    return {
        "mlp": (mlp().eval(), lambda b: torch.randn(b, 32)),
        "encoder": (enc, lambda b: torch.randn(b, 16, 64)),
    }


def _per_call(f: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls


def sweep(max_batch: int, rounds: int) -> list[dict[str, Any]]:
    import dynajax

    rows = []
    for name, (model, make) in _models().items():
        inputs = {b: make(b) for b in range(1, max_batch + 1)}
        peers: dict[str, Callable[[torch.Tensor], Any]] = {"eager": model}
        backends = {}
        torch._dynamo.reset()
        for label, pad in (("exact", False), ("buckets", True)):
            backend = dynajax.Backend(
                cache_dir="", pad_to_buckets=pad, max_executables=max_batch + 1
            )
            backends[label] = backend
            # a copy per policy: Dynamo keeps both compiled versions side by side
            peers[label] = torch.compile(copy.deepcopy(model), backend=backend)
            first = time.perf_counter()
            with torch.no_grad():
                for b in range(1, max_batch + 1):  # the first pass compiles
                    peers[label](inputs[b])
            backend.first_pass_s = time.perf_counter() - first  # type: ignore[attr-defined]
        # Steady state, peers interleaved round by round.
        times: dict[str, list[float]] = {p: [] for p in peers}
        with torch.no_grad():
            for _ in range(rounds):
                for peer, f in peers.items():
                    per = [_per_call(lambda f=f, x=x: f(x), 5) for x in inputs.values()]
                    times[peer].append(statistics.mean(per))
        for label, backend in backends.items():
            stats = dynajax.Report(backend.graphs).compile_stats
            rows.append(
                {
                    "model": name,
                    "policy": label,
                    "xla_compiles": stats.xla_compiles,
                    "graphs": len(backend.graphs),
                    "first_pass_s": backend.first_pass_s,  # type: ignore[attr-defined]
                    "per_call_s": min(times[label]),
                    "eager_per_call_s": min(times["eager"]),
                    "buckets": stats.buckets,
                    "exact": stats.exact,
                }
            )
    return rows


def dispatch(rounds: int) -> list[dict[str, Any]]:
    """One dynajax partition called through its AOT executable vs through jax.jit."""
    import dynajax
    from dynajax.runtime.compiled import CompiledPartition

    cases = {
        "add-one (1 input)": (lambda x: x + 1, [torch.zeros(1)]),
        "sum of 100 inputs": (
            lambda *xs: sum(xs[1:], xs[0]),
            [torch.full((4,), float(i)) for i in range(100)],
        ),
    }
    rows = []
    for name, (fn, args) in cases.items():
        torch._dynamo.reset()
        backend = dynajax.Backend(cache_dir="")
        f = torch.compile(fn, backend=backend)
        f(*args)
        [part] = [
            m for m in backend.graphs[0].graph_module.children() if isinstance(m, CompiledPartition)
        ]
        aot = part.dispatch
        jitted = part.jitted
        f(*args)
        part.dispatch = jitted
        f(*args)  # jit compiles its own executable here
        samples: dict[str, list[float]] = {"aot": [], "jit": []}
        for _ in range(rounds):
            for label, call in (("aot", aot), ("jit", jitted)):
                part.dispatch = call
                samples[label].append(_per_call(lambda f=f, a=args: f(*a), 2000))
        part.dispatch = aot
        rows.append(
            {
                "case": name,
                "aot_s": statistics.median(samples["aot"]),
                "jit_s": statistics.median(samples["jit"]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-dispatch", action="store_true")
    args = parser.parse_args()

    print(f"batch sizes 1..{args.max_batch}, one call each (first pass compiles)")
    print(
        f"{'model':<8} {'policy':<8} {'XLA compiles':>12} {'graphs':>6} {'first pass':>11} "
        f"{'per call':>10} {'eager':>10} {'vs eager':>8}"
    )
    for r in sweep(args.max_batch, args.rounds):
        print(
            f"{r['model']:<8} {r['policy']:<8} {r['xla_compiles']:>12} {r['graphs']:>6} "
            f"{r['first_pass_s']:>10.2f}s {r['per_call_s'] * 1e6:>8.1f}µs "
            f"{r['eager_per_call_s'] * 1e6:>8.1f}µs "
            f"{r['per_call_s'] / r['eager_per_call_s']:>7.2f}x"
        )
        for b in r["buckets"]:
            print(f"{'':<18}padded: {b}")
        for e in r["exact"]:
            print(f"{'':<18}not padded: {e}")
    if not args.skip_dispatch:
        print("\nper-call dispatch of one partition (medians, µs): AOT executable vs jax.jit")
        for r in dispatch(max(args.rounds * 3, 5)):
            print(
                f"  {r['case']:<20} aot {r['aot_s'] * 1e6:7.2f}  jit {r['jit_s'] * 1e6:7.2f}"
                f"  aot/jit {r['aot_s'] / r['jit_s']:.2f}"
            )


if __name__ == "__main__":
    main()
