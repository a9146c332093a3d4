"""Peak host memory of the training-step rows, each peer in a fresh process.

    python -m benchmarks.memory                  # every *-train-step row: eager, inductor, dynajax
    python -m benchmarks.memory --docs           # also docs/memory.json and the guide's table
    python -m benchmarks.memory --rows deep-mlp-train-step,deep-mlp-checkpointed-train-step

Each (row, peer) runs twice in a fresh process with one cache directory: the first
fills the persistent caches (dynajax's executables, inductor's code), the second is
measured, so that the compilers' caches are warm (``train_step`` traces its step in
every process and loads its programs from the persistent cache). It runs three steps
and reports the process's peak resident set (``VmHWM``) up to the end of the second
step (the libraries, the model, its state, the compiles: AdamW has no state before its
first step, so ``train_step``'s second step runs a second program) and during the
third, a steady step (everything the process holds at the worst moment of a step:
parameters, optimizer state, gradients a loop keeps, activations, the runtimes).
glibc is told to map every allocation of 128 KiB or more on its own
(``MALLOC_MMAP_THRESHOLD_``), so that memory freed returns to the system and the
resident set follows the memory in use; else the heap keeps the first steps' pages.
The peers are the rows' own: eager and inductor with torch's fused AdamW, dynajax with
``dynajax.train_step`` (``benchmarks/training.py``).

With ``--device cuda`` the rows run on the GPU and each also reports its device peak
(``device_peak``, over the three steps): PyTorch's allocator's peak
(``torch.cuda.max_memory_allocated``) plus, for dynajax, JAX's (``peak_bytes_in_use``
of each GPU: the step's state and programs live there), a bound on the two allocators'
peak together.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ROWS = (
    "mlp-train-step",
    "encoder-train-step",
    "resnet18-train-step",
    "gpt2-train-step",
    "deep-mlp-train-step",
    "deep-mlp-checkpointed-train-step",
    "gpt2-124m-train-step",
)
PEERS = ("eager", "inductor", "dynajax")
MMAP_THRESHOLD = "131072"


def reset_peak() -> None:
    """Sets the process's peak resident set (VmHWM) to its current one (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    """The process's peak resident set since it started or since ``reset_peak``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def device_peak_bytes(peer: str) -> int:
    """The GPU memory the process's allocators held at most: PyTorch's, and JAX's where
    the peer keeps state in JAX (dynajax)."""
    import torch

    peak = torch.cuda.max_memory_allocated()
    if peer.startswith("dynajax"):
        import jax

        for d in jax.devices("gpu"):
            peak += (d.memory_stats() or {}).get("peak_bytes_in_use", 0)
    return peak


def worker(row: str, peer: str) -> dict[str, int]:
    """Three steps of ``row`` by ``peer`` in this process: the peak resident set up to
    the end of the second step (what the process is built with, compiles included) and
    during the third (a steady step: what the process holds at its worst moment); on a
    GPU, the device's peak too."""
    import dynajax  # noqa: F401  (first: its process settings, as the benchmark's rows)
    from benchmarks.harness import compile_fn
    from benchmarks.workloads import WORKLOADS, device

    step = WORKLOADS[row].setup(compile_fn(peer))
    step()
    step()
    gc.collect()
    first = peak_bytes()
    reset_peak()
    step()
    out = {"first": first, "steady": peak_bytes()}
    if device().type == "cuda":
        out["device_peak"] = device_peak_bytes(peer)
    return out


def measure(row: str, peer: str, cache: str) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD, PYTHONPATH=str(ROOT))
    env["DYNAJAX_CACHE_DIR"] = os.path.join(cache, "dynajax")
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    out: dict[str, Any] = {}
    for _ in range(2):  # the first fills the caches; the second is measured
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory", "--worker", row, peer],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=1200,
        )
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
        out = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--docs", action="store_true", help="write docs/memory.json and the table")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where the rows run (default cpu)")
    p.add_argument("--worker", nargs=2, metavar=("ROW", "PEER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    if args.device:  # an environment variable: the workers inherit it
        from benchmarks.workloads import DEVICE_ENV

        os.environ[DEVICE_ENV] = args.device
    rows, peers = args.rows.split(","), args.peers.split(",")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as cache:
        for row in rows:
            results[row] = {}
            for peer in peers:
                results[row][peer] = r = measure(row, peer, cache)
                shown = r.get("error") or (
                    f"first steps {r['first'] / 2**20:8.1f} MiB, "
                    f"steady {r['steady'] / 2**20:8.1f} MiB"
                    + (
                        f", device peak {r['device_peak'] / 2**20:8.1f} MiB"
                        if "device_peak" in r
                        else ""
                    )
                )
                print(f"{row:<34} {peer:<9} {shown}", flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.memory " + " ".join(argv or sys.argv[1:]),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "malloc_mmap_threshold": MMAP_THRESHOLD,
        "device": args.device or "cpu",
    }
    data = {"meta": meta, "rows": results}
    if args.docs:
        from benchmarks import figures

        figures.FIGURES["memory"].source.write_text(json.dumps(data, indent=1) + "\n")
        figures.update(plots=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
