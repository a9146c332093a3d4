"""Warm starts of ``train_step``: a step's programs persist in the cache directory,
keyed by the step's first trace, so a second process loads them (no functionalization,
lowering or XLA compile) and trains exactly as the first did, and anything that changes
the step (the model's code, a tensor constant, the options) is another program."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import dynajax
from dynajax.training.graph import describe_optimizer
from tests.helpers import run_python
from tests.training.warm_start_worker import Model


def _worker(variant: str, cache: str, *flags: str) -> dict:
    return json.loads(
        run_python(
            "-m", "tests.training.warm_start_worker", variant, *flags, DYNAJAX_CACHE_DIR=cache
        )
    )


def _eager_losses(variant: str) -> list[float]:
    """The worker's run, in eager PyTorch."""
    torch.manual_seed(0)
    model = Model(variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 16, (4, 5), generator=g)
        y = torch.randn(4, 1, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(ids), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_second_process_loads_the_programs_and_trains_as_the_first(tmp_path) -> None:
    cache = str(tmp_path)
    cold = _worker("relu", cache, "--bad-batch")
    warm = _worker("relu", cache, "--bad-batch")
    # One program, every step's (AdamW's state made before the first step).
    assert (cold["compiles"], cold["hits"]) == (1, 0), cold
    assert (warm["compiles"], warm["hits"]) == (0, 1), warm
    assert warm["losses"] == cold["losses"] and warm["params"] == cold["params"]
    np.testing.assert_allclose(warm["losses"], _eager_losses("relu"), rtol=1e-5)
    # AdamW is torch's own: what keys the program is the trace up to its update. The
    # cold run traced the whole step; the warm one stopped its trace at the update.
    assert cold["traced"] == [True], cold
    assert warm["traced"] == [False], warm
    # eager's value checks came with the loaded program: the bad batch raises eager's
    # error and changes nothing (the same parameters as the cold run's).
    assert warm["error"] == cold["error"] == "index out of range in self"
    assert warm["steps"] == 3
    # Another forward over the same parameters (gelu for relu) is another program.
    other = _worker("gelu", cache)
    assert (other["compiles"], other["hits"]) == (1, 0), other
    np.testing.assert_allclose(other["losses"], _eager_losses("gelu"), rtol=1e-5)


def test_a_first_step_of_its_own_is_loaded_and_the_second_found_untraced(tmp_path) -> None:
    # SGD's momentum buffer is a copy of the first gradient: the first step has a
    # program of its own, which creates it. The warm run stops its first trace at the
    # update, and finds the second step's program with no trace at all (the trace up to
    # the update is kept per batch signature).
    cold = _worker("relu", str(tmp_path), "--momentum")
    warm = _worker("relu", str(tmp_path), "--momentum")
    assert (cold["compiles"], cold["hits"]) == (2, 0), cold
    assert (warm["compiles"], warm["hits"]) == (0, 2), warm
    assert cold["traced"] == [True, True], cold
    assert warm["traced"] == [False], warm
    assert warm["losses"] == cold["losses"] and warm["params"] == cold["params"]


def test_a_random_step_loads_and_draws_the_same_numbers(tmp_path) -> None:
    cold = _worker("dropout", str(tmp_path))
    warm = _worker("dropout", str(tmp_path))
    assert (warm["compiles"], warm["hits"]) == (0, 1), warm
    assert warm["losses"] == cold["losses"] and warm["params"] == cold["params"]


def _run(step: dynajax.TrainStep, x: torch.Tensor) -> float:
    loss = float(step(x))
    step.sync()
    return loss


def test_a_tensor_constant_keys_the_program(tmp_path, monkeypatch) -> None:
    # A tensor the loss closes over is a constant of the trace, the same graph text for
    # any value: its value is part of the key.
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path))
    x = torch.randn(8, 4)

    def losses(target: torch.Tensor) -> tuple[float, float, dynajax.TrainStep]:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        eager = nn.Linear(4, 3)
        eager.load_state_dict(model.state_dict())
        step = dynajax.train_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            lambda m, x: (m(x) - target).square().mean(),
        )
        _run(step, x)
        loss = _run(step, x)
        opt = torch.optim.SGD(eager.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            expected = (eager(x) - target).square().mean()
            expected.backward()
            opt.step()
        return loss, expected.item(), step

    first = losses(torch.zeros(3))
    second = losses(torch.full((3,), 5.0))
    third = losses(torch.zeros(3))
    for loss, expected, _ in (first, second, third):
        assert loss == pytest.approx(expected, rel=1e-6)
    assert first[2].compile_stats.cache_hits == 0
    assert second[2].compile_stats.cache_hits == 0  # another constant: not the first's
    assert third[2].compile_stats.cache_hits == 1  # the first's constant: its program
    assert third[2].compile_stats.xla_compiles == 0


def test_a_step_running_pytorchs_kernel_is_loaded_by_a_second_process(tmp_path) -> None:
    # An op kept in PyTorch runs its kernel inside the program (dynajax/ffi): the
    # program is stored, and a fresh process registers the handler to load it.
    cold = _worker("callback", str(tmp_path))
    warm = _worker("callback", str(tmp_path))
    assert (cold["compiles"], cold["hits"]) == (1, 0), cold
    assert (warm["compiles"], warm["hits"]) == (0, 1), warm
    assert warm["losses"] == cold["losses"] and warm["params"] == cold["params"]
    np.testing.assert_allclose(warm["losses"], _eager_losses("callback"), rtol=1e-5)


def test_a_step_with_host_callbacks_compiles_in_every_process(tmp_path, monkeypatch) -> None:
    # An op run by eager PyTorch through a Python host callback (the kernels off) is
    # Python the executable calls: the program cannot be serialized, so it is compiled
    # again (and gives eager's answer).
    monkeypatch.setenv("DYNAJAX_TORCH_KERNELS", "0")
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path))
    x = torch.randn(8, 4)
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
        step = dynajax.train_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            lambda m, x: m(x).square().mean(),
            fallback_ops=["aten.relu"],
        )
        loss = _run(step, x)
        assert step.compile_stats.xla_compiles == 1 and step.compile_stats.cache_hits == 0
        torch.manual_seed(0)
        eager = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
        assert loss == pytest.approx(eager(x).square().mean().item(), rel=1e-6)


