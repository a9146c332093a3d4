"""Compiled calls interleaved with eager PyTorch calls, under thread settings.

    python -m benchmarks.pools                     # every setting, MLP, fresh process each
    python -m benchmarks.pools --settings default,omp-passive --calls 200

XLA's CPU thread pool and PyTorch's OpenMP pool share the machine's cores. After its
work each pool's threads may keep spinning, taking a core from the other side's next
call. This measures, for one setting at a time in a fresh process (thread settings are
read when each library starts): the MLP 512-2048-512 (batch 64, ``torch.no_grad()``)
compiled by dynajax and by inductor, each call alone and interleaved with an eager call
of another MLP of the same size, medians over ``--calls`` calls per figure, the peers
in alternating blocks; and how much CPU the process burns in the 20 ms after a call
(a pool spinning for work). Settings (``SETTINGS``) are environment variables set
before torch and JAX start, and torch's thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# name -> (environment, torch threads or None)
SETTINGS: dict[str, tuple[dict[str, str], int | None]] = {
    "default": ({}, None),
    "omp-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, None),
    "xla-1-thread-eigen": ({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}, None),
    "both": (
        {"OMP_WAIT_POLICY": "PASSIVE", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"},
        None,
    ),
    "gomp-spin-10k": ({"GOMP_SPINCOUNT": "10000"}, None),
    "torch-1-thread": ({}, 1),
}


def _worker(calls: int, threads: int | None) -> dict[str, float]:
    import torch

    if threads:
        torch.set_num_threads(threads)
    import dynajax
    from benchmarks.harness import _own_code
    from benchmarks.workloads import mlp_model

    torch.manual_seed(0)
    model, (x,) = mlp_model()
    other, (y,) = mlp_model()
    model.eval(), other.eval()
    backend = dynajax.Backend(cache_dir="")
    peers = {
        "dynajax": torch.compile(_own_code(model, "dynajax"), backend=backend),
        "inductor": torch.compile(_own_code(model, "inductor")),
        "eager": model,
    }
    clock = time.perf_counter
    samples: dict[str, list[float]] = {}
    with torch.no_grad():
        for f in peers.values():
            for _ in range(10):
                f(x)
        for block in range(6):
            for peer, f in peers.items() if block % 2 == 0 else reversed(peers.items()):
                alone = samples.setdefault(f"{peer} alone", [])
                for _ in range(calls // 6):
                    t0 = clock()
                    f(x)
                    alone.append(clock() - t0)
                if peer == "eager":
                    continue
                comp = samples.setdefault(f"{peer} interleaved", [])
                eag = samples.setdefault(f"eager after {peer}", [])
                for _ in range(calls // 6):
                    t0 = clock()
                    f(x)
                    t1 = clock()
                    other(y)
                    t2 = clock()
                    comp.append(t1 - t0)
                    eag.append(t2 - t1)
        # What each pool does after a call: the process's CPU time during 20 ms of
        # sleep right after it (a spinning pool burns it; a sleeping one does not).
        for peer, f in peers.items():
            spent = samples.setdefault(f"{peer} spin", [])
            for _ in range(15):
                f(x)
                c0 = _cpu_seconds()
                time.sleep(0.02)
                spent.append(_cpu_seconds() - c0)
    return {k: statistics.median(v) for k, v in samples.items()}


def _cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(setting: str, calls: int) -> dict[str, float]:
    env_vars, threads = SETTINGS[setting]
    env = {**os.environ, **env_vars}
    code = (
        "import json, sys; from benchmarks.pools import _worker; "
        f"print(json.dumps(_worker({calls}, {threads!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(f"{setting}: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pools", description=__doc__)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--calls", type=int, default=300, help="calls per figure")
    args = p.parse_args(argv)
    print(f"load average at start: {os.getloadavg()}, cpus: {os.cpu_count()}")
    head = ["setting", "dj alone", "dj inter", "eager after dj", "dj sum"]
    head += ["ind alone", "ind inter", "eager after ind", "ind sum", "sum dj/ind"]
    head += ["eager alone", "spin after eager", "spin after dj"]
    rows: list[list[str]] = [head]
    for setting in args.settings.split(","):
        r: dict[str, Any] = run(setting, args.calls)
        ms = {k: v * 1e3 for k, v in r.items()}
        dj = ms["dynajax interleaved"] + ms["eager after dynajax"]
        ind = ms["inductor interleaved"] + ms["eager after inductor"]
        rows.append(
            [
                setting,
                *(
                    f"{ms[k]:.2f}"
                    for k in ("dynajax alone", "dynajax interleaved", "eager after dynajax")
                ),
                f"{dj:.2f}",
                *(
                    f"{ms[k]:.2f}"
                    for k in ("inductor alone", "inductor interleaved", "eager after inductor")
                ),
                f"{ind:.2f}",
                f"{dj / ind:.2f}",
                f"{ms['eager alone']:.2f}",
                f"{ms['eager spin']:.2f}",
                f"{ms['dynajax spin']:.2f}",
            ]
        )
        print(f"{setting}: done", flush=True)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    print("\nms per call, medians; spin: ms of CPU the process used in the 20 ms after a call")
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
