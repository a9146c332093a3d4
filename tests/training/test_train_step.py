"""``dynajax.train_step``: forward, backward and the user's torch.optim update as one XLA
program, the state in JAX. Each case trains 20 steps beside an eager PyTorch loop with
the same optimizer and compares every loss, then every parameter, buffer and optimizer
state tensor after ``step.sync()``."""

from __future__ import annotations

import copy
import functools
import gc
import weakref
from typing import Any

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
from dynajax.errors import TrainStepError
from tests.helpers import count_recompiles, measured_faster
from tests.tolerances import assert_same

STEPS = 20

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05),
    "sgd_nesterov_wd": functools.partial(
        torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
    "adamw_amsgrad": functools.partial(torch.optim.AdamW, lr=1e-2, amsgrad=True),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=1e-3, momentum=0.5),
    "adagrad": functools.partial(torch.optim.Adagrad, lr=1e-2, lr_decay=0.01),
}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def cnn() -> nn.Module:
    # Convolutions before BatchNorm without a bias, as ResNets have them: a bias there
    # has a gradient of rounding noise only, which Adam-like updates amplify into
    # differences of no meaning.
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def regression(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def classification(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return [
            (torch.randn(16, 16, generator=gen), torch.randn(16, 8, generator=gen))
            for _ in range(STEPS)
        ]
    return [
        (torch.randn(4, 3, 12, 12, generator=gen), torch.randint(0, 10, (4,), generator=gen))
        for _ in range(STEPS)
    ]


CASES = {"mlp": (mlp, regression), "cnn": (cnn, classification)}


def _pair(kind: str, make_optimizer):
    make_model, loss_fn = CASES[kind]
    torch.manual_seed(0)
    eager = make_model()
    torch.manual_seed(0)
    ours = make_model()
    return (
        eager,
        make_optimizer(eager.parameters()),
        ours,
        make_optimizer(ours.parameters()),
        loss_fn,
    )


def _eager_losses(model, optimizer, loss_fn, batches, scheduler=None, clip=None) -> list[float]:
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_fn(model, *batch)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _assert_trained_alike(eager, eager_opt, ours, our_opt) -> None:
    assert_same(dict(ours.state_dict()), dict(eager.state_dict()), model=True, path="model")
    theirs = eager_opt.state_dict()["state"]
    mine = our_opt.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for i in theirs:
        assert mine[i].keys() == theirs[i].keys(), f"state of parameter {i}"
        for key in theirs[i]:
            expected = theirs[i][key]
            actual = mine[i][key]
            if isinstance(expected, torch.Tensor) and expected.dim() == 0:
                expected = expected.float()
                actual = torch.as_tensor(actual).float()
            assert_same(actual, expected, model=True, path=f"state[{i}][{key!r}]")


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_twenty_steps_are_eagers(kind: str, name: str) -> None:
    eager, eager_opt, ours, our_opt, loss_fn = _pair(kind, OPTIMIZERS[name])
    batches = _batches(kind)
    expected = _eager_losses(eager, eager_opt, loss_fn, batches)
    step = dynajax.train_step(ours, our_opt, loss_fn)
    actual = [float(step(*batch)) for batch in batches]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    # Between syncs the state lives in JAX only: the module's tensors hold no values.
    assert {t.device.type for t in [*ours.parameters(), *ours.buffers()]} == {"meta"}
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)
    # One program for every step (the optimizer's state made before the first); SGD
    # with momentum: one more for the first step, which creates its buffer.
    assert step.traces == (2 if name == "sgd_nesterov_wd" else 1)


@pytest.mark.parametrize("faster", ["pytorch", "xla"])
def test_convolutions_run_the_kernel_measured_faster_inside_the_program(faster: str) -> None:
    # On one CPU device the step's convolutions (forward and backward) run oneDNN's
    # kernel inside the XLA program where it was measured faster; the step stays
    # eager's, and keeps its state's buffers donated (the kernels cannot fail on the
    # shapes the trace checked).
    eager, eager_opt, ours, our_opt, loss_fn = _pair("cnn", OPTIMIZERS["adam"])
    batches = _batches("cnn")
    expected = _eager_losses(eager, eager_opt, loss_fn, batches)
    with measured_faster(faster):
        step = dynajax.train_step(ours, our_opt, loss_fn)
        actual = [float(step(*batch)) for batch in batches[:2]]
    held = step.train_state().params[0]
    actual += [float(step(*batch)) for batch in batches[2:]]
    assert held.is_deleted()  # donated to the step's program
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    kernels = [line for line in step.report().splitlines() if "kernels inside" in line]
    if faster == "pytorch":
        assert kernels == [
            "  PyTorch's kernels inside the program, faster than XLA's: "
            "aten.convolution.default x2, aten.convolution_backward.default x2"
        ]
    else:
        assert kernels == []
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


def test_scheduler_changes_the_rate_without_a_retrace() -> None:
    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", OPTIMIZERS["adam"])
    # (OneCycleLR's cycle_momentum would change Adam's betas too, which are baked into
    # the program: each new value compiles another one.)
    schedule = functools.partial(
        torch.optim.lr_scheduler.OneCycleLR, max_lr=0.05, total_steps=STEPS, cycle_momentum=False
    )
    eager_sched, our_sched = schedule(eager_opt), schedule(our_opt)
    batches = _batches("mlp")
    expected = _eager_losses(eager, eager_opt, loss_fn, batches, eager_sched)
    step = dynajax.train_step(ours, our_opt, loss_fn)
    actual = []
    for batch in batches:
        actual.append(float(step(*batch)))
        our_sched.step()
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    assert step.traces == 1  # (the scheduler's wrapper of Adam's step is torch's own)
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


def test_param_groups_and_gradient_clipping() -> None:
    def make(model):
        return torch.optim.SGD(
            [
                {"params": model[0].parameters(), "lr": 0.1},
                {"params": model[2].parameters(), "momentum": 0.9},
            ],
            lr=0.01,
        )

    torch.manual_seed(0)
    eager = mlp()
    torch.manual_seed(0)
    ours = mlp()
    eager_opt, our_opt = make(eager), make(ours)
    batches = _batches("mlp")
    expected = _eager_losses(eager, eager_opt, regression, batches, clip=0.1)
    step = dynajax.train_step(ours, our_opt, regression, clip_grad_norm=0.1)
    actual = [float(step(*batch)) for batch in batches]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


def test_state_loaded_into_the_module_is_taken_up() -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dynajax.train_step(model, optimizer, regression)
    x, y = _batches("mlp")[0]
    step(x, y)
    torch.manual_seed(5)
    fresh = mlp()
    model.load_state_dict(fresh.state_dict())  # the user's own change, between steps
    loss = float(step(x, y))
    assert loss == pytest.approx(regression(fresh, x, y).item(), rel=1e-5)


def test_loading_the_module_keeps_the_optimizers_state() -> None:
    # As in eager: model.load_state_dict replaces the weights, not Adam's moments.
    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", OPTIMIZERS["adam"])
    batches = _batches("mlp")
    step = dynajax.train_step(ours, our_opt, loss_fn)
    _eager_losses(eager, eager_opt, loss_fn, batches[:3])
    for batch in batches[:3]:
        step(*batch)
    torch.manual_seed(9)
    fresh = mlp().state_dict()
    eager.load_state_dict(fresh)
    ours.load_state_dict(fresh)
    expected = _eager_losses(eager, eager_opt, loss_fn, batches[3:6])
    actual = [float(step(*batch)) for batch in batches[3:6]]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


def test_dropout_draws_from_torchs_generator() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the state stays put
    step = dynajax.train_step(model, optimizer, regression)
    x, y = _batches("mlp")[0]
    torch.manual_seed(3)
    first = [float(step(x, y)) for _ in range(3)]
    torch.manual_seed(3)
    again = [float(step(x, y)) for _ in range(3)]
    assert first == again  # seeded by torch.manual_seed
    assert len(set(first)) == 3  # a new mask each step
    model.eval()
    with torch.no_grad():
        no_dropout = regression(model, x, y).item()
    assert all(abs(v - no_dropout) > 1e-3 for v in first)


def test_the_module_syncs_itself_when_the_user_reaches_it() -> None:
    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", OPTIMIZERS["adam"])
    batches = _batches("mlp")[:3]
    _eager_losses(eager, eager_opt, loss_fn, batches)
    step = dynajax.train_step(ours, our_opt, loss_fn)
    for batch in batches:
        step(*batch)
    x = batches[0][0]
    assert ours[0].weight.device.type == "meta"  # released: the state is in the step
    assert_same(ours(x), eager(x), model=True)  # calling the model syncs it first
    assert ours[0].weight.device.type == "cpu"
    step(*batches[0])  # the next step releases it again
    assert ours[0].weight.device.type == "meta"
    _eager_losses(eager, eager_opt, loss_fn, batches[:1])
    assert_same(dict(ours.state_dict()), dict(eager.state_dict()), model=True)
    step(*batches[1])
    assert our_opt.state_dict()["state"][0]["exp_avg"].device.type == "cpu"  # synced too


class _Head(nn.Module):
    """A model of the user's own class (Dynamo's frame is its forward; the hooks of a
    torch.nn container like ``nn.Sequential`` run inside the frame instead)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).tanh()


@pytest.mark.parametrize("kind", ["sequential", "own class"])
def test_a_compiled_model_served_between_steps_syncs_and_never_recompiles(kind: str) -> None:
    """Train, then serve the same module through ``torch.compile``, then train on:
    the compiled model sees whole tensors (it syncs first), gives the eager twin's
    answer, and compiles once, whatever the steps do to the module between calls."""
    import copy

    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ours = mlp() if kind == "sequential" else _Head()
    eager = copy.deepcopy(ours)
    our_opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, eager))
    step = dynajax.train_step(ours, our_opt, regression)
    served = torch.compile(ours, backend="dynajax")
    before = counters["stats"]["unique_graphs"]
    for epoch in range(3):
        for x, y in _batches("mlp")[epoch : epoch + 2]:
            step(x, y)
            eager_opt.zero_grad()
            regression(eager, x, y).backward()
            eager_opt.step()
        if epoch == 0:  # released by the step (once served, the compiled model holds
            # the tensors, and the step keeps them whole: step.report() says so)
            assert next(ours.parameters()).device.type == "meta"
        with torch.no_grad():
            for x, _ in _batches("mlp")[:2]:
                assert_same(served(x), eager(x), model=True)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_a_released_model_dropped_unsynced_leaves_no_global_hook() -> None:
    """While a module is released, a global forward pre-hook syncs it before a
    compiled wrapper's frame; once no released module is left (the model and its step
    dropped without a sync), the hook is gone, and torch.compile no longer warns of
    global hooks at each compiled module's call, whatever the warnings filters."""
    import gc
    import warnings

    from torch.nn.modules.module import _has_any_global_hook

    torch.manual_seed(0)
    gc.collect()  # (what earlier tests released)
    assert not _has_any_global_hook()
    model = mlp()
    step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), regression)
    step(*_batches("mlp")[0])
    assert next(model.parameters()).device.type == "meta" and _has_any_global_hook()
    del model, step
    gc.collect()
    assert not _has_any_global_hook()
    other = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a filter dynajax installed would be reset here)
        torch.compile(other, backend="dynajax")(torch.randn(2, 16))


