"""How a training step's program updates its state: each parameter's update written
into the parameter's own (donated) buffer, XLA copying no weight that the backward
still reads (``dynajax.passes.inplace``); on a CPU, arrays of 3 or more dimensions
crossing the program flat and updated flat (``training/boundary.py``,
``passes/flat_updates.py``); either way the step computes what eager computes."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from tests.training.harness import count_barriers


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        # (no biases before the batch norms: their gradient is rounding noise, which
        # AdamW's normalized update makes a step of its own size)
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 4),
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _copied_weights(monkeypatch, tmp_path, model: nn.Module, x, y, ordered: bool) -> list[str]:  # type: ignore[no-untyped-def]
    # (its own cache: a program loaded from the session's would not be lowered)
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path / str(ordered)))
    # (every array in its own shape: the weights are told from the vectors by rank)
    monkeypatch.setattr("dynajax.training.program._flat_boundary", lambda layout: False)
    if not ordered:
        monkeypatch.setattr("dynajax.training.program._donated", lambda graph: ())
    step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
    step(x, y)
    (program,) = step._programs.values()
    text = program.run.as_text()
    # The parameters are the program's first inputs (``state[0]``); copies of the
    # vectors are XLA's own (a fusion of the backward reads a bias again).
    return [s for s in re.findall(r"= (\S+) copy\(%state_0_", text) if "," in s]


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_no_weight_is_copied_before_its_update(monkeypatch, tmp_path, kind: str) -> None:  # type: ignore[no-untyped-def]
    make, x, y = (
        (_mlp, torch.randn(8, 16), torch.randn(8, 4))
        if kind == "mlp"
        else (_cnn, torch.randn(4, 3, 6, 6), torch.randn(4, 4))
    )
    assert _copied_weights(monkeypatch, tmp_path, make(), x, y, ordered=True) == []
    # Without the pass XLA copies the weights the backward reads for the input's
    # gradient (all but the first layer's, whose input needs none).
    unordered = _copied_weights(monkeypatch, tmp_path, make(), x, y, ordered=False)
    assert len(unordered) == 2, unordered


def test_the_ordered_step_trains_as_eager(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    seen = count_barriers(monkeypatch, tmp_path, orders_update=True)
    eager, ours = _cnn(), _cnn()
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    step = dynajax.train_step(
        ours, torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1), _loss
    )
    torch.manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 3, 6, 6), torch.randn(4, 4)
        eager_opt.zero_grad()
        loss = _loss(eager, x, y)
        loss.backward()
        eager_opt.step()
        torch.testing.assert_close(torch.as_tensor(step(x, y)), loss.detach())
    # The second conv's and the linear's weights, the batch norms' weights (the
    # backward reads them for the input's gradient): AdamW's first step and its
    # steady program.
    assert seen and all(n >= 4 for n in seen), seen
    step.sync()
    for (name, a), b in zip(eager.state_dict().items(), ours.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, msg=name)


def _trained(monkeypatch, tmp_path, flat: bool) -> tuple[dict[str, torch.Tensor], list[int]]:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path / f"flat{flat}"))
    if not flat:
        monkeypatch.setattr("dynajax.training.program._flat_boundary", lambda layout: False)
    model = _cnn()
    step = dynajax.train_step(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), _loss
    )
    torch.manual_seed(1)
    for _ in range(3):
        step(torch.randn(4, 3, 6, 6), torch.randn(4, 4))
    program = list(step._programs.values())[-1]
    # The ranks of the state arrays the steady program takes.
    ranks = [len(a.shape) for a in jax.tree.leaves(program.run.args_info[0][0])]
    step.sync()
    return {k: v.clone() for k, v in model.state_dict().items()}, ranks


def test_convolution_weights_cross_the_program_flat_and_train_alike(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    flat, flat_ranks = _trained(monkeypatch, tmp_path, flat=True)
    shaped, shaped_ranks = _trained(monkeypatch, tmp_path, flat=False)
    # The two convolutions' weights and their two moments each.
    assert shaped_ranks.count(4) == 6 and max(flat_ranks) == 2, (flat_ranks, shaped_ranks)
    # The same ops on the same elements: the same bits.
    for name, a in shaped.items():
        np.testing.assert_array_equal(flat[name].numpy(), a.numpy(), err_msg=name)


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)  # a weight of 3 dimensions: flat

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.conv(self.embed(ids).transpose(1, 2)).mean()


def test_a_host_callback_that_raises_leaves_the_flat_state_whole() -> None:
    torch.manual_seed(0)
    model = _Tokens()
    step = dynajax.train_step(
        model,
        torch.optim.Adam(model.parameters(), lr=0.1),
        lambda m, ids: m(ids),
        fallback_ops=["aten.embedding"],  # eager's kernel, through a host callback
    )
    ids = torch.randint(0, 10, (2, 5))
    step(ids)
    step.sync()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(IndexError):
        step(torch.full((2, 5), 10))  # eager's embedding raises: no row 10
    step.sync()
    for name, a in trained.items():
        torch.testing.assert_close(model.state_dict()[name], a, rtol=0, atol=0, msg=name)
    step(ids)  # and the step goes on


class _Tagger(nn.Module):
    """An embedding and a classifier: eager checks the indices and the targets, so the
    step's program has value checks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 24)
        self.head = nn.Linear(24, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids))).mean(1)


def _classify(model: nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids), y)


def test_with_value_checks_no_state_is_copied_before_its_update(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Where eager raises, the step returns the state it took; that choice is made where
    # each new value is computed, so nothing reads an old value after its update and
    # XLA updates every parameter and moment in place (it copied Adam's moments of each
    # weight when the choice was made on the outputs).
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path))
    model = _Tagger()
    step = dynajax.train_step(model, torch.optim.Adam(model.parameters(), lr=1e-2), _classify)
    torch.manual_seed(1)
    for _ in range(2):  # (the program over Adam's moments, run twice)
        step(torch.randint(0, 50, (8, 5)), torch.randint(0, 7, (8,)))
    program = list(step._programs.values())[-1]
    assert program.checks, "the program has no value checks"
    text = program.run.as_text()
    copied = re.findall(r"= (\S+) copy\(%state_\d_", text)
    assert [s for s in copied if "," in s] == []
    # ... and a batch eager refuses still changes nothing.
    step.sync()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in step.optimizer.state.values()]
    with pytest.raises(IndexError):
        step(torch.full((8, 5), 50), torch.randint(0, 7, (8,)))
    step.sync()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for a, b in zip(moments, [s["exp_avg"] for s in step.optimizer.state.values()], strict=True):
        assert torch.equal(a, b)
