"""Where the per-call time of a tiny compiled function goes, layer by layer.

    python -m benchmarks.overhead
    python -m benchmarks.overhead --calls 5000 --rounds 21
    python -m benchmarks.overhead --device cuda
    python -m benchmarks.overhead --plot docs/overhead.png   # the guide's plot (and .json)

Two functions: ``x + 1`` on a 1-element float32 tensor, and the sum of 100 float32[4]
inputs. Each layer is timed on its own; layers are interleaved round by round (the
order rotating), so load from other processes falls on all of them alike; the table
gives the median over rounds of the time per call (and the best round). Two ways:

* **alone**: the call in a tight loop, so every cache holds its code and data;
* **in context**: each timed call follows one call of an unrelated inductor-compiled
  function, as a compiled model's call follows other work in a real program.

Layers, from the bottom up:

* ``jax.jit, jax.Array in/out``: the raw floor (no torch at all, result not waited for);
* ``jax.jit, torch in/out``: tensors' NumPy views in, the output waited for and wrapped
  as a tensor (``torch.from_numpy(np.asarray(out))``): what any torch->JAX call costs;
* ``dynajax partition``: ``CompiledPartition.run``, the JAX side of a dynajax call
  (cached input arrays, the executable, outputs as tensors);
* ``dynajax, backend's callable``: what Dynamo calls after its guards: the stitched
  graph, and aot_autograd's runtime wrapper where it has work to do;
* ``dynajax, whole call``: ``torch.compile(f, backend="dynajax")``, adding Dynamo's
  guards and frame;
* ``inductor, backend's callable`` and ``inductor, whole call``: the same layers of
  ``torch.compile``'s default backend, and ``eager`` for scale.

The whole call minus the backend's callable is Dynamo's share, the same code for both
backends.

On a GPU (``--device cuda``) the tensors live there, the torch<->JAX layer crosses by
DLPack, and every round ends with a device-wide synchronize (counted in its time): a
per-call figure is then the host's cost of issuing one call, the number that bounds a
small graph's speed on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

N_INPUTS = 100


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _per_call_us(fn: Callable[[], Any], between: Callable[[], Any] | None, calls: int) -> float:
    """Microseconds per call of ``fn`` (only ``fn`` is timed, and the device's finishing
    what the calls queued)."""
    clock = time.perf_counter_ns
    _sync()
    if between is None:
        start = clock()
        for _ in range(calls):
            fn()
        _sync()
        return (clock() - start) / calls / 1e3
    spent = 0
    for _ in range(calls):
        between()
        _sync()
        start = clock()
        fn()
        spent += clock() - start
    start = clock()
    _sync()
    spent += clock() - start
    return spent / calls / 1e3


def _capturing(backend: Callable[..., Any], into: list[Any]) -> Callable[..., Any]:
    """``backend``, keeping the callable it returns to Dynamo."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        fn = backend(gm, example_inputs)
        into.append(fn)
        return fn

    return compile_graph