def test_a_state_loaded_into_module_and_optimizer_rewinds_the_run() -> None:
    import copy

    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = dynajax.train_step(model, optimizer, regression)
    batches = _batches("mlp")[:4]
    step(*batches[0])
    model_state = copy.deepcopy(model.state_dict())  # both sync first
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    then = [float(step(*b)) for b in batches[1:]]
    model.load_state_dict(model_state)  # the user's rewind, taken up at the next step
    optimizer.load_state_dict(optimizer_state)
    again = [float(step(*b)) for b in batches[1:]]
    assert again == then


def test_a_released_tensor_edited_in_place_is_refused_and_the_state_kept() -> None:
    torch.manual_seed(0)
    model = mlp()
    step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), regression)
    x, y = _batches("mlp")[0]
    step(x, y)
    kept = step.state_dict()
    with torch.no_grad():
        model[0].weight.mul_(2)  # a meta tensor: no effect, which the step reports
    with pytest.raises(TrainStepError, match=r"'0.weight' of the module were written in place"):
        step(x, y)
    assert_same(step.state_dict(), kept)
    step.sync()
    with torch.no_grad():
        model[0].weight.mul_(2)  # after a sync: taken up at the next step
    expected = regression(model, x, y).item()
    assert float(step(x, y)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("opt", ["sgd_nesterov_wd", "adam", "adam_fused"])
def test_eager_steps_between_syncs_are_taken_up(opt: str) -> None:
    # train_step, a sync, two eager steps by hand on the same module and optimizer
    # (momentum buffers, moments and step counts written in place), train_step again:
    # the eager loop's losses, parameters and state. A fused kernel writes them without
    # bumping their version counters (seed 130, case 14 of the training fuzzer).
    make = OPTIMIZERS.get(opt) or functools.partial(torch.optim.Adam, lr=1e-2, fused=True)
    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", make)
    batches = _batches("mlp")[:8]
    expected = _eager_losses(eager, eager_opt, loss_fn, batches)
    step = dynajax.train_step(ours, our_opt, loss_fn)
    actual = [float(step(*b)) for b in batches[:3]]
    step.sync()
    actual += _eager_losses(ours, our_opt, loss_fn, batches[3:5])
    actual += [float(step(*b)) for b in batches[5:]]
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)
    if opt != "sgd_nesterov_wd":
        assert float(our_opt.state[ours[0].weight]["step"]) == 8


