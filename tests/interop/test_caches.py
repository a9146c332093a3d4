"""transformers models as shipped: their default configs (``use_cache=True``) through
``jax_function`` and ``export``, caches in and out as dicts of arrays, and greedy
decoding in JAX with a static cache equal to ``generate``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
import transformers

import dynajax
from dynajax.errors import JaxFunctionError

T = transformers

DECODER = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SEQ2SEQ = dict(
    vocab_size=64,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
)
CAUSAL = {
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**DECODER)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DECODER)),
}


def _build(make: Any) -> Any:
    torch.manual_seed(0)
    model = make().eval()
    assert model.config.use_cache  # the default config, as shipped
    return model


def _assert_tree_close(got: Any, expected: Any) -> None:
    """``got`` (JAX values) equals ``expected`` (torch values, caches included)."""
    want = dynajax.jax_values(expected)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=2e-6)


def _cache_arguments(model: Any, cache: Any) -> tuple[Any, ...]:
    """The positional arguments before ``cache`` in the model's forward (None each)."""
    import inspect

    names = list(inspect.signature(model.forward).parameters)
    return (None,) * (names.index("cache") - 1)


@pytest.mark.parametrize("name", list(CAUSAL))
def test_a_default_config_decoder_returns_its_cache_and_takes_it_back(name: str) -> None:
    model = _build(CAUSAL[name])
    ids, nxt = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 1))
    with torch.no_grad():
        first = model(ids)
        expected_first = model(ids)  # a fresh cache: the next call extends `first`'s
        second = model(nxt, *_cache_arguments(model, None), first.cache)
    fn, state = dynajax.jax_function(model, ids)
    out = jax.jit(fn)(state, ids.numpy())
    assert set(out["cache"]) == {"key_cache", "value_cache"}
    _assert_tree_close(out, expected_first)
    # The decode step takes the cache fn returned (its dict) where torch takes the object.
    before = _cache_arguments(model, None)
    step, _ = dynajax.jax_function(model, nxt, *before, expected_first.cache)
    out2 = jax.jit(step)(state, nxt.numpy(), *before, out["cache"])
    _assert_tree_close(out2, second)


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_a_default_config_encoder_decoder_returns_its_cache(name: str) -> None:
    if name == "t5":
        model = _build(lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
        )))  # fmt: skip
        inputs = torch.randint(0, 64, (2, 8))
    elif name == "bart":
        model = _build(lambda: T.BartForConditionalGeneration(T.BartConfig(**SEQ2SEQ)))
        inputs = torch.randint(0, 64, (2, 8))
    else:
        model = _build(lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
            **SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        )))  # fmt: skip
        inputs = torch.randn(2, 8, 32)  # (batch, mel bins, frames): 2 x frames positions
    decoder_ids = torch.randint(0, 64, (2, 5))
    # input_ids / input_features, attention_mask, decoder_input_ids
    fn, state = dynajax.jax_function(model, inputs, None, decoder_ids)
    out = jax.jit(fn)(state, inputs.numpy(), None, decoder_ids.numpy())
    with torch.no_grad():
        expected = model(inputs, None, decoder_ids)
    assert set(out["cache"]) == {"self_attention_cache", "cross_attention_cache"}
    _assert_tree_close(out, expected)
    if name == "t5":  # a StableHLO program too, which runs without torch
        exported = dynajax.export(model, inputs, None, decoder_ids)
        _assert_tree_close(exported.call(inputs, None, decoder_ids), expected)


def test_export_takes_a_cache_as_the_object_or_its_dict() -> None:
    model = _build(CAUSAL["llama"])
    ids, nxt = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 1))
    with torch.no_grad():
        cache = model(ids).cache
        expected = model(nxt, None, None, model(ids).cache)
    exported = dynajax.export(model, nxt, None, None, cache)
    with torch.no_grad():
        _assert_tree_close(exported.call(nxt, None, None, model(ids).cache), expected)
        _assert_tree_close(
            exported.call(nxt, None, None, dynajax.jax_values(model(ids).cache)), expected
        )