def layers(f: Callable[..., torch.Tensor], xs: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """The layers of a call of ``f(*xs)``, each a zero-argument callable."""
    import jax
    from torch._inductor.compile_fx import compile_fx

    import dynajax
    from benchmarks.harness import _own_code
    from dynajax.runtime.compiled import CompiledPartition

    jitted = jax.jit(f)
    on_cpu = xs[0].device.type == "cpu"
    platform = "cpu" if on_cpu else "gpu"
    xs_jax = [jax.device_put(x.cpu().numpy(), jax.devices(platform)[0]) for x in xs]

    def jit_torch() -> torch.Tensor:
        if on_cpu:
            return torch.from_numpy(np.asarray(jitted(*[x.numpy() for x in xs])))
        return torch.from_dlpack(jitted(*[jax.dlpack.from_dlpack(x) for x in xs]))

    def jit_jax() -> Any:
        return jitted(*xs_jax)

    # Each compiles its own code object: Dynamo's cache of one code object would hold
    # both peers' entries, and each call would check the other's guards first.
    backend = dynajax.Backend(cache_dir="")
    dj_fns: list[Any] = []
    compiled = torch.compile(_own_code(f, "dynajax"), backend=_capturing(backend, dj_fns))
    compiled(*xs)
    gm = backend.graphs[0].graph_module
    [part] = [m for m in gm.children() if isinstance(m, CompiledPartition)]
    ind_fns: list[Any] = []
    inductor = torch.compile(_own_code(f, "inductor"), backend=_capturing(compile_fx, ind_fns))
    inductor(*xs)
    jit_torch()
    [dj_fn], [ind_fn] = dj_fns, ind_fns
    boundary: dict[str, Callable[[], Any]] = {}
    if not on_cpu:  # the two crossings of the per-call path, one tensor each
        from dynajax.runtime.conversion import dlpack_to_jax, to_torch

        out = jit_jax()
        boundary = {
            "one input to JAX (DLPack)": lambda: dlpack_to_jax(xs[0]),
            "one output to torch (DLPack)": lambda: to_torch(out),
        }
    return {
        "jax.jit, jax.Array in/out": jit_jax,
        **boundary,
        "jax.jit, torch in/out": jit_torch,
        "dynajax partition": lambda: part.run(xs),
        "dynajax, backend's callable": lambda: dj_fn(*xs),
        "dynajax, whole call": lambda: compiled(*xs),
        "inductor, backend's callable": lambda: ind_fn(*xs),
        "inductor, whole call": lambda: inductor(*xs),
        "eager": lambda: f(*xs),
    }


def _add_one(t: torch.Tensor) -> torch.Tensor:
    return t + 1


def _sum_inputs(*xs: torch.Tensor) -> torch.Tensor:
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc


def measure(
    steps: dict[str, Callable[[], Any]],
    between: Callable[[], Any] | None,
    calls: int,
    rounds: int,
) -> dict[str, tuple[float, float]]:
    """(median, best) µs per call of each step, rounds interleaved in rotating order."""
    names = list(steps)
    for fn in steps.values():
        _per_call_us(fn, between, max(calls // 10, 50))  # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(_per_call_us(steps[name], between, calls))
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def output_free(device: torch.device, calls: int, rounds: int) -> dict[str, float]:
    """Dynamo's share of a whole call, by the kind of tensor the backend hands back.

    ``x + 1`` compiled with a backend whose callable only hands back a ready-made
    output, either a tensor PyTorch allocated or a tensor over an XLA buffer, made as
    dynajax's partitions make theirs (a NumPy view of the ``jax.Array`` on the CPU,
    DLPack elsewhere); each output dropped as the call returns (the free counted in the
    call, as in a program that uses the result and lets it go) or kept. Dropped minus
    kept is what freeing that output costs; the XLA buffer's free (the NumPy view, the
    ``jax.Array``, the PJRT buffer) is part of Dynamo's share in the layer table.
    Returns the median µs per call of each of the four, keyed by name.
    """
    import jax

    from benchmarks.harness import _own_code
    from dynajax.runtime.conversion import to_torch

    jitted = jax.jit(lambda a: a + 1)
    seed = jax.device_put(np.zeros(1, np.float32), jax.devices(device.type)[0])

    def xla_output() -> torch.Tensor:
        out = jitted(seed)
        return torch.from_numpy(np.asarray(out)) if device.type == "cpu" else to_torch(out)

    makers = {
        "torch-allocated output": lambda: torch.zeros(1, device=device),
        "output over an XLA buffer": xla_output,
    }
    x = torch.zeros(1, device=device)
    times: dict[str, list[float]] = {}
    for kind, make in makers.items():
        pool: list[torch.Tensor] = []
        compiled = torch.compile(
            _own_code(_add_one, f"ready_{len(times)}"), backend=_handing_back(pool)
        )
        pool[:] = [make() for _ in range(8)]
        for _ in range(8):
            compiled(x)  # compiles; the guards' first evaluation
        for r in range(rounds):
            for keep in (False, True) if r % 2 else (True, False):
                pool[:] = [make() for _ in range(calls)]
                _sync()
                kept: list[torch.Tensor] = []
                put = kept.append if keep else _drop
                clock = time.perf_counter_ns
                start = clock()
                for _ in range(calls):
                    put(compiled(x))
                spent = clock() - start
                name = f"{kind}, {'kept' if keep else 'dropped'}"
                times.setdefault(name, []).append(spent / calls / 1e3)
                kept.clear()
    return {name: statistics.median(t) for name, t in times.items()}


def _drop(_: Any) -> None:
    pass


def _handing_back(pool: list[torch.Tensor]) -> Callable[..., Any]:
    """A backend whose callable hands back the next ready-made output of ``pool``."""

    def backend(gm: torch.fx.GraphModule, example: Sequence[Any]) -> Any:
        def ready_made(*args: Any) -> tuple[torch.Tensor]:
            return (pool.pop(),)

        return ready_made

    return backend


def _cprofile(fn: Callable[[], Any], calls: int, title: str, top: int = 14) -> None:
    """The Python functions that take the most time over ``calls`` calls of ``fn``
    (cProfile's own time per call inflates each frame alike; read the ranking, and the
    C functions it names, not the absolute figures)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    _sync()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    print(f"\ncProfile, {title}: µs per call (own time), {calls} calls")
    for (file, line, name), (_, ncalls, tottime, _, _) in rows:
        where = f"{file.rsplit('/', 2)[-1]}:{line}" if line else ""
        print(f"  {tottime / calls * 1e6:8.2f}  {ncalls / calls:5.1f}x  {name} {where}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--no-context", action="store_true", help="skip the in-context mode")
    parser.add_argument("--device", default="cpu", help="torch device of the tensors (cuda)")
    parser.add_argument(
        "--no-free",
        action="store_true",
        help="skip the outputs' free (Dynamo's share with a ready-made output)",
    )
    parser.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="CALLS",
        help="also profile this many whole dynajax and inductor calls with cProfile",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="write the medians as a bar chart to PNG and as JSON beside it "
        "(docs/overhead.png is the guide's; needs matplotlib, the bench extra)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    import warnings

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    other = torch.compile(lambda t: t * 2 - 1)  # the unrelated work between calls
    y = torch.zeros(1, device=device)
    other(y)
    cases = {
        "x + 1": (_add_one, [torch.zeros(1, device=device)]),
        f"{N_INPUTS} inputs": (
            _sum_inputs,
            [torch.full((4,), float(i), device=device) for i in range(N_INPUTS)],
        ),
    }
    modes: list[tuple[str, Callable[[], Any] | None]] = [("alone", None)]
    if not args.no_context:
        modes.append(("in context", lambda: other(y)))
    print(
        f"µs per call: median of {args.rounds} interleaved rounds of {args.calls} calls "
        f"(best round); load average at start {os.getloadavg()[0]:.1f}, "
        f"{os.cpu_count()} cpus; tensors on {device}"
    )
    recorded: dict[str, dict[str, dict[str, tuple[float, float]]]] = {}
    for case, (f, xs) in cases.items():
        steps = layers(f, xs)
        results = {m: measure(steps, between, args.calls, args.rounds) for m, between in modes}
        recorded[case] = results
        width = max(map(len, steps))
        head = "".join(f"  {mode + ' (best)':>22}" for mode, _ in modes)
        print(f"\n{case:<{width}}{head}")
        for name in steps:
            cells = "".join(
                f"  {results[m][name][0]:>12.1f} ({results[m][name][1]:>6.1f})" for m, _ in modes
            )
            print(f"{name:<{width}}{cells}")
        if args.cprofile:
            for peer in ("dynajax", "inductor"):
                _cprofile(steps[f"{peer}, whole call"], args.cprofile, f"{case}, {peer}")
        for mode, _ in modes:
            r = results[mode]
            dj, ind = r["dynajax, whole call"][0], r["inductor, whole call"][0]
            dynamo_dj = dj - r["dynajax, backend's callable"][0]
            dynamo_ind = ind - r["inductor, backend's callable"][0]
            floor = r["jax.jit, torch in/out"][0]
            print(
                f"{mode}: dynajax / inductor, whole call {dj / ind:.2f}; Dynamo's share "
                f"{dynamo_dj:.1f} (dynajax) / {dynamo_ind:.1f} (inductor); partition / "
                f"jax.jit with torch in/out {r['dynajax partition'][0] / floor:.2f}"
            )

    if not args.no_free:
        free = output_free(device, args.calls, args.rounds)
        print("\nwhole call of x + 1 whose backend hands back a ready-made output, µs")
        for name, us in free.items():
            print(f"{name:<40}{us:>8.1f}")
        torch_, xla = (
            free[f"{kind}, dropped"] - free[f"{kind}, kept"]
            for kind in ("torch-allocated output", "output over an XLA buffer")
        )
        print(f"freeing the output (dropped - kept): {torch_:.1f} µs (torch), {xla:.1f} µs (XLA)")

    if args.plot:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": str(device),
            "cpus": os.cpu_count(),
            "load_average": round(os.getloadavg()[0], 1),
            "calls": args.calls,
            "rounds": args.rounds,
            "torch": torch.__version__,
        }
        write_plot(args.plot, recorded, meta)


def write_plot(
    path: str,
    recorded: dict[str, dict[str, dict[str, tuple[float, float]]]],
    meta: dict[str, Any],
) -> None:
    """Writes ``recorded`` (case -> mode -> layer -> (median, best) µs) as JSON beside
    ``path`` and as one bar chart per case: a bar per layer and mode, the median
    (``benchmarks.figures``, which also writes the guide's table from that JSON)."""
    import json

    base, _ = os.path.splitext(path)
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "us_per_call": recorded}, f, indent=1)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"\nwrote {base}.json; no plot: matplotlib is missing (pip install -e '.[bench]')")
        return
    from benchmarks import figures

    data = {"meta": meta, "us_per_call": recorded}
    figures.draw_overhead(data, figures.overhead_table(data), Path(path))
    print(f"\nwrote {path} and {base}.json")


if __name__ == "__main__":
    main()