def test_batch_statistics_of_an_eager_forward_after_a_sync_are_taken_up() -> None:
    # An eager forward in train mode updates BatchNorm's running statistics in place
    # without bumping their version counters (only num_batches_tracked's add_ does):
    # they are taken up with it (fuzz seed 127, run 0, --float64).
    batch = _batches("cnn")[2]

    def forward(model: nn.Module, _: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            model(batch[0])

    _edited_after_a_sync("cnn", OPTIMIZERS["sgd_nesterov_wd"], forward, 2, 3, 5)


def _edited_after_a_sync(kind: str, make, edit, synced_at: int, resume_at: int, steps: int):
    """Trains ``kind`` on batches ``[:synced_at]`` eagerly and with train_step, syncs,
    applies ``edit(model, optimizer)`` to both, trains on over ``[resume_at:steps]``:
    the eager loop's losses, parameters and state."""
    eager, eager_opt, ours, our_opt, loss_fn = _pair(kind, make)
    batches = _batches(kind)[:steps]
    expected = _eager_losses(eager, eager_opt, loss_fn, batches[:synced_at])
    step = dynajax.train_step(ours, our_opt, loss_fn)
    actual = [float(step(*b)) for b in batches[:synced_at]]
    step.sync()
    edit(eager, eager_opt)
    edit(ours, our_opt)
    rest = batches[resume_at:]
    expected += _eager_losses(eager, eager_opt, loss_fn, rest)
    actual += [float(step(*b)) for b in rest]
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


def test_sync_of_a_step_that_does_not_hold_the_state_syncs_the_one_that_does() -> None:
    # Two train_steps over one module (B took the state over from A): A.sync() makes the
    # module and the optimizer whole, so an edit then is taken up when A takes the state
    # back (fuzz seed 126, run 33: moments zeroed after A.sync() were lost).
    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", OPTIMIZERS["adam"])
    batches = _batches("mlp")[:4]
    first = dynajax.train_step(ours, our_opt, loss_fn)
    second = dynajax.train_step(ours, our_opt, loss_fn, clip_grad_norm=100.0)
    expected = _eager_losses(eager, eager_opt, loss_fn, batches[:2])
    actual = [float(first(*batches[0])), float(second(*batches[1]))]
    first.sync()
    for opt in (eager_opt, our_opt):
        for state in opt.state.values():
            state["exp_avg"].zero_()
    expected += _eager_losses(eager, eager_opt, loss_fn, batches[2:])
    actual += [float(first(*b)) for b in batches[2:]]
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    first.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


def _edits() -> dict[str, Any]:
    def zero_moments(opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            state["exp_avg"].zero_()  # a warm restart's reset, in place

    def replace(opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            state["exp_avg_sq"] = state["exp_avg_sq"] * 4

    def reset(opt: torch.optim.Optimizer) -> None:
        opt.state.clear()  # every entry removed: the next step starts them anew

    def copy_from_another(opt: torch.optim.Optimizer) -> None:
        other = torch.optim.Adam([p for g in opt.param_groups for p in g["params"]], lr=1e-2)
        other.load_state_dict(opt.state_dict())
        for p, state in other.state.items():
            state["step"] = state["step"] + 10
            opt.state[p] = state

    return {
        "zero_moments": zero_moments,
        "replace": replace,
        "reset": reset,
        "copy_from_another": copy_from_another,
    }


@pytest.mark.parametrize("edit", list(_edits()))
def test_optimizer_state_edited_after_a_sync_is_taken_up(edit: str) -> None:
    change = _edits()[edit]
    _edited_after_a_sync("mlp", OPTIMIZERS["adam"], lambda _, opt: change(opt), 3, 3, 6)


@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
def test_optimizer_state_edited_while_the_step_holds_it_is_refused(release: bool) -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = dynajax.train_step(model, optimizer, regression, release_module=release)
    x, y = _batches("mlp")[0]
    step(x, y)
    step.sync()
    step(x, y)  # the optimizer's tensors are stand-ins again, or the older values
    kept = step.state_dict()
    optimizer.state[model[0].weight]["exp_avg"].zero_()  # lost: refused
    with pytest.raises(TrainStepError, match=r"optimizer's state of '0.weight' was changed"):
        step(x, y)
    assert_same(step.state_dict(), kept)
    optimizer.state[model[2].bias]["exp_avg"] = torch.zeros(8)  # replaced: the same
    with pytest.raises(TrainStepError, match=r"state of '2.bias' was changed"):
        step(x, y)
    assert_same(step.state_dict(), kept)
    step(x, y)  # refused once; the training goes on from its own state


def test_a_rewind_that_casts_the_optimizers_state_runs_as_eager() -> None:
    # optimizer.load_state_dict casts each state entry but ``step`` to its parameter's
    # dtype: a float64 model's NAdam ``mu_product`` (made float32) comes back float64.
    # The program for the float32 entry must not be run on it (training fuzzer, seed
    # 132, run 18, --float64).
    def nadam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.NAdam(params, lr=1e-2)

    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", nadam)
    eager.double()
    ours.double()
    batches = [tuple(t.double() for t in b) for b in _batches("mlp")[:3]]
    step = dynajax.train_step(ours, our_opt, loss_fn)

    def run(train: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        losses = [train(batches[0])]
        saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
        losses.append(train(batches[1]))
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        losses.append(train(batches[2]))
        return losses

    expected = run(lambda b: _eager_losses(eager, eager_opt, loss_fn, [b])[0], eager, eager_opt)
    actual = run(lambda b: float(step(*b)), ours, our_opt)
    step.sync()
    assert actual == pytest.approx(expected, rel=1e-12)
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


@pytest.mark.parametrize("then", ["sync", "another step", "reload"])
def test_a_write_while_the_step_holds_the_state_is_refused_before_a_write_back(
    then: str,
) -> None:
    # The write back into the module and optimizer (a sync, another step over the module
    # taking over, reload) would hide a write the step never saw; it refuses it first.
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = dynajax.train_step(model, optimizer, regression)
    x, y = _batches("mlp")[0]
    step(x, y)
    step.sync()
    step(x, y)
    kept = step.state_dict()
    act = {
        "sync": step.sync,
        "another step": lambda: dynajax.train_step(model, optimizer, regression, accumulate=2),
        "reload": step.reload,
    }[then]
    with torch.no_grad():
        model[0].weight.mul_(2)  # a meta tensor: no effect
    with pytest.raises(TrainStepError, match=r"'0.weight' of the module were written in place"):
        act()
    optimizer.state[model[2].bias]["exp_avg"].zero_()  # a meta tensor: no effect
    with pytest.raises(TrainStepError, match=r"optimizer's state of '2.bias' was changed"):
        act()
    assert_same(step.state_dict(), kept)
    act()  # refused once each; then as asked
    step.sync()
    assert_same(model.state_dict(), kept)


def _with_metrics(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
    out = model(x)
    loss = F.mse_loss(out, y)
    return loss, {"norm": out.detach().norm(), "per_row": (out - y).square().mean(1)}


def _torch(aux: Any) -> Any:
    return {k: torch.from_dlpack(v) for k, v in aux.items()}


def test_loss_fn_returning_loss_and_aux() -> None:
    # aux (any pytree of tensors) comes back beside the loss, computed in the step's
    # program: the values eager's loss_fn gives at that step.
    eager, eager_opt, ours, our_opt, _ = _pair("mlp", OPTIMIZERS["adam"])
    step = dynajax.train_step(ours, our_opt, _with_metrics)
    for batch in _batches("mlp")[:3]:
        loss, aux = step(*batch)
        eager_opt.zero_grad()
        expected, expected_aux = _with_metrics(eager, *batch)
        expected.backward()
        eager_opt.step()
        assert isinstance(loss, jax.Array) and isinstance(aux["norm"], jax.Array)
        assert_same(torch.from_dlpack(loss), expected.detach(), model=True)
        assert_same(_torch(aux), {k: v.detach() for k, v in expected_aux.items()}, model=True)
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


def test_aux_of_micro_batches_is_stacked() -> None:
    torch.manual_seed(0)
    model = mlp()
    step = dynajax.train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.0), _with_metrics, accumulate=2
    )
    x, y = _batches("mlp")[0]
    _, aux = step(x, y)
    step.sync()
    halves = [_with_metrics(model, x[i : i + 8], y[i : i + 8])[1] for i in (0, 8)]
    expected = {k: torch.stack([h[k].detach() for h in halves]) for k in halves[0]}
    assert_same(_torch(aux), expected, model=True)


def test_aux_names_key_the_program() -> None:
    # The same graph with another aux structure (another dict key) is another program:
    # the persistent cache does not hand the first's names to the second.
    x, y = _batches("mlp")[0]
    for key in ("first", "second"):
        torch.manual_seed(0)
        model = mlp()
        step = dynajax.train_step(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            lambda m, x, y, key=key: (F.mse_loss(m(x), y), {key: m(x).sum()}),
        )
        _, aux = step(x, y)
        assert list(aux) == [key]


def test_aux_that_is_not_tensors_is_refused() -> None:
    model = mlp()
    step = dynajax.train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, x, y: (F.mse_loss(m(x), y), {"count": 3}),
    )
    with pytest.raises(TrainStepError, match="aux must be a pytree of tensors"):
        step(*_batches("mlp")[0])


def test_a_tensor_that_cannot_be_released_is_kept_whole_and_trained() -> None:
    import weakref

    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", OPTIMIZERS["adam"])
    watched = weakref.ref(ours[0].weight)  # swap_tensors refuses a tensor with weakrefs
    batches = _batches("mlp")[:4]
    expected = _eager_losses(eager, eager_opt, loss_fn, batches)
    step = dynajax.train_step(ours, our_opt, loss_fn)
    actual = [float(step(*b)) for b in batches]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    assert ours[0].weight.device.type == "cpu" and ours[2].weight.device.type == "meta"
    assert "0.weight: Cannot swap t1 because it has weakref" in step.report()
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)
    assert watched() is ours[0].weight


def test_a_second_step_over_the_same_model_takes_the_state_over() -> None:
    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", OPTIMIZERS["sgd_nesterov_wd"])
    batches = _batches("mlp")[:6]
    expected = _eager_losses(eager, eager_opt, loss_fn, batches)
    first = dynajax.train_step(ours, our_opt, loss_fn)
    second = dynajax.train_step(ours, our_opt, loss_fn, clip_grad_norm=1e9)
    actual = [float(first(*b)) for b in batches[:2]]
    actual += [float(second(*b)) for b in batches[2:4]]  # takes over the trained state
    actual += [float(first(*b)) for b in batches[4:]]  # and back
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    first.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


def test_the_first_steps_program_is_let_go_and_a_reset_state_trains_again() -> None:
    make_adam = functools.partial(torch.optim.Adam, lr=1e-2)
    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", make_adam)
    batches = _batches("mlp")[:6]
    step = dynajax.train_step(ours, our_opt, loss_fn)
    actual = [float(step(*b)) for b in batches[:3]]
    # Adam has no state before its first step, so that step ran a program of its own;
    # it is not kept once the state has grown.
    assert len(step._programs) == 1
    # A fresh optimizer's state loaded: the program for no state again, as eager.
    empty = make_adam(eager.parameters()).state_dict()
    our_opt.load_state_dict(empty)
    actual += [float(step(*b)) for b in batches[3:]]
    expected = _eager_losses(eager, eager_opt, loss_fn, batches[:3])
    eager_opt.load_state_dict(empty)
    expected += _eager_losses(eager, eager_opt, loss_fn, batches[3:])
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    step.sync()
    _assert_trained_alike(eager, eager_opt, ours, our_opt)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_step_keeps_neither_its_first_batch_nor_its_trace(deterministic: bool) -> None:
    # The trace ran on the first batch and on example tensors of the state's shapes;
    # a program keeps neither (else the batch, and under deterministic algorithms,
    # which fill torch.empty, a model's worth of example tensors stay resident).
    torch.manual_seed(0)
    # (shapes no other test has)
    model = nn.Sequential(nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        # (SGD: no optimizer state, so the first step's program is the one kept)
        step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=1e-2), regression)
        first = np.random.default_rng(0).standard_normal((5, 13), dtype=np.float32)
        alive = weakref.ref(first)  # the tensor's memory is the array's
        y = torch.randn(5, 3)
        step(torch.from_numpy(first), y)
        del first
        loss = step(torch.randn(5, 13), y)
        gc.collect()
        assert alive() is None, "the first batch is still referenced"
        # No plain tensor of a weight's shape exists (the module's are Parameters;
        # other tests' fake tensors are subclasses, some with symbolic sizes).
        shapes = {(11, 13), (3, 11)}
        others = [
            o.shape
            for o in gc.get_objects()
            if type(o) is torch.Tensor and o.shape in shapes and o.device.type == "cpu"
        ]
        assert others == []
        assert np.isfinite(float(loss))
    finally:
        torch.use_deterministic_algorithms(previous)