def test_gradients_of_a_default_config_model_are_torchs() -> None:
    model = _build(CAUSAL["llama"])
    ids = torch.randint(0, 64, (2, 8))
    fn, state = dynajax.jax_function(model, ids)
    params, buffers = fn.split_state(state)

    def loss(p: Any) -> Any:
        return jnp.sum(fn({**p, **buffers}, ids.numpy())["logits"] ** 2)

    grads = jax.jit(jax.grad(loss))(params)
    model.zero_grad()
    (model(ids).logits ** 2).sum().backward()
    for name, g in grads.items():
        param = model.get_parameter(name)
        assert param.grad is not None
        np.testing.assert_allclose(np.asarray(g), param.grad.numpy(), rtol=1e-4, atol=1e-5)


def _static_cache(model: Any, batch: int, length: int) -> Any:
    config = model.config
    cache = T.StaticCache(config=config, max_cache_len=length)
    head_dim = config.hidden_size // config.num_attention_heads
    cache.early_initialization(
        batch, config.num_key_value_heads, head_dim, torch.float32, torch.device("cpu")
    )
    return cache


def test_greedy_decoding_in_jax_with_a_static_cache_equals_generate() -> None:
    # A prefill and a decode step, each one program over a StaticCache's arrays (the
    # cache updated in place in torch is returned as a new value), the steps in a
    # lax.scan under one jax.jit: the tokens of model.generate(do_sample=False).
    model = _build(lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER, eos_token_id=None)))
    batch, prompt, new = 2, 8, 10
    ids = torch.randint(1, 64, (batch, prompt))
    prefill, state = dynajax.jax_function(
        model, ids, None, None, _static_cache(model, batch, prompt + new)
    )
    step, _ = dynajax.jax_function(
        model, ids[:, :1], None, None, _static_cache(model, batch, prompt + new)
    )
    assert set(dynajax.jax_values(_static_cache(model, 1, 4))) == {
        "key_cache",
        "value_cache",
        "cumulative_length",
    }

    @jax.jit
    def generate(state: Any, ids: Any, cache: Any) -> Any:
        out = prefill(state, ids, None, None, cache)
        token = jnp.argmax(out["logits"][:, -1], -1)

        def body(carry: Any, _: Any) -> Any:
            token, cache = carry
            out = step(state, token[:, None], None, None, cache)
            token = jnp.argmax(out["logits"][:, -1], -1)
            return (token, out["cache"]), token

        _, rest = jax.lax.scan(body, (token, out["cache"]), None, length=new - 1)
        return jnp.concatenate([token[:, None], rest.T], axis=1)

    tokens = generate(
        state, ids.numpy(), dynajax.jax_values(_static_cache(model, batch, prompt + new))
    )
    expected = model.generate(
        ids, do_sample=False, max_new_tokens=new, cache_implementation="static"
    )[:, prompt:]
    np.testing.assert_array_equal(np.asarray(tokens), expected.numpy())


def test_caches_jax_function_cannot_carry_say_why() -> None:
    model = _build(CAUSAL["llama"])
    ids = torch.randint(0, 64, (2, 8))
    lazy = T.StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(JaxFunctionError, match="not initialized.*early_initialization"):
        dynajax.jax_function(model, ids, None, None, lazy)
    # A sliding-window layer holding its whole window: its dropped count is a Python int.
    config = T.MistralConfig(**DECODER, sliding_window=4)
    torch.manual_seed(0)
    mistral = T.MistralForCausalLM(config).eval()
    with torch.no_grad():
        full = mistral(ids).cache
    leaves, spec = pytree.tree_flatten(full)
    with pytest.raises(JaxFunctionError, match="whole sliding window"):
        pytree.tree_unflatten(leaves, spec)
