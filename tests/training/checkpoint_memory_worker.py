"""Peak host memory of two training steps of a deep MLP, with and without activation
checkpointing, in eager PyTorch or through ``dynajax.train_step``
(tests/training/test_checkpointing.py; benchmarks.training's memory rows).

    python -m tests.training.checkpoint_memory_worker eager|step plain|checkpoint \
        [--blocks 16 --width 1024 --batch 1024] [--no-barrier]

Prints JSON: the peak resident set size over the second step, less the resident set
before it (bytes), and the bytes of one block's activation, to size the differences
by. Run it with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc then maps every large
allocation on its own and unmaps it when freed, so that the resident set follows the
memory in use (else the heap keeps the first step's pages, and the second step's peak
hides in them).
"""

from __future__ import annotations

import argparse
import gc
import json

import jax
import jax.numpy as jnp
import psutil
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from benchmarks.memory import peak_bytes, reset_peak
from benchmarks.training import DeepMLP as Deep


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runner", choices=["eager", "step"])
    p.add_argument("form", choices=["plain", "checkpoint"])
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--no-barrier", action="store_true")
    args = p.parse_args()
    if args.no_barrier:
        import os

        from torch.fx.passes.infra.pass_base import PassResult

        # (a program patched at run time: not the one the persistent cache keeps)
        os.environ["DYNAJAX_CACHE_DIR"] = ""

        from dynajax.passes import recompute

        recompute.KeepRecomputation.call = lambda self, gm: PassResult(gm, False)  # type: ignore[method-assign]
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # JAX's runtime up first
    torch.manual_seed(0)
    model = Deep(args.blocks, args.width, args.form == "checkpoint")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    if args.runner == "step":
        step = dynajax.train_step(model, optimizer, loss_fn)

        def run() -> float:
            return float(step(x, y))
    else:

        def run() -> float:
            optimizer.zero_grad()
            loss = loss_fn(model, x, y)
            loss.backward()
            optimizer.step()
            return float(loss)

    losses = [run()]  # traces and compiles (or loads) the step; eager's grads made
    gc.collect()
    reset_peak()
    before = psutil.Process().memory_info().rss
    losses.append(run())
    print(
        json.dumps(
            {
                "peak_over_start": peak_bytes() - before,
                "activation_bytes": args.batch * args.width * 4,
                "losses": losses,
            }
        )
    )


if __name__ == "__main__":
    main()
