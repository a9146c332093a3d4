"""Training rows of the benchmark: forward + backward + optimizer step.

Registered into ``WORKLOADS`` (``benchmarks/registry.py``); ``benchmarks.workloads``
imports this module at its end, so its ``WORKLOADS`` holds these rows too. The
``*-train`` rows time the same step for every peer: the model compiled by the peer
(identity for eager), ``loss.backward()`` through the peer's backward graph,
and an eager ``torch.optim.SGD`` step with momentum (the same code for every peer, so
the rows compare the compiled forward and backward). The ``*-train-step`` rows time the
whole step with AdamW, each peer's best way: ``dynajax.train_step`` (one XLA program)
against the peer's compiled model with torch's fused AdamW kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.models import encoder_model, gpt2_model, gpt2_small_model, mlp_model, resnet_model
from benchmarks.registry import Compile, Step, Workload, placed, register


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


# -- the whole step as one program (dynajax.train_step) ----------------------------------


def _square_mean(model: nn.Module, *args: Any) -> torch.Tensor:
    return model(*args).square().mean()


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss


def _whole_step(
    build: Callable[[], tuple[nn.Module, tuple[Any, ...]]],
    loss_fn: Callable[..., torch.Tensor],
    checks: bool = True,
) -> Callable[..., Step]:
    """A training step with AdamW: for dynajax, ``dynajax.train_step`` (forward,
    backward and the update as one XLA program, the state in JAX; ``checks``: eager's
    value checks in the program, each step waiting for their result); for the others
    the best ordinary loop, the peer's compiled model with torch's fused AdamW kernel."""

    def setup(compile: Compile) -> Step:
        torch.manual_seed(0)
        model, args = placed(*build())
        model.train()
        if getattr(compile, "peer", None) in ("dynajax", "dynajax-jax"):
            import jax

            import dynajax

            train = dynajax.train_step(
                model, torch.optim.AdamW(model.parameters()), loss_fn, checks=checks
            )
            return lambda: jax.block_until_ready(train(*args))
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        fwd = compile(model)

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(fwd, *args)
            loss.backward()
            opt.step()
            return loss

        return step

    return setup


for _name, _build, _loss, _what in (
    ("mlp", mlp_model, _square_mean, "MLP 512-2048-512, batch 64"),
    ("encoder", encoder_model, _square_mean, "TransformerEncoderLayer(256, 4, 1024), dropout 0.1"),
    ("resnet18", resnet_model, _square_mean, "ResNet-18-shaped CNN on (8, 3, 64, 64)"),
    ("gpt2", gpt2_model, _lm_loss, "GPT-2 (4 layers, width 256) on (4, 128) tokens, LM loss"),
):
    register(
        Workload(
            f"{_name}-train-step",
            "training",
            _whole_step(_build, _loss),
            jax_setup=lambda: None,
            description=f"{_what}: the whole AdamW step (dynajax.train_step vs the "
            "peer's compiled model + fused AdamW)",
            no_grad=False,
        )
    )

# A model of a real size (GPT-2 small, 124M parameters) for the memory benchmark: where
# the state outweighs the runtimes' fixed cost. Too heavy for every run: named to run.
register(
    Workload(
        "gpt2-124m-train-step",
        "training",
        _whole_step(gpt2_small_model, _lm_loss),
        jax_setup=lambda: None,
        description="GPT-2 small (12 layers, width 768, vocabulary 50257, 124M parameters) "
        "on (2, 128) tokens: the whole AdamW step",
        no_grad=False,
        default=False,
    )
)

# The cost of train_step's value checks (GPT-2's embedding and cross-entropy indices,
# eager's errors): the row above without them; the other rows' models have no check.
register(
    Workload(
        "gpt2-train-step-unchecked",
        "training",
        _whole_step(gpt2_model, _lm_loss, checks=False),
        jax_setup=lambda: None,
        description="gpt2-train-step with train_step(..., checks=False): the value "
        "checks' cost is the dynajax ratio of the two rows",
        no_grad=False,
    )
)


# -- activation checkpointing: a deep MLP, plain and checkpointed ------------------------


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class DeepMLP(nn.Module):
    """Residual blocks of two linear layers, each block run through
    ``torch.utils.checkpoint`` (non-reentrant) when ``checkpointed``."""

    def __init__(self, blocks: int, width: int, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(blocks))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


def _deep_mlp(checkpointed: bool) -> Callable[[], tuple[nn.Module, tuple[Any, ...]]]:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        return DeepMLP(16, 256, checkpointed), (torch.randn(8192, 256),)

    return build


for _form, _on in (("", False), ("-checkpointed", True)):
    register(
        Workload(
            f"deep-mlp{_form}-train-step",
            "training",
            _whole_step(_deep_mlp(_on), _square_mean),
            jax_setup=lambda: None,
            description="16 residual MLP blocks, width 256, batch 8192"
            + (", each block checkpointed" if _on else "")
            + ": the whole AdamW step",
            no_grad=False,
        )
    )
