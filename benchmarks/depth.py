"""Compile time against depth: the first call of a GPT-2 of 2, 12 and 24 layers.

    python -m benchmarks.depth                          # dynajax, plain and marked
    python -m benchmarks.depth --layers 2,24 --repeats 3 --peers dynajax,aot_eager
    python -m benchmarks.depth --peers train_step,jax_function --no-marked

A GPT-2 from its config (width 256, 4 heads, vocab 1024, batch 2 x 64), each row in a
fresh process with no persistent cache (``DYNAJAX_CACHE_DIR=``). A peer is a
``torch.compile`` backend (eval, ``no_grad``; ``aot_eager``, Dynamo and aot_autograd
compiling nothing, shows what torch's own trace costs), or one of dynajax's
whole-graph drivers: ``jax_function`` (``jax.jit`` of the model as a JAX function,
eval) or ``train_step`` (the whole AdamW step on the LM loss, train mode; the
"second" column is its second step, which runs the first step's program).
"marked": ``GPT2Block.forward`` wrapped in ``torch.compiler.nested_compile_region``
(each block a region traced once). Each
process times its first call (imports and the model's construction excluded) and the
median of 15 calls after 3 more. The table gives the median of the repeats, and the
first call's ratio to the 2-layer model's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(layers: int, peer: str, marked: bool) -> dict[str, float]:
    """One row in this process (the ``--child`` side): its first call and steady time."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2 import modeling_gpt2

    if peer in ("dynajax", "train_step", "jax_function"):
        import dynajax  # noqa: F401  (the backend's entry point, and its settings)
    if marked:
        block = modeling_gpt2.GPT2Block
        block.forward = torch.compiler.nested_compile_region(block.forward)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=256, n_head=4, vocab_size=1024, n_positions=128)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 1024, (2, 64))

    def setup() -> Callable[[], object]:
        """The row's callable (its construction is part of the first call's time)."""
        if peer == "train_step":
            import jax

            model.train()
            step = dynajax.train_step(
                model,
                torch.optim.AdamW(model.parameters()),
                lambda m, ids: m(ids, labels=ids).loss,
            )
            return lambda: jax.block_until_ready(step(ids))
        if peer == "jax_function":
            import jax
            import jax.numpy as jnp

            fn, state = dynajax.jax_function(model, ids)  # (torch's trace)
            jitted = jax.jit(lambda state, ids: fn(state, ids)["logits"])
            x = jnp.asarray(ids.numpy())
            return lambda: jax.block_until_ready(jitted(state, x))
        compiled = torch.compile(model, backend=peer)

        def call() -> object:
            with torch.no_grad():
                return compiled(ids)

        return call

    start = time.perf_counter()
    call = setup()
    call()
    first = time.perf_counter() - start
    start = time.perf_counter()
    call()
    second = time.perf_counter() - start
    for _ in range(2):
        call()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"first_s": first, "second_s": second, "steady_ms": statistics.median(times) * 1e3}


def _row(layers: int, peer: str, marked: bool) -> dict[str, float]:
    """One row in a fresh process."""
    env = {**os.environ, "DYNAJAX_CACHE_DIR": ""}
    args = [sys.executable, "-m", "benchmarks.depth", "--child", str(layers), peer]
    out = subprocess.run(
        [*args, "marked" if marked else "plain"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="2,12,24")
    parser.add_argument("--peers", default="dynajax")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-marked", action="store_true", help="the plain model only")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        layers, peer, how = args.child
        print(json.dumps(_child(int(layers), peer, how == "marked")))
        return
    layers = [int(n) for n in args.layers.split(",")]
    marks = (False,) if args.no_marked else (False, True)
    rows = [(p, m) for p in args.peers.split(",") for m in marks]
    results: dict[tuple[str, bool, int], list[dict[str, float]]] = {}
    for _ in range(args.repeats):  # (the rows interleaved, repeat by repeat)
        for n in layers:
            for peer, marked in rows:
                results.setdefault((peer, marked, n), []).append(_row(n, peer, marked))
    print("| peer | layers | first call | / fewest layers' | second | steady |")
    print("|---|---:|---:|---:|---:|---:|")
    for peer, marked in rows:
        base = None
        for n in layers:
            runs = results[(peer, marked, n)]
            first, second, steady = (
                statistics.median(r[k] for r in runs) for k in ("first_s", "second_s", "steady_ms")
            )
            base = base or first
            name = f"{peer}, marked" if marked else peer
            print(
                f"| {name} | {n} | {first:.2f} s | {first / base:.2f} | {second:.2f} s "
                f"| {steady:.1f} ms |"
            )


if __name__ == "__main__":
    main()
