"""Activation checkpointing (``torch.utils.checkpoint``, transformers' gradient
checkpointing) through ``train_step`` and ``jax_function``'s gradients: eager's
answers, the forward's dropout masks in the recomputation, and a peak memory that
falls as it does in eager."""

from __future__ import annotations

import copy
import json

import jax
import numpy as np
import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import checkpoint

import dynajax
from dynajax.errors import TrainStepError
from dynajax.passes.recompute import BARRIER, KeepRecomputation
from tests.helpers import run_python
from tests.training.checkpoint_memory_worker import Deep, loss_fn
from tests.training.harness import count_barriers


class DropoutBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down, self.drop = (
            nn.Linear(width, width),
            nn.Linear(width, width),
            nn.Dropout(0.5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.relu(self.up(x))))


class DropoutDeep(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DropoutBlock(16) for _ in range(3))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


def _eager_step(model: nn.Module, optimizer: torch.optim.Optimizer, *batch: torch.Tensor) -> float:
    optimizer.zero_grad()
    loss = loss_fn(model, *batch)
    loss.backward()
    optimizer.step()
    return float(loss)


def test_a_checkpointed_model_trains_as_eager_does() -> None:
    torch.manual_seed(0)
    model = Deep(blocks=4, width=32, checkpointed=True)
    reference = copy.deepcopy(model)
    step = dynajax.train_step(model, torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn)
    eager_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(5):
        x, y = torch.randn(16, 32), torch.randn(16, 32)
        assert float(step(x, y)) == pytest.approx(_eager_step(reference, eager_opt, x, y), rel=1e-5)
    step.sync()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_the_recomputation_draws_the_forwards_dropout_masks() -> None:
    # JAX's random numbers are not eager's, so the checkpointed model is compared with
    # the same model unchecked: the same losses step after step (a recomputation with
    # masks of its own would give other gradients from the first step on).
    losses = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = DropoutDeep(checkpointed)
        step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
        torch.manual_seed(1)
        batches = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(4)]
        losses[checkpointed] = [float(step(x, y)) for x, y in batches]
    assert losses[True] == losses[False]


def test_checkpointing_leaves_torchs_generator_as_an_unchecked_model_does() -> None:
    states = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = DropoutDeep(checkpointed)
        step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
        step(torch.randn(8, 16), torch.randn(8, 16))
        states[checkpointed] = torch.get_rng_state()
    assert torch.equal(states[True], states[False])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_transformers_gradient_checkpointing_trains_as_eager_does(name: str) -> None:
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()  # transformers' default: non-reentrant
    model.train()
    reference = copy.deepcopy(model)

    def lm_loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    step = dynajax.train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lm_loss)
    eager_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for _ in range(20):
        ids = torch.randint(0, 64, (2, 16))
        eager_opt.zero_grad()
        expected = lm_loss(reference, ids)
        expected.backward()
        eager_opt.step()
        assert float(step(ids)) == pytest.approx(float(expected), abs=1e-5)


def test_reentrant_checkpointing_is_refused_with_what_to_do() -> None:
    class Reentrant(Deep):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](x)  # so that the checkpoint's input requires grad
            for block in self.blocks[1:]:
                x = checkpoint(block, x, use_reentrant=True)
            return x

    model = Reentrant(blocks=2, width=8, checkpointed=True)
    step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    with pytest.raises(TrainStepError, match="use_reentrant=False"):
        step(torch.randn(4, 8), torch.randn(4, 8))


def test_jax_grad_of_a_checkpointed_model_is_autograds() -> None:
    torch.manual_seed(0)
    model = DropoutDeep(checkpointed=True).eval()
    x = torch.randn(4, 16)
    fn, state = dynajax.jax_function(model, x)
    grads = jax.jit(jax.grad(lambda s, x: fn(s, x).sum()))(state, x.numpy())
    model.zero_grad()
    model(x).sum().backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[name]), p.grad.numpy(), rtol=1e-5, atol=1e-6)


def _barriers(fn, *examples: torch.Tensor) -> int:  # type: ignore[no-untyped-def]
    gm = make_fx(fn)(*examples)
    KeepRecomputation()(gm)
    return sum(n.target is BARRIER for n in gm.graph.nodes)


def test_a_recomputed_product_gets_a_barrier_and_a_repeated_difference_none() -> None:
    x, w, y = torch.randn(4, 8), torch.randn(8, 8), torch.randn(4, 8)

    def recomputed(x, w, g):  # type: ignore[no-untyped-def]
        h = torch.relu(x @ w)  # the forward
        g2 = g * 2  # the backward, up to the region
        return h.sum() + (torch.relu(x @ w) * g2).sum()  # the region, again

    def loss_difference(x, y):  # type: ignore[no-untyped-def]
        return (x - y).pow(2).mean() + (x - y).sum()  # mse's backward repeats x - y

    assert _barriers(recomputed, x, w, y) == 1
    assert _barriers(loss_difference, x, y) == 0


def test_checkpointing_lowers_the_steps_peak_memory() -> None:
    # Fresh processes, glibc mapping each large allocation on its own (so that the
    # resident set follows the memory in use); the second step's peak.
    def peak(runner: str, form: str, *extra: str) -> int:
        out = run_python(
            "-m", "tests.training.checkpoint_memory_worker", runner, form,
            "--blocks", "8", "--width", "256", "--batch", "8192", *extra,
            MALLOC_MMAP_THRESHOLD_="131072",
        )  # fmt: skip
        return int(json.loads(out)["peak_over_start"])

    activation = 8192 * 256 * 4  # one block's input, 8 MiB
    plain, checkpointed = peak("step", "plain"), peak("step", "checkpoint")
    merged = peak("step", "checkpoint", "--no-barrier")
    eager = peak("eager", "checkpoint")
    # Unchecked, each block keeps three activations for its backward; checkpointed one
    # (its input), and one block's three while it is recomputed.
    # (measured: eager 147 -> 88 MB, train_step 153 -> 104 MB).
    assert plain - checkpointed > 4 * activation, (plain, checkpointed)
    # Without the barriers XLA merges the recomputation into the forward (153 MB).
    assert merged - checkpointed > 4 * activation, (merged, checkpointed)
    assert checkpointed < 1.25 * eager, (checkpointed, eager)


def test_a_step_without_checkpointing_has_no_barrier(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    seen = count_barriers(monkeypatch, tmp_path, orders_update=False)
    model = Deep(blocks=3, width=8, checkpointed=False)
    step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    step(torch.randn(4, 8), torch.randn(4, 8))
    assert seen == [0]
    model = Deep(blocks=3, width=8, checkpointed=True)
    step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    step(torch.randn(4, 8), torch.randn(4, 8))
    assert seen == [0, 3]


def test_the_barrier_is_the_identity_in_eager_and_in_jax() -> None:
    xs = [torch.randn(3, 4), torch.tensor([float("nan"), -0.0, 1.0])]
    after = [torch.randn(2), torch.tensor([float("nan")]), torch.zeros(0, dtype=torch.int64)]
    for got, x in zip(torch.ops.dynajax.recompute_barrier(xs, after), xs, strict=True):
        torch.testing.assert_close(got, x, equal_nan=True)
    from dynajax.lowering.barriers import _recompute_barrier

    out = jax.jit(_recompute_barrier)([x.numpy() for x in xs], [a.numpy() for a in after])
    for got, x in zip(out, xs, strict=True):
        np.testing.assert_array_equal(np.asarray(got), x.numpy())
        assert np.signbit(np.asarray(got)).tolist() == np.signbit(x.numpy()).tolist()
