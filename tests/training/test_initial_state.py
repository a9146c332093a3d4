"""The optimizer's state made before its first step (``training/initial.py``): the first
step then runs the steady program, one compile where there were two, and every step is
eager's (float64 models: within 1e-12 relative, as ``test_optimizer_precision``)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from dynajax.training.initial import initial_state
from tests.training.test_optimizer_precision import _assert_trained_alike
from tests.training.test_train_step import _eager_losses

# torch's optimizers whose state starts as constants, with options that add entries.
MADE_BEFORE = {
    "Adam": functools.partial(torch.optim.Adam, lr=1e-2, amsgrad=True),
    "AdamW": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.05),
    "Adamax": functools.partial(torch.optim.Adamax, lr=1e-2),
    "NAdam": functools.partial(torch.optim.NAdam, lr=1e-2),
    "RAdam": functools.partial(torch.optim.RAdam, lr=1e-2),
    "Adagrad": functools.partial(torch.optim.Adagrad, lr=1e-2, initial_accumulator_value=0.5),
    "Adadelta": functools.partial(torch.optim.Adadelta, lr=0.5),
    "RMSprop": functools.partial(torch.optim.RMSprop, lr=1e-2, momentum=0.5, centered=True),
    "Rprop": functools.partial(torch.optim.Rprop, lr=3e-2),
}


class ScaledAdam(torch.optim.Adam):
    """An optimizer of the user's code: its step may compute its first step otherwise."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        return super().step(closure)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3)).double()


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(6, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 3, (6,), generator=gen),
        )
        for _ in range(n)
    ]


def _assert_state_alike(eager_opt, our_opt, eager, ours) -> None:
    _assert_trained_alike(ours, our_opt, eager, eager_opt)
    assert [len(our_opt.state.get(p, {})) for p in ours.parameters()] == [
        len(eager_opt.state.get(p, {})) for p in eager.parameters()
    ]


@pytest.mark.parametrize("name", list(MADE_BEFORE))
def test_the_state_made_is_what_the_first_step_creates(name: str) -> None:
    model = _mlp()
    optimizer = MADE_BEFORE[name](model.parameters())
    params = list(model.parameters())
    lrs = [g["lr"] for g in optimizer.param_groups]
    optimizer.state.clear()  # (Adagrad makes its state in its constructor)
    starts = initial_state(optimizer, params, range(len(params)), lrs)
    assert starts is not None and not optimizer.state  # (the optimizer's own untouched)
    made = {key: start.tensor() for key, start in starts.items()}
    # Eager's first step creates the same entries, dtypes and shapes...
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    created = {(i, k): v for i, p in enumerate(params) for k, v in optimizer.state[p].items()}
    assert created.keys() == made.keys()
    for key, value in created.items():
        assert (made[key].dtype, made[key].shape) == (value.dtype, value.shape), key
    # ... and the values torch's documentation gives them before the update: zeros,
    # but Adagrad's initial_accumulator_value, Rprop's step size (the learning rate)
    # and NAdam's mu_product (one).
    values = {"sum": 0.5, "step_size": 3e-2, "mu_product": 1.0}
    for (i, key), value in made.items():
        expected = torch.full(value.shape, values.get(key, 0.0), dtype=value.dtype)
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=f"{(i, key)}")


def test_state_that_copies_the_gradient_is_left_to_the_step() -> None:
    model = _mlp()
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)  # (its buffer: the first gradient)
    assert initial_state(sgd, params, range(len(params)), [0.1]) is None
    plain = torch.optim.SGD(params, lr=0.1)  # (no state at all)
    assert initial_state(plain, params, range(len(params)), [0.1]) == {}
    users = ScaledAdam(params, lr=0.1)
    assert initial_state(users, params, range(len(params)), [0.1]) is None
    # ASGD's eta: torch.as_tensor(lr, device=...), made without an op to see
    asgd = torch.optim.ASGD(params, lr=0.1)
    assert initial_state(asgd, params, range(len(params)), [0.1]) is None


@pytest.mark.parametrize("name", list(MADE_BEFORE))
def test_one_program_for_every_step(name: str) -> None:
    eager, ours = _mlp(), _mlp()
    eager_opt = MADE_BEFORE[name](eager.parameters())
    our_opt = MADE_BEFORE[name](ours.parameters())
    batches = _batches()
    expected = _eager_losses(eager, eager_opt, _loss, batches)
    step = dynajax.train_step(ours, our_opt, _loss)
    actual = [float(step(*batch)) for batch in batches]
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=0)
    assert step.traces == 1
    assert step.compile_stats.xla_compiles + step.compile_stats.cache_hits == 1
    step.sync()
    _assert_state_alike(eager_opt, our_opt, eager, ours)


@pytest.mark.parametrize(
    "make",
    [
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        functools.partial(ScaledAdam, lr=1e-2),
        functools.partial(torch.optim.ASGD, lr=2e-2, t0=2),
    ],
    ids=["sgd_momentum", "users_optimizer", "asgd"],
)
def test_state_the_step_computes_keeps_its_first_program(make) -> None:
    eager, ours = _mlp(), _mlp()
    eager_opt, our_opt = make(eager.parameters()), make(ours.parameters())
    batches = _batches()
    expected = _eager_losses(eager, eager_opt, _loss, batches)
    step = dynajax.train_step(ours, our_opt, _loss)
    actual = [float(step(*batch)) for batch in batches]
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=0)
    assert step.traces == 2  # the first step (it creates the state), then the rest
    step.sync()
    _assert_state_alike(eager_opt, our_opt, eager, ours)


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_parameter_without_a_gradient_gets_no_state() -> None:
    # Eager's Adam creates no state for a parameter that got no gradient: the state
    # made for it is dropped, and the step traced again without; the others' is kept
    # (one program for every step still).
    eager, ours = _WithUnused().double(), _WithUnused().double()
    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-2)
    our_opt = torch.optim.Adam(ours.parameters(), lr=1e-2)
    batches = _batches()
    expected = _eager_losses(eager, eager_opt, _loss, batches)
    step = dynajax.train_step(ours, our_opt, _loss)
    actual = [float(step(*batch)) for batch in batches]
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=0)
    assert step.traces == 2  # (the trace that found it, then the step's)
    assert step.compile_stats.xla_compiles + step.compile_stats.cache_hits == 1
    step.sync()
    assert [len(our_opt.state.get(p, {})) for p in ours.parameters()] == [3, 3, 0, 0]
    _assert_state_alike(eager_opt, our_opt, eager, ours)


def test_a_first_step_that_raises_leaves_no_state() -> None:
    # Eager raises in the loss (a target out of range), before the optimizer's step:
    # its state stays empty, and so does the step's; the next step is eager's first.
    eager, ours = _mlp(), _mlp()
    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-2)
    our_opt = torch.optim.Adam(ours.parameters(), lr=1e-2)
    step = dynajax.train_step(ours, our_opt, _loss)
    bad = (torch.randn(6, 8, dtype=torch.float64), torch.full((6,), 7))
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        _loss(eager, *bad)
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        step(*bad)
    assert step.state == {}
    step.sync()
    assert not our_opt.state
    batches = _batches()
    expected = _eager_losses(eager, eager_opt, _loss, batches)
    actual = [float(step(*batch)) for batch in batches]
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=0)
    step.sync()
    _assert_state_alike(eager_opt, our_opt, eager, ours)