def test_the_state_is_copied_into_memory_jax_owns() -> None:
    # The step donates its arrays: one that aliased torch's memory (a parameter taken
    # zero-copy) is not XLA's to reuse, and XLA copies it at every call that donates it
    # (GPT-2 small's first step: a second copy of its 124M parameters).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32))
    torch_memory = {t.data_ptr() for t in model.state_dict().values()}
    step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), regression)
    step._take_up()  # (the state loaded from the module, as a first step loads it)
    state = step.train_state()
    arrays = [*state.params, *state.buffers]
    assert len(arrays) == len(torch_memory)
    assert not {a.unsafe_buffer_pointer() for a in arrays} & torch_memory


def test_an_optimizer_with_a_closure_is_refused_by_name() -> None:
    model = mlp()
    with pytest.raises(TrainStepError, match="cannot compile LBFGS: its step"):
        dynajax.train_step(model, torch.optim.LBFGS(model.parameters()), regression)


def test_a_loss_that_is_not_one_element_is_refused_and_nothing_is_lost() -> None:
    torch.manual_seed(0)
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = dynajax.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x))
    x, _ = _batches("mlp")[0]
    with pytest.raises(TrainStepError, match=r"one element, got a \(16, 8\) torch.float32"):
        step(x)
    step.sync()
    assert_same(dict(model.state_dict()), before)


