"""Train a model eagerly and compiled side by side, and compare everything that changes.

Both copies start from the same weights, see the same batches, and take the same
optimizer steps; after every step the loss is compared, and at the end the gradients,
parameters and buffers (BatchNorm running statistics, ``num_batches_tracked``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import dynajax
from tests.helpers import measured_faster, param_grads
from tests.tolerances import assert_same

LossFn = Callable[[Callable[..., Any], Any], torch.Tensor]
MakeOpt = Callable[[Any], torch.optim.Optimizer]


@dataclasses.dataclass
class Trace:
    """What one training run produced."""

    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    state: dict[str, torch.Tensor]


def train(
    model: nn.Module,
    batches: Sequence[Any],
    loss_fn: LossFn,
    make_opt: MakeOpt,
    *,
    backend: dynajax.Backend | None = None,
    compile_step: bool = False,
) -> Trace:
    """Runs one optimizer step per batch; compiles the model when ``backend`` is given
    (and the optimizer step too with ``compile_step``)."""
    opt = make_opt(model.parameters())
    fn = torch.compile(model, backend=backend) if backend is not None else model
    step = torch.compile(opt.step, backend=backend) if compile_step else opt.step
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(fn, batch)
        loss.backward()
        losses.append(loss.detach().clone())
        step()
    grads = param_grads(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Trace(losses, grads, state)


def compare_training(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Any],
    loss_fn: LossFn,
    make_opt: MakeOpt,
    *,
    compile_step: bool = False,
) -> tuple[dynajax.Backend, Trace]:
    """Trains an eager and a compiled copy of the same model; asserts they agree.

    The cost choices measured at the first compile come out XLA-faster (the measuring
    runs, its times are fixed: ``measured_faster``), so that every op's forward and
    backward rules are trained through on any CPU (``assert_all_in_jax``).

    Returns the backend (for its graph reports) and the compiled run's trace."""
    torch.manual_seed(0)
    eager_model = make_model()
    compiled_model = copy.deepcopy(eager_model)
    backend = dynajax.Backend()
    expected = train(eager_model, batches, loss_fn, make_opt)
    with measured_faster("xla"):
        actual = train(
            compiled_model, batches, loss_fn, make_opt, backend=backend, compile_step=compile_step
        )
    for i, (a, e) in enumerate(zip(actual.losses, expected.losses, strict=True)):
        assert_same(a, e, model=True, path=f"loss[step {i}]")
    assert_same(actual.grads, expected.grads, model=True, path="grad")
    assert_same(actual.state, expected.state, model=True, path="state")
    return backend, actual


def kinds(backend: dynajax.Backend) -> list[str]:
    return [g.kind for g in backend.graphs]


def assert_all_in_jax(backend: dynajax.Backend, kind: str) -> None:
    """Every graph of ``kind`` was compiled and ran entirely in JAX partitions."""
    graphs = [g for g in backend.graphs if g.kind == kind]
    assert graphs, f"no {kind} graph was compiled (got {kinds(backend)})"
    for g in graphs:
        assert g.partitions, f"{kind} graph {g.index} has no JAX partition"
        assert not g.fallbacks, f"{kind} graph {g.index} kept ops in PyTorch: " + ", ".join(
            f"{f.target} ({f.reason.name} {f.detail})" for f in g.fallbacks
        )


def count_barriers(monkeypatch: Any, tmp_path: Any, orders_update: bool) -> list[int]:
    """For each program ``train_step`` lowers from here on (in its own cache directory:
    a program loaded from the session's is not lowered), the number of barriers that
    order an update (``orders_update``) or keep a recomputation (not), appended to the
    list returned."""
    from dynajax.passes.inplace import ORDERS_UPDATE
    from dynajax.passes.recompute import BARRIER
    from dynajax.program import driver

    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path))
    seen: list[int] = []
    lower = driver.lower

    def spy(gm: Any, policy: Any) -> Any:
        program = lower(gm, policy)
        seen.append(
            sum(
                n.target is BARRIER and bool(n.meta.get(ORDERS_UPDATE)) == orders_update
                for n in program.gm.graph.nodes
            )
        )
        return program

    monkeypatch.setattr("dynajax.training.program.lower", spy)
    return seen
