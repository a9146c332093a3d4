"""The backward graph of each common layer runs in JAX and gives eager's gradients
(for the input and every parameter). These are the ops that appear in backward graphs
after core ATen decompositions: convolution_backward, the pooling backwards, and the
decomposed forms of threshold/gelu/softmax/norm/embedding backwards."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from tests.helpers import measured_faster, param_grads
from tests.tolerances import assert_same
from tests.training.harness import assert_all_in_jax

Case = tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]


def _img(c: int = 3, size: int = 9) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(2, c, size, size)


def _seq() -> torch.Tensor:
    return torch.randn(2, 5, 12)


class _Fn(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _activations(x: torch.Tensor) -> torch.Tensor:
    return (
        F.relu(x)
        + F.gelu(x) * 2
        + F.gelu(x, approximate="tanh") * 3
        + F.silu(x) * 4
        + F.elu(x) * 5
        + F.leaky_relu(x, 0.1) * 6
        + F.hardtanh(x) * 7
        + F.softplus(x) * 8
        + torch.tanh(x) * torch.sigmoid(x)
        + torch.softmax(x, -1) * 9
        + torch.log_softmax(x, -1)
    )


CASES: dict[str, Case] = {
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), _img()),
    "conv2d-groups-dilation": (lambda: nn.Conv2d(4, 4, 3, dilation=2, groups=2), _img(4)),
    "conv1d-nobias": (lambda: nn.Conv1d(5, 3, 3, bias=False), lambda: torch.randn(2, 5, 11)),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1), _img()),
    "max_pool2d-overlapping": (lambda: nn.MaxPool2d(3, stride=2, padding=1), _img()),
    "max_pool2d-ceil": (lambda: nn.MaxPool2d(2, ceil_mode=True), _img()),
    "avg_pool2d": (lambda: nn.AvgPool2d(3, stride=2, padding=1), _img()),
    "adaptive_avg_pool2d": (lambda: nn.AdaptiveAvgPool2d((2, 3)), _img()),
    "batch_norm2d": (lambda: nn.BatchNorm2d(3), _img()),
    "batch_norm2d-eval": (lambda: nn.BatchNorm2d(3).eval(), _img()),
    "adaptive_max_pool2d": (lambda: nn.AdaptiveMaxPool2d(2), _img()),
    "upsample-bilinear": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), _img(3, 5)),
    "replication_pad2d": (lambda: nn.ReplicationPad2d(2), _img(3, 5)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), _img(4)),
    "layer_norm": (lambda: nn.LayerNorm(12), _seq),
    # One case for the pointwise activations and softmaxes (one compile instead of 11).
    "activations-softmax": (lambda: _Fn(_activations), _seq),
    "linear": (lambda: nn.Linear(12, 7), _seq),
    "sdpa-causal": (
        lambda: _Fn(lambda x: F.scaled_dot_product_attention(x, x * 2, x, is_causal=True)),
        lambda: torch.randn(2, 3, 5, 8),
    ),
}


class _MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(12, 3, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb((x.abs() * 3).long() % 10).mean(-1) * x


CASES["multihead_attention"] = (_MHA, _seq)
_KEEP = torch.rand(5, 5) > 0.3
_KEEP[:, 0] = True  # no fully masked row
CASES["sdpa-bool_mask"] = (
    lambda: _Fn(lambda x: F.scaled_dot_product_attention(x, x * 2, x.sin(), attn_mask=_KEEP)),
    lambda: torch.randn(2, 3, 5, 8),
)
CASES["sdpa-float_mask-scale"] = (
    lambda: _Fn(
        lambda x: F.scaled_dot_product_attention(
            x, x.cos(), x * 3, attn_mask=torch.linspace(-1, 1, 25).reshape(5, 5), scale=0.3
        )
    ),
    lambda: torch.randn(2, 3, 5, 8),
)
CASES["sdpa-gqa"] = (
    lambda: _Fn(
        lambda x: F.scaled_dot_product_attention(x, x[:, :2].cos(), x[:, :2] * 3, enable_gqa=True)
    ),
    lambda: torch.randn(2, 4, 5, 8),
)
CASES["embedding-padding_idx"] = (_Embed, _seq)
CASES["cross_entropy"] = (
    lambda: _Fn(lambda x: F.cross_entropy(x.flatten(0, 1), torch.arange(10) % 12)),
    _seq,
)
CASES["mse_loss"] = (lambda: _Fn(lambda x: F.mse_loss(x, torch.ones_like(x))), _seq)


@pytest.mark.parametrize("name", list(CASES))
def test_layer_backward_matches_eager(name: str) -> None:
    make, make_input = CASES[name]
    torch.manual_seed(0)
    layer = make()
    twin = copy.deepcopy(layer)
    x = make_input().requires_grad_()
    xc = x.detach().clone().requires_grad_()
    grad_seed = None

    def loss(out: torch.Tensor) -> torch.Tensor:
        nonlocal grad_seed
        if grad_seed is None:
            grad_seed = torch.randn(out.shape)
        return (out * grad_seed).sum()  # a non-uniform output gradient

    loss(layer(x)).backward()
    backend = dynajax.Backend()
    with measured_faster("xla"):  # (each layer's lowering is the point, on any CPU)
        loss(torch.compile(twin, backend=backend)(xc)).backward()
    assert_same(xc.grad, x.grad, model=True, path="grad[input]")
    assert_same(param_grads(twin), param_grads(layer), model=True, path="grad")
    assert_all_in_jax(backend, "forward")
    assert_all_in_jax(backend, "backward")