def test_a_batch_the_model_cannot_take_raises_and_keeps_the_state() -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    step = dynajax.train_step(model, optimizer, regression)
    x, y = _batches("mlp")[0]
    step(x, y)
    step.sync()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TrainStepError, match="eager PyTorch raises"):
        step(x.double(), y.double())  # eager raises too: float64 input, float32 weights
    step.sync()
    assert_same(dict(model.state_dict()), trained)
    step(x, y)  # and the step goes on


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss


def _image_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=images, labels=labels).loss


def _vit() -> nn.Module:
    import transformers

    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_labels=10,
    )
    return transformers.ViTForImageClassification(config)


def _transformer(
    arch: str, dtype: torch.dtype
) -> tuple[nn.Module, Any, list[tuple[torch.Tensor, ...]]]:
    from tests import models

    gen = torch.Generator().manual_seed(2)
    if arch == "vit":
        model, loss_fn = _vit(), _image_loss
        batches = [
            (
                torch.randn(2, 3, 16, 16, generator=gen, dtype=dtype),
                torch.randint(0, 10, (2,), generator=gen),
            )
            for _ in range(STEPS)
        ]
    else:
        model = getattr(models, arch)(layers=2, width=32, heads=4, vocab=64)
        loss_fn = _lm_loss
        batches = [(torch.randint(0, 64, (2, 16), generator=gen),) for _ in range(STEPS)]
    for module in model.modules():  # dropout draws from another generator here
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.to(dtype).train(), loss_fn, batches


