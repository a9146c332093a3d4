"""Autograd through compiled graphs: custom autograd.Function, inputs of which only
some require grad, gradient accumulation, fallback inside the backward graph, and the
inference path under no_grad / inference_mode."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from tests import models
from tests.helpers import param_grads
from tests.tolerances import assert_same
from tests.training.harness import assert_all_in_jax, kinds


class _ClampStraightThrough(torch.autograd.Function):
    """Forward clamps to [-0.5, 0.5]; backward passes the gradient through scaled by 3,
    which autodiff of the forward would never produce."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(-0.5, 0.5)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3.0 + x * 0.0


class _CustomModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(_ClampStraightThrough.apply(self.a(x)))


def test_custom_autograd_function_uses_its_backward() -> None:
    torch.manual_seed(0)
    model = _CustomModel()
    twin, plain = copy.deepcopy(model), copy.deepcopy(model)
    backend = dynajax.Backend()
    x = torch.randn(4, 8)
    model(x).square().sum().backward()
    torch.compile(twin, backend=backend)(x).square().sum().backward()
    assert_same(param_grads(twin), param_grads(model), model=True, path="grad")
    # The custom backward (x3), not the clamp's derivative, reached the first layer:
    # autodiff of the same forward gives the first layer other gradients.
    plain.b(plain.a(x).clamp(-0.5, 0.5)).square().sum().backward()
    assert not torch.allclose(param_grads(plain)["a.bias"], param_grads(model)["a.bias"])
    assert_all_in_jax(backend, "backward")


def test_only_some_inputs_require_grad() -> None:
    torch.manual_seed(0)

    def f(x, y, w):
        return (torch.tanh(x @ w) * y).sum()

    x = torch.randn(4, 6, requires_grad=True)
    y = torch.randn(4, 3)  # no grad
    w = torch.randn(6, 3, requires_grad=True)
    backend = dynajax.Backend()
    xc, wc = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.compile(f, backend=backend)(xc, y, wc).backward()
    f(x, y, w).backward()
    assert_same(xc.grad, x.grad)
    assert_same(wc.grad, w.grad)
    assert y.grad is None
    assert_all_in_jax(backend, "backward")


def test_frozen_parameters_get_no_gradient() -> None:
    torch.manual_seed(0)
    model = models.mlp()
    model[0].requires_grad_(False)
    twin = copy.deepcopy(model)
    x, y = torch.randn(4, 32), torch.randn(4, 16)
    F.mse_loss(model(x), y).backward()
    F.mse_loss(torch.compile(twin, backend="dynajax")(x), y).backward()
    assert twin[0].weight.grad is None and twin[0].bias.grad is None
    assert_same(param_grads(twin), param_grads(model), model=True, path="grad")


def test_gradient_accumulation_over_several_backward_calls() -> None:
    torch.manual_seed(0)
    model = models.mlp()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="dynajax")
    for _ in range(3):
        x, y = torch.randn(4, 32), torch.randn(4, 16)
        (F.mse_loss(model(x), y) / 3).backward()
        (F.mse_loss(compiled(x), y) / 3).backward()
    assert_same(param_grads(twin), param_grads(model), model=True, path="grad")


def test_backward_graph_falls_back_per_op() -> None:
    """An op kept in PyTorch inside the backward graph: gradients still match."""
    torch.manual_seed(0)
    model = models.mlp()
    twin = copy.deepcopy(model)
    backend = dynajax.Backend(fallback_ops=["aten.threshold_backward", "aten.le"])
    x, y = torch.randn(4, 32), torch.randn(4, 16)
    F.mse_loss(model(x), y).backward()
    F.mse_loss(torch.compile(twin, backend=backend)(x), y).backward()
    assert_same(param_grads(twin), param_grads(model), model=True, path="grad")
    backward = [g for g in backend.graphs if g.kind == "backward"]
    assert backward, kinds(backend)
    kept = {f.target for g in backward for f in g.fallbacks if f.reason.name == "USER_FALLBACK"}
    assert kept, "the backward graph kept nothing in PyTorch"
    assert all(g.partitions for g in backward), "the rest of the backward left JAX"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_takes_the_inference_path(mode: str) -> None:
    torch.manual_seed(0)
    model = models.mlp()  # parameters require grad
    backend = dynajax.Backend()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 32)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        out = compiled(x)
        expected = model(x)
    assert_same(out, expected, model=True)
    assert kinds(backend) == ["inference"]
    assert_all_in_jax(backend, "inference")
    assert not out.requires_grad
