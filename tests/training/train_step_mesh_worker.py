"""Runs in a subprocess with eight JAX CPU devices (tests/training/test_train_step_mesh.py):
``dynajax.train_step`` on a mesh against eager PyTorch, printing one line of JSON facts.

    python -m tests.training.train_step_mesh_worker CHECKPOINT_DIR

Cases: FSDP (AdamW) and data parallel (SGD with momentum) on an MLP, FSDP on a small
LLaMA, each 20 steps beside an eager loop; the bytes each device holds, measured from
the arrays; a checkpoint saved on the 8-device mesh and restored onto a 4-device one,
continuing the run.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import dynajax  # noqa: E402
from tests.models import llama, mlp  # noqa: E402

STEPS = 20


def mesh_of(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def regression(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def lm(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss


def mlp_batches() -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen))
        for _ in range(STEPS)
    ]


def lm_batches() -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 128, (8, 16), generator=gen),) for _ in range(STEPS)]


def build_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return mlp(32, 64, 16)


def build_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return llama(layers=2, width=64, heads=4, vocab=128).train()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def optimizer_state(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        f"{names[id(p)]}.{k}": v.detach().clone()
        for p, s in opt.state.items()
        for k, v in s.items()
        if isinstance(v, torch.Tensor)
    }


def case(
    build: Callable[[], torch.nn.Module],
    make_opt: Callable[[Any], torch.optim.Optimizer],
    loss_fn: Callable[..., torch.Tensor],
    batches: list[tuple[torch.Tensor, ...]],
    rules: dynajax.ShardingRules,
) -> dict[str, Any]:
    eager, ours = build(), build()
    eager_opt, our_opt = make_opt(eager.parameters()), make_opt(ours.parameters())
    ref_losses = []
    for batch in batches:
        eager_opt.zero_grad()
        loss = loss_fn(eager, *batch)
        loss.backward()
        eager_opt.step()
        ref_losses.append(float(loss))
    step = dynajax.train_step(ours, our_opt, loss_fn, mesh=mesh_of(8), sharding=rules)
    losses = [float(step(*batch)) for batch in batches]
    params = [*step.params, *step.state.values()]
    whole = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in params)
    per_device = sorted(dynajax.training.state.bytes_per_device(params).values())
    replicated = sum(
        int(np.prod(a.shape)) * a.dtype.itemsize for a in params if a.sharding.is_fully_replicated
    )
    step.sync()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "param_diff": max_diff(dict(ours.state_dict()), dict(eager.state_dict())),
        "state_diff": max_diff(optimizer_state(our_opt, ours), optimizer_state(eager_opt, eager)),
        "whole_bytes": whole,
        "replicated_bytes": replicated,
        "per_device": per_device,
        "report": step.report(),
        "traces": step.traces,
        "moment_specs": sorted(
            {str(a.sharding.spec) for (_, k), a in step.state.items() if k.startswith("exp_avg")}
        ),
    }


def restore_on_another_mesh(directory: str, uninterrupted: list[float]) -> dict[str, Any]:
    """10 steps on 8 devices, a checkpoint, then a fresh model and optimizer on 4
    devices restoring it and running the last 10 steps."""

    def fsdp_step(model: torch.nn.Module, devices: int) -> Any:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        rules = dynajax.ShardingRules.fsdp()
        return dynajax.train_step(
            model, optimizer, regression, mesh=mesh_of(devices), sharding=rules
        )

    batches = mlp_batches()
    step = fsdp_step(build_mlp(), 8)
    before = [float(step(*b)) for b in batches[:10]]
    saved_at = step.save(directory)
    torch.manual_seed(123)
    second = mlp(32, 64, 16)  # other initial values: all of them come from the checkpoint
    resumed = fsdp_step(second, 4)
    restored_at = resumed.restore(directory)
    after = [float(resumed(*b)) for b in batches[10:]]
    arrays = [*resumed.params, *resumed.state.values()]
    return {
        "saved_at": saved_at,
        "restored_at": restored_at,
        "losses": before + after,
        "uninterrupted": uninterrupted,
        "devices_after": sorted({str(d) for a in arrays for d in a.devices()}),
        "per_device_after": sorted(dynajax.training.state.bytes_per_device(arrays).values()),
        "whole_after": sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays),
        "replicated_after": sum(
            int(np.prod(a.shape)) * a.dtype.itemsize
            for a in arrays
            if a.sharding.is_fully_replicated
        ),
    }


def main() -> None:
    directory = sys.argv[1]
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)  # noqa: E731
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    facts: dict[str, Any] = {"devices": len(jax.devices())}
    facts["fsdp_mlp"] = case(
        build_mlp, adamw, regression, mlp_batches(), dynajax.ShardingRules.fsdp()
    )
    facts["dp_mlp"] = case(
        build_mlp, sgd, regression, mlp_batches(), dynajax.ShardingRules.data_parallel()
    )
    facts["fsdp_llama"] = case(
        build_llama, adamw, lm, lm_batches()[:10], dynajax.ShardingRules.fsdp()
    )
    facts["restore"] = restore_on_another_mesh(directory, facts["fsdp_mlp"]["losses"])
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
