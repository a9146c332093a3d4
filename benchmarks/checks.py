"""The cost of value checks: per-call time with ``checks=True`` (the default) vs off.

    python -m benchmarks.checks
    python -m benchmarks.checks --rounds 9 --rows tiny,gpt2
    python -m benchmarks.checks --workloads all   # every row of benchmarks/workloads.py

A check computes eager's condition inside the XLA program (an index compared with its
bound, reduced to one flag) and costs one small device-to-host read per call of a
partition with checks (``dynajax/lowering/checks.py``). Rows, each compiled twice by
fresh backends and timed side by side (interleaved rounds, rotating order, median of
the rounds' per-call means):

* ``x[idx]``: a 16x16 float32 tensor, 4 indices: the fixed per-call cost, alone.
* ``a // b``: 1M int64 elements: a check that reads a whole large tensor (b == 0).
* ``GPT-2``: tests/models.py's GPT-2, 4 layers, width 256, batch 4x128 tokens
  (benchmarks/workloads.py's row): two embedding lookups, inference.
* ``GPT-2 train``: the same model, one forward and backward step (cross entropy on
  its own logits' argmax): the embedding checks in the forward, none in the backward.
* ``--workloads``: the rows of the main benchmark table (``benchmarks/workloads.py``,
  inference and training), each step built twice by the row's own ``setup``; single
  calls alternate between the two, each timed alone, about ``rounds`` x 0.2 s of
  calls each, and the medians compared (on a loaded machine, rounds of many calls
  let load drifting over seconds fall on one variant more than on the other).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

Step = Callable[[], Any]


def _per_call_s(fn: Step, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _compiled(fn: Any, checks: bool) -> Any:
    """``fn`` compiled by a fresh backend, through a code object of its own (Dynamo's
    cache would otherwise check the other variant's entry first on every call)."""
    import dynajax
    from benchmarks.harness import _own_code

    own = _own_code(fn, "checks_on" if checks else "checks_off")
    backend = dynajax.Backend(cache_dir="", checks=checks)
    _backends.append(backend)
    return torch.compile(own, backend=backend)


_backends: list[Any] = []  # every backend _compiled made, for checks_in


def checks_in(backends: list[Any]) -> int:
    """Value checks in the programs these backends compiled (0: on and off are one
    program, and their ratio is the run's noise)."""
    from dynajax.runtime.compiled import CompiledPartition

    return sum(
        len(m.value_checks.checks or ())
        for b in backends
        for g in b.graphs
        for m in g.graph_module.children()
        if isinstance(m, CompiledPartition) and m.value_checks is not None
    )


def _tiny(checks: bool) -> Step:
    torch.manual_seed(0)
    x, idx = torch.randn(16, 16), torch.tensor([0, 3, 7, 15])
    f = _compiled(lambda x, i: x[i], checks)
    return lambda: f(x, idx)


def _division(checks: bool) -> Step:
    torch.manual_seed(0)
    a = torch.randint(-1000, 1000, (1 << 20,))
    b = torch.randint(1, 1000, (1 << 20,))
    f = _compiled(lambda a, b: a // b, checks)
    return lambda: f(a, b)


def _gpt2(checks: bool) -> Step:
    from benchmarks.workloads import gpt2_model

    torch.manual_seed(0)
    model, (ids,) = gpt2_model()
    model.eval()
    f = _compiled(model, checks)

    def step() -> Any:
        with torch.no_grad():
            return f(ids)

    return step


def _gpt2_train(checks: bool) -> Step:
    from benchmarks.workloads import gpt2_model

    torch.manual_seed(0)
    model, (ids,) = gpt2_model()
    model.train()
    for m in model.modules():  # no dropout: the same work every call
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    f = _compiled(lambda ids: model(ids, labels=ids).loss, checks)

    def step() -> Any:
        loss = f(ids)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    return step


def _workload(name: str) -> Callable[[bool], Step]:
    """A row of the main benchmark table, compiled by dynajax with checks on or off."""

    def make(checks: bool) -> Step:
        from benchmarks.harness import in_grad_mode
        from benchmarks.workloads import WORKLOADS

        w = WORKLOADS[name]
        return in_grad_mode(w, w.setup(lambda f: _compiled(f, checks)))

    return make


ROWS: dict[str, tuple[str, Callable[[bool], Step], int]] = {
    "tiny": ("x[idx], 16x16 float32, 4 indices", _tiny, 2000),
    "div": ("a // b, 1M int64", _division, 20),
    "gpt2": ("GPT-2 4x256, 4x128 tokens, inference", _gpt2, 10),
    "gpt2-train": ("GPT-2 4x256, 4x128 tokens, train step", _gpt2_train, 3),
}


def measure(row: str, rounds: int, scale: float = 1.0) -> dict[str, Any]:
    """Median seconds per call with checks off and on, interleaved round by round,
    and ``checks``: how many value checks the "on" program computes.

    ``row`` is a key of ``ROWS`` or ``workload:<name>`` (a main-table row; calls per
    round: single calls alternating, see the module's docstring).
    """
    if row.startswith("workload:"):
        make, calls = _workload(row.split(":", 1)[1]), 0
    else:
        _, make, calls = ROWS[row]
    off = make(False)
    first = len(_backends)
    steps = {"off": off, "on": make(True)}
    for step in steps.values():
        for _ in range(3):
            step()  # compile, warm up
    checks = checks_in(_backends[first:])
    if not calls:  # a main-table row: single calls, alternating, each timed alone
        per_call = min(_per_call_s(s, 1) for s in steps.values())
        n = max(3, int(rounds * 0.2 * scale / per_call))
        alone: dict[str, list[float]] = {k: [] for k in steps}
        order = list(steps)
        for r in range(n):
            for k in order[r % 2 :] + order[: r % 2]:
                alone[k].append(_per_call_s(steps[k], 1))
        return {k: statistics.median(v) for k, v in alone.items()} | {"checks": checks}
    calls = max(1, int(calls * scale))
    samples: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    for r in range(rounds):
        for k in order[r % 2 :] + order[: r % 2]:  # rotate who goes first
            steps[k]()  # one untimed call: OpenMP workers of the other peer settle
            samples[k].append(_per_call_s(steps[k], calls))
    return {k: statistics.median(v) for k, v in samples.items()} | {"checks": checks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--rows", default=",".join(ROWS), help="comma separated: " + ", ".join(ROWS)
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies calls per round")
    parser.add_argument(
        "--workloads",
        help="rows of the main benchmark table instead of --rows: 'all' or comma separated",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="compute threads (as python -m benchmarks.run --threads; 1 on a loaded machine)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        from benchmarks.run import set_threads

        set_threads(args.threads)
    if args.workloads:
        from benchmarks.workloads import WORKLOADS

        names = list(WORKLOADS) if args.workloads == "all" else args.workloads.split(",")
        unknown = sorted(set(names) - set(WORKLOADS))
        if unknown:
            parser.error(f"unknown workloads {unknown}; workloads are {', '.join(WORKLOADS)}")
        rows = [f"workload:{n}" for n in names]
    else:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = sorted(set(rows) - set(ROWS))
        if unknown:
            parser.error(f"unknown rows {unknown}; rows are {', '.join(ROWS)}")
    print(f"{'row':<40} {'off ms':>10} {'on ms':>10} {'on/off':>8} {'checks':>7}")
    ratios: dict[str, float] = {}
    for row in rows:
        med = measure(row, args.rounds, args.scale)
        label = row.split(":", 1)[1] if row.startswith("workload:") else ROWS[row][0]
        ratios[row] = med["on"] / med["off"]
        print(
            f"{label:<40} {med['off'] * 1e3:>10.4f} {med['on'] * 1e3:>10.4f} "
            f"{ratios[row]:>8.3f} {med['checks']:>7}",
            flush=True,
        )
    if args.workloads:
        from benchmarks.workloads import WORKLOADS

        for group in ("model", "training"):
            rs = [r for n, r in ratios.items() if WORKLOADS[n.split(":", 1)[1]].group == group]
            if rs:
                g = math.exp(sum(map(math.log, rs)) / len(rs))
                print(f"{group} rows geomean on/off: {g:.3f} (target < 1.02)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
