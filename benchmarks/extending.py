"""What extending dynajax buys per call: a rule for a custom op, and a rewrite.

    python -m benchmarks.extending
    python -m benchmarks.extending --rounds 9 --calls 20

Two comparisons, each timed side by side in one process (interleaved rounds, median
seconds per call, inference under ``torch.no_grad``):

* Mixtral (tests/models.py's tiny config, 2x16 tokens): transformers' grouped matmul in
  JAX through dynajax's shipped rule (the default), against the same op forced to eager
  PyTorch (``fallback_ops=["transformers.grouped_mm_fallback"]``), which splits the
  JAX program at every expert layer.
* examples/attention_rewrite.py's two-block model: hand-written attention as dynajax
  lowers it (matmul, softmax, matmul), against the rewrite to
  ``jax.nn.dot_product_attention`` through ``call_jax``.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import dynajax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _per_call_s(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _time(ways: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each way, interleaved round by round."""
    for f in ways.values():
        for _ in range(3):
            f()
    samples: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(rounds):
        for way, f in ways.items():
            samples[way].append(_per_call_s(f, calls))
    return {w: statistics.median(s) for w, s in samples.items()}


def _mixtral(rounds: int, calls: int) -> dict[str, float]:
    from tests.models import transformers_zoo

    build, inputs = transformers_zoo()["mixtral"]
    torch.manual_seed(0)
    model, kwargs = build().eval(), inputs()
    in_jax = torch.compile(model, backend=dynajax.Backend(cache_dir=""))
    eager_op = torch.compile(
        model,
        backend=dynajax.Backend(cache_dir="", fallback_ops=["transformers.grouped_mm_fallback"]),
    )
    with torch.no_grad():
        return _time(
            {
                "grouped matmul in JAX (rule)": lambda: in_jax(**kwargs),
                "grouped matmul in PyTorch": lambda: eager_op(**kwargs),
            },
            rounds,
            calls,
        )


def _attention(rounds: int, calls: int) -> dict[str, float]:
    spec = importlib.util.spec_from_file_location(
        "attention_rewrite", ROOT / "examples" / "attention_rewrite.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model, x = example.Model(), torch.randn(8, 64, 32)
    plain = torch.compile(model, backend=dynajax.Backend(cache_dir=""))
    rewritten = torch.compile(
        model, backend=dynajax.Backend(cache_dir="", rewrites=[example.ATTENTION])
    )
    with torch.no_grad():
        return _time(
            {
                "matmul, softmax, matmul": lambda: plain(x),
                "rewritten: dot_product_attention": lambda: rewritten(x),
            },
            rounds,
            calls,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    print(f"{'model':<34} {'way':<34} {'ms/call':>9} {'x first':>8}")
    for name, run in [
        ("Mixtral (tiny), 2x16 tokens", _mixtral),
        ("attention example, 8x64 tokens", _attention),
    ]:
        torch._dynamo.reset()
        med = run(args.rounds, args.calls)
        first = next(iter(med.values()))
        for way, s in med.items():
            print(f"{name:<34} {way:<34} {s * 1e3:>9.3f} {s / first:>8.2f}")


if __name__ == "__main__":
    main()
