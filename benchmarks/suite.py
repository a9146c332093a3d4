"""The whole model suite as benchmark rows: ``python -m benchmarks.run --suite models``.

Every model the tests run end to end (``tests/test_models.py``'s ``CASES`` and the
``transformers`` zoo of ``tests/models.py``, at the tests' tiny sizes and inputs) becomes
an inference row (group ``model``) and, with ``--train``, a training row (group
``training``: forward, a mean-square loss on the first output, backward, and an eager
SGD step, as in ``benchmarks/training.py``). The rows are built here, not registered in
``WORKLOADS``: the main table stays the one the README reports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.workloads import Compile, Step, Workload

Build = Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]


def suite_models() -> dict[str, Build]:
    """name -> builder of (model, positional inputs, keyword inputs), seeded by the caller."""
    from tests.test_models import CASES, ZOO

    builds: dict[str, Build] = {}
    for name, case in CASES.items():
        builds[name] = lambda case=case: (*_pair(case()), {})
    for name, (build, inputs) in ZOO.items():
        builds[f"hf-{name}"] = lambda build=build, inputs=inputs: (build(), (), inputs())
    return builds


def _pair(case: tuple[nn.Module, torch.Tensor]) -> tuple[nn.Module, tuple[Any, ...]]:
    model, x = case
    return model, (x,)


def _first_float(out: Any) -> torch.Tensor:
    """The tensor a training row's loss is taken from: the model's first float output."""
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    raise TypeError(f"no floating-point tensor among the outputs ({type(out).__name__})")


def _inference(build: Build) -> Callable[[Compile], Step]:
    def setup(compile: Compile) -> Step:
        torch.manual_seed(0)
        model, args, kwargs = build()
        model.eval()
        f = compile(model)
        return lambda: f(*args, **kwargs)

    return setup


def _training(build: Build) -> Callable[[Compile], Step]:
    def setup(compile: Compile) -> Step:
        torch.manual_seed(0)
        model, args, kwargs = build()
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        f = compile(model)

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = _first_float(f(*args, **kwargs)).float().square().mean()
            loss.backward()
            opt.step()
            return loss

        return step

    return setup


def suite_workloads(train: bool = False, only: list[str] | None = None) -> dict[str, Workload]:
    """The suite's rows: ``<model>`` for inference, ``<model>-train`` with ``train``."""
    rows: dict[str, Workload] = {}
    for name, build in suite_models().items():
        if only is not None and name not in only:
            continue
        # inner: 10 calls per round, each timed alone (5 rounds of 1 call on a loaded
        # machine left single preemptions as medians)
        rows[name] = Workload(
            name, "model", _inference(build), description=f"{name}, eval", inner=10
        )
        if train:
            rows[f"{name}-train"] = Workload(
                f"{name}-train",
                "training",
                _training(build),
                description=f"{name}: forward + backward + SGD step",
                inner=3,
                no_grad=False,
            )
    return rows
