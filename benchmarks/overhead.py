"""Where the per-call time of a tiny compiled function goes, layer by layer.

    python -m benchmarks.overhead
    python -m benchmarks.overhead --calls 20000 --rounds 7

``x + 1`` on a 1-element float32 tensor, each layer timed on its own (median per call of
the best round), two ways:

* **alone**: the call in a tight loop, so every cache holds its code and data;
* **in context**: each timed call follows one call of an unrelated inductor-compiled
  function, as a compiled model's call follows other work in a real program.

Layers, from the bottom up:

* ``jax.jit, jax.Array in/out``: the raw floor (no torch at all, result not waited for);
* ``jax.jit, torch in/out``: a tensor's NumPy view in, the output waited for and wrapped
  as a tensor (``torch.from_numpy(np.asarray(out))``): what any torch->JAX call costs;
* ``dynajax partition``: ``CompiledPartition.run``, the JAX side of a dynajax call
  (cached input arrays, the executable, outputs as tensors);
* ``dynajax, whole call``: ``torch.compile(f, backend="dynajax")``, adding Dynamo's
  guards and aot_autograd's runtime wrapper;
* ``inductor, whole call`` and ``eager`` for scale.

The in-context figures answer the question the tight loop cannot: how near a raw
``jax.jit`` call a dynajax partition is when the caches are shared with other work.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def _per_call_us(fn: Callable[[], Any], between: Callable[[], Any] | None, calls: int) -> float:
    """Microseconds per call of ``fn`` (only ``fn`` is timed)."""
    clock = time.perf_counter_ns
    if between is None:
        start = clock()
        for _ in range(calls):
            fn()
        return (clock() - start) / calls / 1e3
    spent = 0
    for _ in range(calls):
        between()
        start = clock()
        fn()
        spent += clock() - start
    return spent / calls / 1e3


def layers() -> dict[str, Callable[[], Any]]:
    import jax
    import jax.numpy as jnp

    import dynajax
    from dynajax.runtime.compiled import CompiledPartition

    x = torch.zeros(1)
    jitted = jax.jit(lambda a: a + 1)
    x_jax = jnp.zeros(1)

    def jit_torch() -> torch.Tensor:
        return torch.from_numpy(np.asarray(jitted(x.numpy())))

    backend = dynajax.Backend(cache_dir="")
    compiled = torch.compile(lambda t: t + 1, backend=backend)
    compiled(x)
    gm = backend.graphs[0].graph_module
    [part] = [m for m in gm.children() if isinstance(m, CompiledPartition)]
    inputs = [x]
    inductor = torch.compile(lambda t: t + 1)
    inductor(x)
    jit_torch()
    return {
        "jax.jit, jax.Array in/out": lambda: jitted(x_jax),
        "jax.jit, torch in/out": jit_torch,
        "dynajax partition": lambda: part.run(inputs),
        "dynajax, whole call": lambda: compiled(x),
        "inductor, whole call": lambda: inductor(x),
        "eager": lambda: x + 1,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the best is kept")
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    steps = layers()
    other = torch.compile(lambda t: t * 2 - 1)  # the unrelated work between calls
    y = torch.zeros(1)
    other(y)
    results: dict[str, dict[str, float]] = {name: {} for name in steps}
    for mode, between in (("alone", None), ("in context", lambda: other(y))):
        for name, fn in steps.items():
            _per_call_us(fn, between, 200)  # warm-up
            rounds = [_per_call_us(fn, between, args.calls) for _ in range(args.rounds)]
            results[name][mode] = min(rounds)
            results[name][mode + " median"] = statistics.median(rounds)
    width = max(map(len, steps))
    print(f"{'per call, µs (best of ' + str(args.rounds) + ' rounds)':<{width}}  alone  in context")
    for name, r in results.items():
        print(f"{name:<{width}}  {r['alone']:5.1f}  {r['in context']:10.1f}")
    floor = results["jax.jit, torch in/out"]["in context"]
    part = results["dynajax partition"]["in context"]
    print(f"\ndynajax partition / jax.jit with torch in/out, in context: {part / floor:.2f}")


if __name__ == "__main__":
    main()