# Optimizers that divide by a running norm of the gradient. An element whose gradient is
# rounding noise gets steps of about lr with an arbitrary sign from them, in eager as
# under any other set of kernels: the attention key's bias, which softmax ignores, and
# LLaMA's RMSNorm computes in float32 even in a float64 model. Under them the losses of
# all 20 steps are compared, and the parameters within 1e-3 with those biases left out.
_ADAPTIVE = {"adam", "adamw_amsgrad", "rmsprop", "adagrad"}
_NOISE_ONLY = {
    "gpt2": {"attn.c_attn.bias": slice(32, 64)},  # [query | key | value] biases, width 32
    "vit": {"attention.k_proj.bias": slice(None)},
    "llama": {},
}


def _assert_close_but_noise(arch: str, eager: nn.Module, ours: nn.Module) -> None:
    trained = dict(ours.state_dict())
    for name, expected in eager.state_dict().items():
        actual = trained[name].clone()
        expected = expected.clone()
        for suffix, part in _NOISE_ONLY[arch].items():
            if name.endswith(suffix):
                actual[part] = expected[part] = 0
        torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-3, msg=name)


# Each architecture with two optimizers, an adaptive one and a plain one, and each
# optimizer on one architecture: an optimizer's update is per parameter, the same ops
# whatever model it steps, and every optimizer also trains the MLP and the CNN
# (test_twenty_steps_are_eagers).
TRANSFORMER_RUNS = [
    ("gpt2", "adam"),
    ("gpt2", "sgd_nesterov_wd"),
    ("llama", "adamw_amsgrad"),
    ("llama", "sgd"),
    ("vit", "rmsprop"),
    ("vit", "adagrad"),
]


def test_the_transformer_runs_cover_every_optimizer() -> None:
    assert {name for _, name in TRANSFORMER_RUNS} == set(OPTIMIZERS)


