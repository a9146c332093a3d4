"""The models of the benchmark's rows: each builder returns ``(model, args)``, built on
the CPU (``benchmarks.registry.placed`` moves them to the rows' device). Shared by the
inference rows (``benchmarks/workloads.py``) and the training rows
(``benchmarks/training.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def mlp_model(batch: int = 64) -> tuple[nn.Module, tuple[Any, ...]]:
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
    return model, (torch.randn(batch, 512),)


def encoder_model(batch: int = 8, tokens: int = 128) -> tuple[nn.Module, tuple[Any, ...]]:
    model = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    return model, (torch.randn(batch, tokens, 256),)


class _CausalSelfAttention(nn.Module):
    """A causal self-attention block as transformers write it: one input projection,
    ``F.scaled_dot_product_attention`` over (batch, heads, tokens, head dim), an output
    projection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, e // self.heads).unbind(2)
        o = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(o.transpose(1, 2).reshape(b, t, e))


def attention_model(batch: int = 8, tokens: int = 512) -> tuple[nn.Module, tuple[Any, ...]]:
    return _CausalSelfAttention(256, 4), (torch.randn(batch, tokens, 256),)


def gpt2_model(
    layers: int = 4,
    width: int = 256,
    heads: int = 4,
    vocab: int = 1024,
    batch: int = 4,
    seq: int = 128,
) -> tuple[nn.Module, tuple[Any, ...]]:
    """A GPT-2 built from its config, on (batch, seq) tokens (by default the rows'
    4-layer one)."""
    from tests.models import gpt2, tokens

    model = gpt2(layers=layers, width=width, heads=heads, vocab=vocab)
    return model, (tokens(batch, seq, vocab),)


def gpt2_small_model() -> tuple[nn.Module, tuple[Any, ...]]:
    """GPT-2 small's configuration (124M parameters)."""
    return gpt2_model(layers=12, width=768, heads=12, vocab=50257, batch=2)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """ResNet-18's shape (torchvision's layout, written in plain torch)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet_model(batch: int = 8, pixels: int = 64) -> tuple[nn.Module, tuple[Any, ...]]:
    return ResNet18(), (torch.randn(batch, 3, pixels, pixels),)
