"""Small real models shared by tests, the demo and the benchmarks (no downloads)."""

from __future__ import annotations

from typing import Any

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


# -- more transformers architectures, from tiny configs (tests/test_models.py) -----------

_TINY = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 128}


def _images() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(2, 3, 32, 32)}


def _ids(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": tokens(2, 16), **extra}


def transformers_zoo() -> dict[str, Any]:
    """name -> (model builder, inputs builder): encoder-decoder, decoder-only (rotary,
    grouped-query and sliding-window attention, mixture of experts), vision and audio
    architectures of ``transformers``, small enough to compile in seconds."""
    import transformers as tf

    def seq2seq(config_cls: Any, model_cls: Any, **cfg: Any) -> Any:
        return lambda: model_cls(config_cls(vocab_size=128, d_model=64, use_cache=False, **cfg))

    layers = {"encoder_layers": 2, "decoder_layers": 2, "encoder_ffn_dim": 128}
    heads = {"encoder_attention_heads": 4, "decoder_attention_heads": 4, "decoder_ffn_dim": 128}
    decoder = {"num_hidden_layers": 2, "use_cache": False, **_TINY}
    vit = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    vit |= {"intermediate_size": 128, "image_size": 32, "patch_size": 8}
    return {
        "t5": (
            seq2seq(
                tf.T5Config,
                tf.T5ForConditionalGeneration,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
            ),
            lambda: _ids(decoder_input_ids=tokens(2, 16)),
        ),
        "bart": (
            seq2seq(tf.BartConfig, tf.BartForConditionalGeneration, **layers, **heads),
            lambda: _ids(decoder_input_ids=tokens(2, 16)),
        ),
        "whisper": (
            seq2seq(
                tf.WhisperConfig,
                tf.WhisperModel,
                **layers,
                **heads,
                num_mel_bins=16,
                max_source_positions=32,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            ),
            lambda: {"input_features": torch.randn(2, 16, 64), "decoder_input_ids": tokens(2, 16)},
        ),
        "mistral": (
            lambda: tf.MistralForCausalLM(
                tf.MistralConfig(num_key_value_heads=2, sliding_window=8, **decoder)
            ),
            _ids,
        ),
        "qwen2": (
            lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **decoder)),
            _ids,
        ),
        "gemma": (
            lambda: tf.GemmaForCausalLM(
                tf.GemmaConfig(num_key_value_heads=2, head_dim=16, **decoder)
            ),
            _ids,
        ),
        "gpt-neox": (lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**decoder)), _ids),
        "phi": (lambda: tf.PhiForCausalLM(tf.PhiConfig(**decoder)), _ids),
        "mixtral": (
            lambda: tf.MixtralForCausalLM(
                tf.MixtralConfig(
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **decoder
                )
            ),
            _ids,
        ),
        "distilbert": (
            lambda: tf.DistilBertModel(
                tf.DistilBertConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, hidden_dim=128)
            ),
            _ids,
        ),
        "deberta-v2": (
            lambda: tf.DebertaV2Model(tf.DebertaV2Config(num_hidden_layers=2, **_TINY)),
            _ids,
        ),
        "vit": (lambda: tf.ViTModel(tf.ViTConfig(**vit)), _images),
        "clip-vision": (lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(**vit)), _images),
        "swin": (
            lambda: tf.SwinModel(
                tf.SwinConfig(
                    image_size=32,
                    patch_size=4,
                    embed_dim=16,
                    depths=[1, 1],
                    num_heads=[2, 2],
                    window_size=4,
                )
            ),
            _images,
        ),
        "convnext": (
            lambda: tf.ConvNextModel(
                tf.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)
            ),
            _images,
        ),
        "mobilenet-v2": (
            lambda: tf.MobileNetV2Model(tf.MobileNetV2Config(image_size=32, depth_multiplier=0.35)),
            _images,
        ),
    }