@pytest.mark.parametrize(("arch", "name"), TRANSFORMER_RUNS, ids=lambda v: v)
def test_transformers_models_train_as_in_eager(arch: str, name: str) -> None:
    torch.manual_seed(0)
    eager, loss_fn, batches = _transformer(arch, torch.float32)
    torch.manual_seed(0)
    ours, _, _ = _transformer(arch, torch.float32)
    make = OPTIMIZERS[name]
    eager_opt, our_opt = make(eager.parameters()), make(ours.parameters())
    expected = _eager_losses(eager, eager_opt, loss_fn, batches)
    step = dynajax.train_step(ours, our_opt, loss_fn)
    actual = [float(step(*batch)) for batch in batches]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    step.sync()
    if name in _ADAPTIVE:
        _assert_close_but_noise(arch, eager, ours)
    else:
        _assert_trained_alike(eager, eager_opt, ours, our_opt)


def test_gradient_accumulation_is_eagers_loop_over_micro_batches() -> None:
    eager, eager_opt, ours, our_opt, loss_fn = _pair("cnn", OPTIMIZERS["adam"])
    batches = _batches("cnn")[:6]
    expected = []
    for x, y in batches:  # eager: (loss / 2).backward() per half, one step
        eager_opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = loss_fn(eager, xs, ys) / 2
            loss.backward()
            total += loss.item()
        eager_opt.step()
        expected.append(total)
    step = dynajax.train_step(ours, our_opt, loss_fn, accumulate=2)
    actual = [float(step(*batch)) for batch in batches]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    step.sync()  # BatchNorm's statistics saw each micro-batch in turn, as in eager
    _assert_trained_alike(eager, eager_opt, ours, our_opt)
    with pytest.raises(TrainStepError, match="split into that many"):
        step(torch.randn(3, 3, 12, 12), torch.zeros(3, dtype=torch.long))


def test_autocast_inside_the_loss_is_traced_as_eager_runs_it() -> None:
    def bf16_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return F.mse_loss(out.float(), y)

    eager, eager_opt, ours, our_opt, _ = _pair("mlp", OPTIMIZERS["adamw_amsgrad"])
    batches = _batches("mlp")[:10]
    expected = _eager_losses(eager, eager_opt, bf16_loss, batches)
    step = dynajax.train_step(ours, our_opt, bf16_loss)
    actual = [float(step(*batch)) for batch in batches]
    # bfloat16 products: the table's bfloat16 tolerance, on losses of ~1
    np.testing.assert_allclose(actual, expected, rtol=1.6e-2, atol=2e-2)
    # ... and autocast did act: float32 training is farther from both
    plain, plain_opt, *_ = _pair("mlp", OPTIMIZERS["adamw_amsgrad"])
    float32 = np.array(_eager_losses(plain, plain_opt, regression, batches))
    assert np.abs(np.array(actual) - expected).max() < np.abs(float32 - expected).max()
    assert np.abs(np.array(actual) - float32).max() > 1e-4


def test_a_checkpoint_restored_in_a_new_step_continues_as_without_one(tmp_path) -> None:
    batches = _batches("cnn")[:8]
    eager, eager_opt, _, _, loss_fn = _pair("cnn", OPTIMIZERS["adamw_amsgrad"])
    expected = _eager_losses(eager, eager_opt, loss_fn, batches)

    _, _, first, first_opt, _ = _pair("cnn", OPTIMIZERS["adamw_amsgrad"])
    step = dynajax.train_step(first, first_opt, loss_fn)
    actual = [float(step(*batch)) for batch in batches[:4]]
    assert step.save(tmp_path / "ckpt") == 4
    actual.append(float(step(*batches[4])))  # a step after the save, not in the checkpoint

    # A new process's view: a fresh model and optimizer, the checkpoint restored.
    _, _, second, second_opt, _ = _pair("cnn", OPTIMIZERS["adamw_amsgrad"])
    resumed = dynajax.train_step(second, second_opt, loss_fn)
    assert resumed.restore(tmp_path / "ckpt") == 4
    assert resumed.steps == 4
    actual[4:] = [float(resumed(*batch)) for batch in batches[4:]]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    resumed.sync()
    _assert_trained_alike(eager, eager_opt, second, second_opt)
    # torch's view for use outside dynajax
    assert_same(resumed.state_dict(), dict(eager.state_dict()), model=True)
    resumed.save_safetensors(tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    assert_same(load_file(tmp_path / "model.safetensors"), dict(eager.state_dict()), model=True)


def test_a_checkpoint_of_another_model_is_refused_and_nothing_changes(tmp_path) -> None:
    torch.manual_seed(0)
    small = mlp()
    step = dynajax.train_step(small, torch.optim.SGD(small.parameters(), lr=0.1), regression)
    step(*_batches("mlp")[0])
    step.save(tmp_path)
    other = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 8))
    theirs = dynajax.train_step(other, torch.optim.SGD(other.parameters(), lr=0.1), regression)
    before = [np.asarray(a).copy() for a in theirs.params]
    with pytest.raises(TrainStepError, match=r"another model(.|\n)*'0.weight': \[\[32, 16\]"):
        theirs.restore(tmp_path)
    for a, b in zip(theirs.params, before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.raises(TrainStepError, match="no checkpoint 7"):
        step.restore(tmp_path, at=7)


def test_a_parameter_with_no_elements_is_saved_and_restored(tmp_path) -> None:
    """orbax refuses to write an array of size 0; the checkpoint keeps its shape and
    dtype and restore makes it again (the training fuzzer, seed 2 run 54: an SGD
    momentum buffer of shape (0, 3))."""

    class WithEmpty(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 8)
            self.empty = nn.Parameter(torch.zeros(0, 3))
            self.register_buffer("nothing", torch.zeros(0, dtype=torch.int64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) + self.empty.sum() + self.nothing.sum()

    batches = _batches("mlp")[:4]
    torch.manual_seed(0)
    model = WithEmpty()
    step = dynajax.train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), regression
    )
    losses = [float(step(*batch)) for batch in batches[:2]]
    assert step.save(tmp_path) == 2
    losses += [float(step(*batch)) for batch in batches[2:]]

    torch.manual_seed(1)
    other = WithEmpty()
    resumed = dynajax.train_step(
        other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9), regression
    )
    assert resumed.restore(tmp_path) == 2
    assert [float(resumed(*batch)) for batch in batches[2:]] == losses[2:]
    resumed.sync()
    assert other.empty.shape == (0, 3) and other.nothing.dtype == torch.int64
    assert resumed.optimizer.state[other.empty]["momentum_buffer"].shape == (0, 3)


