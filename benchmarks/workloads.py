"""The benchmark workloads: one registry, ``WORKLOADS``, keyed by name.

Import ``WORKLOADS`` from here: this module registers its rows, then imports
``benchmarks/training.py``, which registers the training rows. (The registry itself,
``Workload`` and ``register`` are in ``benchmarks/registry.py``, the rows' models in
``benchmarks/models.py``; both are re-exported here.)

A workload knows how to build a zero-argument *step* for any peer. ``setup(compile)``
receives the peer's compile function (identity for eager, ``torch.compile`` with the
peer's backend otherwise) and returns ``step()``, the thing that is timed: one forward
call, or for training rows, forward + backward + optimizer step. The raw-JAX floor is
``jax_setup()`` where a hand-written JAX version exists; for the rest, the harness takes
the function dynajax itself lowered and jitted, and calls it on ``jax.Array`` inputs
(the same computation with no torch boundary at all).

To add a row (e.g. a training step), append a ``Workload`` with ``register``:

    def _mlp_train(compile):
        model = ...; opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        fwd = compile(model)
        def step():
            opt.zero_grad(set_to_none=True)
            fwd(x).square().mean().backward()
            opt.step()
        return step

    register(Workload("mlp-train", "training", _mlp_train, description="..."))

Groups: ``overhead`` rows measure per-call cost; ``model`` and ``training`` rows enter
the geometric means of the targets; ``interleaved`` rows time a compiled call and an
eager PyTorch call of the same size in turn (``step.parts`` keeps each call's time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# The models and the registry are shared with benchmarks/training.py, which imports
# them from there (not from here): the names stay importable from this module.
from benchmarks.models import ResNet18 as ResNet18
from benchmarks.models import attention_model, encoder_model, gpt2_model, mlp_model, resnet_model
from benchmarks.models import gpt2_small_model as gpt2_small_model
from benchmarks.registry import DEVICE_ENV as DEVICE_ENV
from benchmarks.registry import WORKLOADS as WORKLOADS
from benchmarks.registry import Compile, Step, Workload, device, jax_put, placed, register
from benchmarks.registry import default_rows as default_rows
from benchmarks.registry import grid_rows as grid_rows


def _seeded() -> None:
    torch.manual_seed(0)


# -- overhead rows ---------------------------------------------------------------------


def _add_one(compile: Compile) -> Step:
    x = torch.zeros(1, device=device())
    f = compile(lambda x: x + 1)
    return lambda: f(x)


def _add_one_jax() -> Step:
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: x + 1)
    x = jax_put(jnp.zeros(1))
    return lambda: f(x).block_until_ready()


N_SMALL = 100


def _sum_inputs(*xs: torch.Tensor) -> torch.Tensor:
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc


def _many_inputs(compile: Compile) -> Step:
    xs = [torch.full((4,), float(i), device=device()) for i in range(N_SMALL)]
    f = compile(_sum_inputs)
    return lambda: f(*xs)


def _many_inputs_jax() -> Step:
    import jax
    import jax.numpy as jnp

    f = jax.jit(_sum_inputs)
    xs = [jax_put(jnp.full((4,), float(i))) for i in range(N_SMALL)]
    return lambda: f(*xs).block_until_ready()


register(
    Workload(
        "add-one",
        "overhead",
        _add_one,
        _add_one_jax,
        description="x + 1 on a 1-element float32 tensor",
        quick=True,
        inner=200,
        memory_calls=1000,
    )
)
register(
    Workload(
        "100-inputs",
        "overhead",
        _many_inputs,
        _many_inputs_jax,
        description=f"sum of {N_SMALL} float32[4] inputs",
        quick=True,
        inner=100,
        memory_calls=1000,
    )
)


# -- model rows (eval + no_grad) -------------------------------------------------------


def _model_step(build: Callable[[], tuple[nn.Module, tuple[Any, ...]]]) -> Callable[..., Step]:
    def setup(compile: Compile) -> Step:
        _seeded()
        model, args = placed(*build())
        model.eval()
        f = compile(model)
        return lambda: f(*args)

    return setup


def _mlp_jax() -> Step:
    import jax
    import jax.numpy as jnp

    _seeded()
    model, (x,) = mlp_model()
    w1, b1, w2, b2 = (jax_put(p.detach().numpy()) for p in model.parameters())

    # PyTorch's float32 products are exact float32 at its default precision ("highest");
    # JAX's default on a GPU is TF32. The floor computes what the peers compute.
    exact = torch.get_float32_matmul_precision() == "highest"
    precision = jax.lax.Precision.HIGHEST if exact else None

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        h = jnp.maximum(jnp.matmul(x, w1.T, precision=precision) + b1, 0)
        return jnp.matmul(h, w2.T, precision=precision) + b2

    xa = jax_put(x.numpy())
    return lambda: f(xa).block_until_ready()


register(
    Workload(
        "mlp",
        "model",
        _model_step(mlp_model),
        _mlp_jax,
        description="MLP 512-2048-512, batch 64",
        quick=True,
        memory_calls=1000,
    )
)
register(
    Workload(
        "encoder-layer",
        "model",
        _model_step(encoder_model),
        description="nn.TransformerEncoderLayer(256, 4, 1024) on (8, 128, 256)",
    )
)
register(
    Workload(
        "gpt2",
        "model",
        _model_step(gpt2_model),
        description="transformers GPT-2 LM, 4 layers, width 256, vocab 1024, (4, 128)",
    )
)
register(
    Workload(
        "attention-512",
        "model",
        _model_step(attention_model),
        description="causal self-attention (SDPA), width 256, 4 heads, on (8, 512, 256)",
    )
)
register(
    Workload(
        "resnet18",
        "model",
        _model_step(resnet_model),
        description="ResNet-18-shaped CNN on (8, 3, 64, 64)",
    )
)


# -- the grid: each model row at a smaller and a larger size (``--grid``) --------------

_GRID: list[tuple[str, str, Callable[[], tuple[nn.Module, tuple[Any, ...]]], str]] = [
    ("mlp", "mlp-b8", lambda: mlp_model(batch=8), "MLP 512-2048-512, batch 8"),
    ("mlp", "mlp-b512", lambda: mlp_model(batch=512), "MLP 512-2048-512, batch 512"),
    ("encoder-layer", "encoder-layer-2x64", lambda: encoder_model(2, 64), "on (2, 64, 256)"),
    ("encoder-layer", "encoder-layer-8x512", lambda: encoder_model(8, 512), "on (8, 512, 256)"),
    ("gpt2", "gpt2-2x64", lambda: gpt2_model(batch=2, seq=64), "the GPT-2 row on (2, 64)"),
    ("gpt2", "gpt2-8x256", lambda: gpt2_model(batch=8, seq=256), "the GPT-2 row on (8, 256)"),
    ("attention-512", "attention-128", lambda: attention_model(8, 128), "on (8, 128, 256)"),
    ("attention-512", "attention-1024", lambda: attention_model(4, 1024), "on (4, 1024, 256)"),
    ("resnet18", "resnet18-32px", lambda: resnet_model(8, 32), "on (8, 3, 32, 32)"),
    ("resnet18", "resnet18-128px", lambda: resnet_model(8, 128), "on (8, 3, 128, 128)"),
]
for _base, _name, _build, _what in _GRID:
    register(
        Workload(
            _name,
            "model",
            _model_step(_build),
            description=_what,
            default=False,
            size_of=_base,
        )
    )


# -- interleaved rows: a compiled call, then an eager PyTorch call, repeated -----------


def _interleaved(build: Callable[[], tuple[nn.Module, tuple[Any, ...]]]) -> Callable[..., Step]:
    """The row's model compiled, each call followed by an eager call of another model of
    the same size, as a real program runs eager work between compiled calls. The step
    records each call's seconds in ``step.parts`` (``"compiled"``, ``"eager"``); eager's
    own row is two eager calls."""

    def setup(compile: Compile) -> Step:
        _seeded()
        model, args = placed(*build())
        other, other_args = placed(*build())
        f = compile(model.eval())
        other.eval()
        clock = time.perf_counter
        parts: dict[str, list[float]] = {"compiled": [], "eager": []}

        def step() -> Any:
            t0 = clock()
            out = f(*args)
            t1 = clock()
            other(*other_args)
            t2 = clock()
            parts["compiled"].append(t1 - t0)
            parts["eager"].append(t2 - t1)
            return out

        step.parts = parts  # type: ignore[attr-defined]
        return step

    return setup


register(
    Workload(
        "mlp-interleaved",
        "interleaved",
        _interleaved(mlp_model),
        description="the MLP row's call, then an eager call of another MLP of its size",
    )
)
register(
    Workload(
        "gpt2-interleaved",
        "interleaved",
        _interleaved(gpt2_model),
        description="the GPT-2 row's call, then an eager call of another GPT-2 of its size",
    )
)


# -- training rows (forward + backward + optimizer step): benchmarks/training.py --------

from benchmarks import training as _training  # noqa: E402,F401  (registers its rows)
