"""Small real models shared by tests, the demo and the benchmarks (no downloads)."""

from __future__ import annotations

import torch
from torch import nn


def mlp(d_in: int = 32, hidden: int = 64, d_out: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def cnn(channels: int = 8, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(channels, channels, 3, stride=2, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, classes),
    )


def conv_mix(channels: int = 8, classes: int = 10) -> nn.Module:
    """Every convolution form of lowering/conv_algorithms.py in one network: a
    depthwise-separable block (tap sum, then matmul), a grouped 3x3, a 3x3 over a 2x2
    map (kernel wider than the map), and a transposed convolution upsampling it
    (col2im), with batch norm between (the convolutions before it have no bias: its
    gradient would be zero up to rounding)."""
    c = channels
    return nn.Sequential(
        nn.Conv2d(3, c, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(c),
        nn.ReLU(),
        nn.Conv2d(c, c, 7, padding=3, groups=c),  # depthwise 7x7
        nn.Conv2d(c, 2 * c, 1, bias=False),
        nn.BatchNorm2d(2 * c),
        nn.ReLU(),
        nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1, groups=4),  # grouped
        nn.AdaptiveAvgPool2d(2),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1),  # 3x3 over 2x2
        nn.ConvTranspose2d(2 * c, c, 4, stride=2, padding=1, bias=False),  # 2x2 -> 4x4
        nn.BatchNorm2d(c),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * c, classes),
    )


def gpt2(layers: int = 2, width: int = 64, heads: int = 4, vocab: int = 128) -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocab,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel(cfg)


def bert(layers: int = 2, width: int = 64, heads: int = 4, vocab: int = 128) -> nn.Module:
    import transformers

    cfg = transformers.BertConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        vocab_size=vocab,
        max_position_embeddings=256,
    )
    return transformers.BertModel(cfg)


def llama(layers: int = 2, width: int = 64, heads: int = 4, vocab: int = 128) -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        intermediate_size=2 * width,
        vocab_size=vocab,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def tokens(batch: int, length: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length))