def test_a_process_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path) -> None:
    import json
    import os
    import pathlib
    import signal
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    directory = tmp_path / "ckpt"
    out = subprocess.run(
        [sys.executable, "-m", "tests.training.killed_save_worker", str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    # Killed at the commit of its second save (checkpoint 5): written, not committed.
    assert out.returncode == -signal.SIGKILL, out.stdout[-2000:] + out.stderr[-3000:]
    saved = json.loads(out.stdout.strip().splitlines()[0])["saved"]
    assert sorted(os.listdir(directory)) == ["3", "5.orbax-checkpoint-tmp"]
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    step = dynajax.train_step(model, torch.optim.Adam(model.parameters(), lr=1e-2), regression)
    assert step.restore(directory) == 3  # the last committed one, whole
    for name, value in step.state_dict().items():
        torch.testing.assert_close(value, torch.tensor(saved[name]), rtol=0, atol=0)
    step(torch.randn(8, 8), torch.randn(8, 4))  # and training goes on from it
    assert step.save(directory) == 4


def test_the_host_holds_one_copy_of_the_state_between_syncs() -> None:
    from tests.helpers import run_worker

    released = run_worker("tests.training.memory_worker", "release")
    kept = run_worker("tests.training.memory_worker", "keep")
    size = released["model_bytes"]
    assert size == 256 * 2**20
    # Released, the module's 256 MiB move into the step's arrays: the process grows by
    # the compiled program and JAX's bookkeeping only (about 40 MiB here) ...
    assert released["after_first"] < 0.3 * size
    assert released["after_second"] < 0.3 * size
    # ... where keeping the module's own copy (the measure sees it) adds a whole one.
    assert kept["after_first"] > 0.9 * size


def test_only_the_batch_crosses_per_step(monkeypatch) -> None:
    # Parameters and the optimizer's state stay JAX arrays between steps: per step the
    # batch's tensors cross into JAX (zero-copy), nothing else, and nothing comes back.
    import sys

    from dynajax.runtime import conversion
    from dynajax.sharding import placement

    torch.manual_seed(0)
    model = cnn()
    step = dynajax.train_step(model, torch.optim.Adam(model.parameters()), classification)
    batches = _batches("cnn")
    for batch in batches[:2]:  # (the program compiled and run once more)
        step(*batch)
    crossings = {"to_jax": 0, "gather_to_torch": 0}
    originals = {"to_jax": conversion.to_jax, "gather_to_torch": placement.gather_to_torch}
    # Every module's binding of the two crossings is counted, wherever the code calls them.
    for module in [m for n, m in sys.modules.items() if n.startswith("dynajax")]:
        for name, original in originals.items():
            if getattr(module, name, None) is original:

                def counted(t, name=name, original=original):
                    crossings[name] += 1
                    return original(t)

                monkeypatch.setattr(module, name, counted)
    for batch in batches[2:7]:
        step(*batch)
    assert crossings == {"to_jax": 5 * 2, "gather_to_torch": 0}


def test_a_step_makes_python_code_of_its_traced_graph_only(monkeypatch) -> None:
    # The step's trace is run (its code is made once); the functional graph lowered from
    # it is interpreted, never run, so its code is never made: no GraphModule.recompile
    # per pass (0.17 s each on an 8-layer GPT-2 step, which made 11 of them).
    counts = count_recompiles(monkeypatch)
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", "")  # (traced, not loaded)
    eager, eager_opt, ours, our_opt, loss_fn = _pair("mlp", OPTIMIZERS["adamw_amsgrad"])
    step = dynajax.train_step(ours, our_opt, loss_fn)
    batches = _batches("mlp")[:2]
    actual = [float(step(*batch)) for batch in batches]
    assert counts["recompiles"] == 1  # one trace, one program (AdamW's state made before)
    np.testing.assert_allclose(actual, _eager_losses(eager, eager_opt, loss_fn, batches), rtol=1e-6)
