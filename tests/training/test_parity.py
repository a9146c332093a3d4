"""Training with the compiled model matches eager PyTorch step for step: losses,
gradients, parameters and buffers after 5 optimizer steps, with the forward and the
backward graphs both running in JAX."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from tests import models
from tests.training.harness import assert_all_in_jax, compare_training, kinds

STEPS = 5

OPTIMIZERS = {
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "adam": functools.partial(torch.optim.Adam, lr=1e-3),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.05),
}


def _regression(fn, batch):
    x, y = batch
    return F.mse_loss(fn(x), y)


def _classification(fn, batch):
    x, y = batch
    return F.cross_entropy(fn(x), y)


def _lm(fn, ids):
    return fn(ids, labels=ids).loss


def _mlp_case():
    batches = [(torch.randn(8, 32), torch.randn(8, 16)) for _ in range(STEPS)]
    return models.mlp, batches, _regression


def _cnn_case():
    batches = [(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))) for _ in range(STEPS)]
    return models.cnn, batches, _classification


def _conv_mix_case():
    batches = [(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))) for _ in range(STEPS)]
    return models.conv_mix, batches, _classification


def _encoder_case():
    # dropout=0 so that eager and compiled compute the same function; dropout with
    # p > 0 is covered statistically in test_random.py. Trained with SGD: the key
    # projection's bias has a gradient that is zero up to rounding noise, which
    # Adam's normalization turns into full-size steps of arbitrary sign.
    def make():
        return nn.Sequential(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
            nn.Flatten(),
            nn.Linear(8 * 32, 4),
        )

    batches = [(torch.randn(2, 8, 32), torch.randn(2, 4)) for _ in range(STEPS)]
    return make, batches, _regression


def _gpt2_case():
    import transformers

    def make():
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
            bos_token_id=0, eos_token_id=0, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)

    return make, [torch.randint(0, 64, (2, 12)) for _ in range(STEPS)], _lm


CASES = {
    "mlp-sgd_momentum": (_mlp_case, "sgd_momentum"),
    "mlp-adam": (_mlp_case, "adam"),
    "cnn_batchnorm-sgd_momentum": (_cnn_case, "sgd_momentum"),
    "conv_mix-sgd_momentum": (_conv_mix_case, "sgd_momentum"),
    "encoder-sgd_momentum": (_encoder_case, "sgd_momentum"),
    "gpt2-adamw": (_gpt2_case, "adamw"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_training_matches_eager(name: str) -> None:
    case, opt = CASES[name]
    torch.manual_seed(0)
    make_model, batches, loss_fn = case()
    backend, trace = compare_training(make_model, batches, loss_fn, OPTIMIZERS[opt])
    assert "forward" in kinds(backend) and "backward" in kinds(backend), kinds(backend)
    assert_all_in_jax(backend, "forward")
    assert_all_in_jax(backend, "backward")
    if name.startswith("cnn_batchnorm"):
        # The buffers compared above really moved: BatchNorm ran in training mode.
        for bn in ("1", "5"):
            assert int(trace.state[f"{bn}.num_batches_tracked"]) == STEPS
            assert not torch.equal(trace.state[f"{bn}.running_var"], torch.ones(8))


@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
def test_compiled_optimizer_step(opt: str) -> None:
    """torch.compile(opt.step) runs the update in JAX; parameters and state match."""
    torch.manual_seed(0)
    make_model, batches, loss_fn = _mlp_case()
    backend, _ = compare_training(make_model, batches, loss_fn, OPTIMIZERS[opt], compile_step=True)
    # The step's graphs are inference graphs (optimizer.step runs under no_grad).
    assert_all_in_jax(backend, "inference")


def test_autocast_bfloat16_training_step_matches_eager() -> None:
    # Under torch.autocast the forward graph casts to bfloat16 around each matmul, and
    # the backward graph carries those casts' gradients: both run in JAX. bfloat16 has
    # 8 significant bits: gradients agree to about 1% of each parameter's largest entry
    # (checked at 3%).
    torch.manual_seed(0)
    eager = models.llama()
    compiled_model = copy.deepcopy(eager)
    ids = models.tokens(2, 16)
    backend = dynajax.Backend()
    compiled = torch.compile(compiled_model, backend=backend)
    losses = []
    for fn in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-2, atol=0)
    assert_all_in_jax(backend, "forward")
    assert_all_in_jax(backend, "backward")
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        assert q.grad is not None and q.grad.dtype == p.grad.dtype, name
        scale = p.grad.abs().max()
        assert (q.grad - p.grad).abs().max() <= 0.03 * scale, name
