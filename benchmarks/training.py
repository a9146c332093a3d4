"""Training rows of the benchmark: forward + backward + optimizer step.

Registered into ``benchmarks.workloads.WORKLOADS`` (imported at the end of that
module). Every peer times the same step: the model compiled by the peer (identity for
eager), ``loss.backward()`` through the peer's backward graph, and an eager
``torch.optim.SGD`` step with momentum (the same code for every peer, so the rows
compare the compiled forward and backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.workloads import (
    Compile,
    Step,
    Workload,
    encoder_model,
    mlp_model,
    placed,
    register,
    resnet_model,
)


def _train_step(build: Callable[[], tuple[nn.Module, tuple[Any, ...]]]) -> Callable[..., Step]:
    def setup(compile: Compile) -> Step:
        torch.manual_seed(0)
        model, args = placed(*build())
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        fwd = compile(model)

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = fwd(*args).square().mean()
            loss.backward()
            opt.step()
            return loss

        return step

    return setup


register(
    Workload(
        "mlp-train",
        "training",
        _train_step(mlp_model),
        description="MLP 512-2048-512, batch 64: forward + backward + SGD step",
        no_grad=False,
    )
)
register(
    Workload(
        "encoder-train",
        "training",
        _train_step(encoder_model),
        description="TransformerEncoderLayer(256, 4, 1024), dropout 0.1, on (8, 128, 256): "
        "forward + backward + SGD step",
        no_grad=False,
    )
)
register(
    Workload(
        "resnet18-train",
        "training",
        _train_step(resnet_model),
        description="ResNet-18-shaped CNN on (8, 3, 64, 64), batch norm in training mode: "
        "forward + backward + SGD step",
        no_grad=False,
    )
)
