"""Where a benchmark row's time goes, per peer: host time, device kernels, transfers.

    python -m benchmarks.profile --device cuda                     # every row
    python -m benchmarks.profile --device cuda --workloads mlp,gpt2 --steps 20

For each row of ``benchmarks/workloads.py`` and each peer (inductor and dynajax by
default), the step is built, warmed up, and run ``--steps`` times under
``torch.profiler`` (CPU and, on a GPU, CUDA activities: CUPTI records every kernel of
the process, XLA's as well as PyTorch's). Per step it prints the wall time, the
kernels launched and their summed time, the host/device copies (a device-to-host copy
is a synchronization), and the kernels that take the most time. A peer whose wall time
is far above its kernel time is bound by the host (dispatch, conversions, syncs); one
whose kernel time is high runs slow code on the device. dynajax's graph summary
(graphs, partitions, fallbacks) follows each row.

On the CPU there are no kernels to record: the rows show the wall time and PyTorch's
host-side operators that take the most time.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Any

from benchmarks import harness
from benchmarks.workloads import DEVICE_ENV, WORKLOADS, default_rows, device


def profile_step(
    step: harness.Step, steps: int, top: int = 5, trace: str | None = None
) -> dict[str, Any]:
    """``steps`` calls of ``step`` under the profiler: per-step figures and top kernels;
    with ``trace``, the profile as a Chrome trace at that path (chrome://tracing,
    Perfetto)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device().type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) / steps
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.events()
    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    copies = [e for e in on_device if "memcpy" in e.name.lower()]
    kernels = [e for e in on_device if "memcpy" not in e.name.lower()]
    by_name: dict[str, float] = collections.defaultdict(float)
    for e in kernels if on_gpu else [e for e in events if e.device_type == DeviceType.CPU]:
        by_name[e.name] += e.time_range.elapsed_us() if on_gpu else e.self_cpu_time_total
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "wall_us": wall * 1e6,
        "kernels": len(kernels) / steps,
        "kernel_us": sum(e.time_range.elapsed_us() for e in kernels) / steps,
        "copies": collections.Counter(e.name for e in copies),
        "copy_us": sum(e.time_range.elapsed_us() for e in copies) / steps,
        "top": [(name[:90], us / steps) for name, us in ranked],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument("--workloads", help="comma-separated rows (default: all)")
    p.add_argument("--peers", default="inductor,dynajax")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=10, help="profiled steps per peer")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--trace-dir", help="also write each (row, peer) profile as a Chrome trace here")
    args = p.parse_args(argv)
    os.environ[DEVICE_ENV] = args.device
    names = args.workloads.split(",") if args.workloads else default_rows()
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    what = "kernels" if args.device == "cuda" else "host operators (self time)"
    print(f"{args.steps} profiled steps per peer on {args.device}; per step, the top {what}:")
    for name in names:
        w = WORKLOADS[name]
        for peer in args.peers.split(","):
            built = len(harness.dynajax_backends)
            try:
                step = harness.build_step(w, peer)
                if step is None:
                    continue
                for _ in range(args.warmup):
                    step()
                trace = None
                if args.trace_dir:
                    os.makedirs(args.trace_dir, exist_ok=True)
                    trace = os.path.join(args.trace_dir, f"{name}.{peer}.json")
                r = profile_step(step, args.steps, trace=trace)
            except Exception as e:  # a peer failing is a result
                print(f"\n{name} / {peer}: {type(e).__name__}: {e}"[:500])
                continue
            print(
                f"\n{name} / {peer}: wall {r['wall_us']:.1f} µs, {r['kernels']:.1f} kernels "
                f"{r['kernel_us']:.1f} µs, copies {dict(r['copies']) or 'none'} "
                f"{r['copy_us']:.1f} µs"
            )
            for kname, us in r["top"]:
                print(f"    {us:9.1f} µs  {kname}")
            if peer == "dynajax":
                print(f"    dynajax: {harness.graph_summary(*harness.dynajax_backends[built:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