def _train(
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], x: torch.Tensor
) -> tuple[list[float], list[float], dynajax.TrainStep]:
    """Three steps of ``train_step`` and of eager on the same model and optimizer."""
    losses = []
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    eager = nn.Linear(4, 3)
    eager.load_state_dict(model.state_dict())
    step = dynajax.train_step(
        model, make_optimizer(list(model.parameters())), lambda m, x: m(x).square().mean()
    )
    losses = [_run(step, x) for _ in range(3)]
    opt = make_optimizer(list(eager.parameters()))
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = eager(x).square().mean()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    return losses, expected, step


def test_a_hyperparameter_keys_the_program(tmp_path, monkeypatch) -> None:
    # Of torch's own optimizers the configuration keys the update (not its trace):
    # another weight decay, or another class over the same parameters, is a miss.
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path))
    x = torch.randn(8, 4)
    runs = [
        _train(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01), x),
        _train(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.5), x),
        _train(lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.5), x),
        _train(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01), x),
    ]
    for losses, expected, _ in runs:
        np.testing.assert_allclose(losses, expected, rtol=1e-5)
    stats = [step.compile_stats for _, _, step in runs]
    assert "keyed by the trace up to AdamW's update" in runs[0][2].report()
    assert [(s.xla_compiles, s.cache_hits) for s in stats] == [(1, 0), (1, 0), (1, 0), (0, 1)]


# What the hand-written optimizers below multiply the gradient by: Python the user
# changes between runs, which no configuration shows.
_SCALE = {"by": 1.0}


class _ScaledSGD(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.mul_(_SCALE["by"])
        return super().step(closure)


def _scale_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad.mul_(_SCALE["by"])


@pytest.mark.parametrize("how", ["subclass", "step hook"])
def test_an_optimizer_of_the_users_code_is_keyed_by_its_trace(tmp_path, monkeypatch, how) -> None:
    # A subclass's step, or a hook around torch's, is the user's Python: its trace keys
    # the program, so a change of what it computes is another program (keyed by the
    # class's configuration alone, the second run would load the first's).
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(_SCALE, "by", 1.0)
    x = torch.randn(8, 4)

    def make(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        if how == "subclass":
            return _ScaledSGD(ps, lr=0.1, momentum=0.9)
        opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
        opt.register_step_pre_hook(_scale_before_step)
        return opt

    first = _train(make, x)
    monkeypatch.setitem(_SCALE, "by", 3.0)
    second = _train(make, x)
    for losses, expected, _ in (first, second):
        np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert first[0] != second[0]
    assert second[2].compile_stats.cache_hits == 0
    assert "keyed by the whole step's trace" in second[2].report()


def test_only_torchs_own_optimizers_are_described_by_their_configuration() -> None:
    params = list(nn.Linear(2, 2).parameters())
    plain = describe_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert plain is not None and "SGD" in plain
    assert describe_optimizer(torch.optim.SGD(params, lr=0.5, momentum=0.9)) == plain  # lr: input
    assert describe_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.8)) != plain
    assert describe_optimizer(_ScaledSGD(params, lr=0.1)) is None
    patched = torch.optim.SGD(params, lr=0.1)
    patched.step = lambda closure=None: None  # type: ignore[method-assign]
    assert describe_optimizer(patched) is None
    # An LR scheduler wraps the step (to note it was called): still torch's update.
    scheduled = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    torch.optim.lr_scheduler.StepLR(scheduled, step_size=3)
    described = describe_optimizer(scheduled)  # (its groups gain "initial_lr")
    assert "step" in vars(scheduled) and described is not None and "SGD" in described
    torch.optim.lr_scheduler.ExponentialLR(scheduled, gamma=0.9)  # (wraps it once)
    assert describe_optimizer(scheduled) == described
    hooked = torch.optim.SGD(params, lr=0.1)
    handle = hooked.register_step_post_hook(lambda *args: None)
    assert describe_optimizer(hooked) is None
    handle.remove()
    assert describe_optimizer(hooked) is not None
    handle = register_optimizer_step_pre_hook(lambda *args: None)
    try:
        assert describe_optimizer(hooked) is None
    finally:
        handle.remove()
