"""``train_step``'s optimizer update computes what eager's computes in Python doubles
(step counts, bias corrections, step sizes, decays) in float64: a float64 model trains
to eager's values within 1e-12 relative, every optimizer, 20 steps, its parameters and
every entry of its state."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _get_value

import dynajax

optim = torch.optim


class ScaledSGD(optim.Optimizer):
    """A user's optimizer: plain Python over the param groups, the bias correction of
    a step count it keeps as a tensor read with torch's ``_get_value`` (``.item()``
    where eager runs), as torch's own optimizers read theirs."""

    def __init__(self, params, lr: float, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                state["step"] += 1
                correction = 1 - group["beta"] ** _get_value(state["step"])
                p.add_(p.grad, alpha=-group["lr"] / correction)


OPTIMIZERS = {
    "SGD": functools.partial(optim.SGD, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "SGD-foreach": functools.partial(optim.SGD, lr=1e-2, momentum=0.9, foreach=True),
    "Adam": functools.partial(optim.Adam, lr=1e-2),
    "Adam-amsgrad": functools.partial(optim.Adam, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "Adam-foreach": functools.partial(optim.Adam, lr=1e-2, foreach=True),
    "Adam-fused": functools.partial(optim.Adam, lr=1e-2, fused=True),
    "AdamW": functools.partial(optim.AdamW, lr=1e-2, weight_decay=0.05),
    "Adamax": functools.partial(optim.Adamax, lr=1e-2),
    "NAdam": functools.partial(
        optim.NAdam, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01
    ),
    "RAdam": functools.partial(optim.RAdam, lr=1e-2),
    "Adagrad": functools.partial(optim.Adagrad, lr=1e-2, lr_decay=0.01),
    "Adadelta": functools.partial(optim.Adadelta, lr=0.5),
    "RMSprop": functools.partial(optim.RMSprop, lr=1e-2, momentum=0.5, centered=True),
    "Rprop": functools.partial(optim.Rprop, lr=1e-2),
    "ASGD": functools.partial(optim.ASGD, lr=1e-2, t0=5),
    # (its foreach form computes each new eta from the step tensor in float32, where the
    # single-tensor form rounds a double: training fuzzer seed 132, --float64)
    "ASGD-foreach": functools.partial(optim.ASGD, lr=5e-2, alpha=0.75, t0=5, foreach=True),
    "user-subclass": functools.partial(ScaledSGD, lr=1e-2),
}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_float64_training_is_eagers_to_1e_12(name: str) -> None:
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = _mlp().double()
    eager = copy.deepcopy(model)
    eager_opt = make(eager.parameters())
    optimizer = make(model.parameters())
    step = dynajax.train_step(model, optimizer, _loss)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randn(8, 16, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (8,), generator=g)
        step(x, y)
        eager_opt.zero_grad()
        _loss(eager, x, y).backward()
        eager_opt.step()
    step.sync()
    _assert_trained_alike(model, optimizer, eager, eager_opt)


def _assert_trained_alike(
    model: nn.Module, optimizer: optim.Optimizer, eager: nn.Module, eager_opt: optim.Optimizer
) -> None:
    """Every parameter and optimizer state entry within 1e-12 relative of eager's."""
    for (n, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        _assert_relative(p.detach(), q.detach(), n)
        got, want = optimizer.state[p], eager_opt.state[q]
        assert sorted(got) == sorted(want)
        for key in want:
            _assert_relative(got[key], want[key], f"{n}: {key}")


def _assert_relative(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within 1e-12 relative, element by element, or of the tensor's largest element
    for an element that is a small difference of larger values (RMSprop's momentum
    entry that cancelled to 1.5e-3: 4e-15 from eager's, the gradients' roundings in
    XLA and in eager's kernels, which differ by an ulp)."""
    assert actual.dtype == expected.dtype, what
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual, expected, rtol=1e-12, atol=1e-12 * scale, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize("name", ["ASGD", "ASGD-foreach", "NAdam"])
def test_a_rewind_that_casts_scalar_state_to_float64_is_eagers(name: str) -> None:
    # optimizer.load_state_dict casts each 0-d state entry but ``step`` to its
    # parameter's dtype (ASGD's eta and mu, NAdam's mu_product: float32 made, float64
    # loaded); eager then writes each new eta and mu as a float32 (``torch.as_tensor``
    # of a double) into the float64 entry (training fuzzer seed 132, --float64).
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = _mlp().double()
    eager = copy.deepcopy(model)
    eager_opt = make(eager.parameters())
    optimizer = make(model.parameters())
    step = dynajax.train_step(model, optimizer, _loss)
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(8, 16, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (8,), generator=g),
        )
        for _ in range(6)
    ]

    def run(train, module: nn.Module, opt: optim.Optimizer) -> None:  # type: ignore[no-untyped-def]
        train(*batches[0])
        saved = copy.deepcopy(module.state_dict()), copy.deepcopy(opt.state_dict())
        train(*batches[1])
        module.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        for batch in batches[2:]:
            train(*batch)

    def eager_step(x: torch.Tensor, y: torch.Tensor) -> None:
        eager_opt.zero_grad()
        _loss(eager, x, y).backward()
        eager_opt.step()

    run(eager_step, eager, eager_opt)
    run(step, model, optimizer)
    step.sync()
    _assert_trained_alike(model, optimizer, eager, eager_opt)
