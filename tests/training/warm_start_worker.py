"""A training run in a fresh process, for the warm-start tests: trains a small model
with ``dynajax.train_step`` and prints, as JSON, its losses, a digest of the trained
parameters and the step's compile statistics.

    python -m tests.training.warm_start_worker VARIANT [--bad-batch] [--momentum]

VARIANT picks the model's code: ``relu``, ``gelu`` (the same parameters, another
forward), ``dropout`` (random: each step draws a seed), ``callback`` (relu in
``fallback_ops``: PyTorch's kernel inside the program, or, with
``DYNAJAX_TORCH_KERNELS=0``, a Python host callback, whose program is not stored). ``--bad-batch``
runs a fourth step on a batch with a token index out of range, which must raise eager's
error with the state unchanged. ``--momentum`` trains with SGD's momentum (whose first
step creates its buffer, a copy of the gradient: a program of its own) for AdamW.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

import dynajax
import dynajax.training.program


class Model(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(16, 8)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).mean(1)
        h = self.fc1(h)
        h = F.gelu(h) if self.variant == "gelu" else torch.relu(h)
        if self.variant == "dropout":
            h = F.dropout(h, 0.3, training=self.training)
        return self.fc2(h)


def main() -> None:
    variant = sys.argv[1]
    # The traces the step made: True, of the whole step; False, stopped at the
    # optimizer's update (of one of torch's own optimizers, where the trace so far
    # keys the program and it was found).
    traced: list[bool] = []
    trace_step = dynajax.training.program.trace_step

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        graph = trace_step(*args, **kwargs)
        traced.append(graph is not None)
        return graph

    dynajax.training.program.trace_step = spy
    torch.manual_seed(0)
    model = Model(variant)
    if "--momentum" in sys.argv:
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = dynajax.train_step(
        model,
        opt,
        lambda m, ids, y: F.mse_loss(m(ids), y),
        fallback_ops=["aten.relu"] if variant == "callback" else (),
    )
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 16, (4, 5), generator=g)
        y = torch.randn(4, 1, generator=g)
        losses.append(float(step(ids, y)))
    error = None
    if "--bad-batch" in sys.argv:
        ids = torch.randint(0, 16, (4, 5), generator=g)
        ids[1, 2] = 99
        try:
            step(ids, torch.randn(4, 1, generator=g))
        except IndexError as e:
            error = str(e).splitlines()[0]
    step.sync()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    stats = step.compile_stats
    print(
        json.dumps(
            {
                "losses": losses,
                "params": digest.hexdigest(),
                "compiles": stats.xla_compiles,
                "hits": stats.cache_hits,
                "error": error,
                "steps": step.steps,
                "traced": traced,
            }
        )
    )


if __name__ == "__main__":
    main()
