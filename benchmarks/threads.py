"""The compute threads of a benchmark run (``--threads``): ``benchmarks/run.py`` and
``benchmarks/decode.py`` set them here (``benchmarks.run.set_threads`` is this one)."""

from __future__ import annotations

import os
import sys


def set_threads(n: int) -> None:
    """Thread counts for torch and XLA; call before JAX creates its CPU client."""
    import torch

    os.environ["DYNAJAX_BENCH_THREADS"] = str(n)  # inherited by first-call workers
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    if n == 1 and "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        ).strip()
