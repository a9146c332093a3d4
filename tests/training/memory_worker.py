"""The host memory a ``dynajax.train_step`` adds (tests/training/test_train_step.py):
the process's resident set size before the step is made and after its first and
second steps, for a 256 MiB model (4 bias-free 4096x4096 layers, SGD: no optimizer
state), with the module released between syncs (the default) or kept.

    python -m tests.training.memory_worker release|keep
"""

from __future__ import annotations

import gc
import json
import sys

import jax
import jax.numpy as jnp
import psutil
import torch
import torch.nn.functional as F

import dynajax


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def main() -> None:
    release = sys.argv[1] == "release"
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # JAX's runtime up first
    torch.manual_seed(0)
    width = 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, width), torch.randn(8, width)
    before = rss()
    step = dynajax.train_step(
        model, optimizer, lambda m, x, y: F.mse_loss(m(x), y), release_module=release
    )
    float(step(x, y))
    first = rss()
    float(step(x, y))
    second = rss()
    print(
        json.dumps(
            {
                "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "after_first": first - before,
                "after_second": second - before,
            }
        )
    )


if __name__ == "__main__":
    main()
