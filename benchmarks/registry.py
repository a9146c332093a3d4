"""The benchmark's row registry, ``WORKLOADS``, and the device its rows run on.

The ``Workload`` type, ``register`` and ``WORKLOADS`` live here so that both modules
that register rows, ``benchmarks/workloads.py`` (the overhead, model and interleaved
rows) and ``benchmarks/training.py`` (the training rows, imported at the end of
``workloads.py``), import them from below; readers import ``WORKLOADS`` from
``benchmarks.workloads``, which holds every row once imported.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Compile = Callable[[Callable[..., Any]], Callable[..., Any]]
Step = Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark row.

    Attributes:
        name: row id (``--workloads`` selects by it).
        group: "overhead", "model" or "training".
        setup: ``setup(compile) -> step``; builds model and inputs (seeded), compiles
            with the peer's ``compile``, returns the zero-argument step to time.
        jax_setup: ``() -> step`` of a hand-written raw ``jax.jit`` floor, or None to use
            the function dynajax lowered (fed ``jax.Array``s directly).
        description: one line for the table's legend.
        quick: part of ``--quick``.
        inner: calls per peer per round, each timed alone (many for µs-scale rows).
        memory_calls: if > 0, run that many more calls and report RSS and live JAX
            buffers before and after (must stay flat).
        no_grad: run the step under ``torch.no_grad()`` (inference rows).
        default: part of a run that names no rows (False: a row too heavy for every run,
            run where named, as ``benchmarks.memory`` names its large model).
        size_of: for a row of the grid (``--grid``), the model row it is another size of.
    """

    name: str
    group: str
    setup: Callable[[Compile], Step]
    jax_setup: Callable[[], Step] | None = None
    description: str = ""
    quick: bool = False
    inner: int = 1
    memory_calls: int = 0
    no_grad: bool = True
    default: bool = True
    size_of: str = ""


WORKLOADS: dict[str, Workload] = {}


def default_rows(workloads: dict[str, Workload] = WORKLOADS) -> list[str]:
    """The rows a run that names none runs (every row but the heavy ones)."""
    return [n for n, w in workloads.items() if w.default]


def grid_rows(workloads: dict[str, Workload] = WORKLOADS) -> list[str]:
    """The grid (``--grid``): each model row between its smaller and its larger size."""
    rows = []
    for name, w in workloads.items():
        if w.group == "model" and not w.size_of:
            sizes = [n for n, s in workloads.items() if s.size_of == name]
            rows += [sizes[0], name, *sizes[1:]] if sizes else [name]
    return rows


def register(w: Workload) -> Workload:
    if w.group not in ("overhead", "model", "training", "interleaved"):
        raise ValueError(f"workload {w.name!r}: unknown group {w.group!r}")
    WORKLOADS[w.name] = w
    return w


# -- the device every row runs on (``python -m benchmarks.run --device cuda``) ----------

DEVICE_ENV = "DYNAJAX_BENCH_DEVICE"  # inherited by first-call worker processes


def device() -> torch.device:
    """The torch device of every row's model and inputs (default: CPU)."""
    return torch.device(os.environ.get(DEVICE_ENV) or "cpu")


def placed(model: nn.Module, args: tuple[Any, ...]) -> tuple[nn.Module, tuple[Any, ...]]:
    """``model`` and its tensor arguments moved to ``device()``."""
    d = device()
    return model.to(d), tuple(a.to(d) if isinstance(a, torch.Tensor) else a for a in args)


def jax_put(x: Any) -> Any:
    """``x`` (NumPy or JAX) on the JAX device matching ``device()``, for the JAX floors."""
    import jax

    platform = "gpu" if device().type == "cuda" else "cpu"
    return jax.device_put(x, jax.devices(platform)[0])
