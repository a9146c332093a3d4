"""The benchmark workloads: one registry, ``WORKLOADS``, keyed by name.

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

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Compile = Callable[[Callable[..., Any]], Callable[..., Any]]
Step = Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark row.

    Attributes:
        name: row id (``--workloads`` selects by it).
        group: "overhead", "model" or "training".
        setup: ``setup(compile) -> step``; builds model and inputs (seeded), compiles
            with the peer's ``compile``, returns the zero-argument step to time.
        jax_setup: ``() -> step`` of a hand-written raw ``jax.jit`` floor, or None to use
            the function dynajax lowered (fed ``jax.Array``s directly).
        description: one line for the table's legend.
        quick: part of ``--quick``.
        inner: calls per peer per round, each timed alone (many for µs-scale rows).
        memory_calls: if > 0, run that many more calls and report RSS and live JAX
            buffers before and after (must stay flat).
        no_grad: run the step under ``torch.no_grad()`` (inference rows).
        default: part of a run that names no rows (False: a row too heavy for every run,
            run where named, as ``benchmarks.memory`` names its large model).
    """

    name: str
    group: str
    setup: Callable[[Compile], Step]
    jax_setup: Callable[[], Step] | None = None
    description: str = ""
    quick: bool = False
    inner: int = 1
    memory_calls: int = 0
    no_grad: bool = True
    default: bool = True


WORKLOADS: dict[str, Workload] = {}


def default_rows(workloads: dict[str, Workload] = WORKLOADS) -> list[str]:
    """The rows a run that names none runs (every row but the heavy ones)."""
    return [n for n, w in workloads.items() if w.default]


def register(w: Workload) -> Workload:
    if w.group not in ("overhead", "model", "training", "interleaved"):
        raise ValueError(f"workload {w.name!r}: unknown group {w.group!r}")
    WORKLOADS[w.name] = w
    return w


def _seeded() -> None:
    torch.manual_seed(0)


# -- the device every row runs on (``python -m benchmarks.run --device cuda``) ----------

DEVICE_ENV = "DYNAJAX_BENCH_DEVICE"  # inherited by first-call worker processes


def device() -> torch.device:
    """The torch device of every row's model and inputs (default: CPU)."""
    return torch.device(os.environ.get(DEVICE_ENV) or "cpu")


def placed(model: nn.Module, args: tuple[Any, ...]) -> tuple[nn.Module, tuple[Any, ...]]:
    """``model`` and its tensor arguments moved to ``device()``."""
    d = device()
    return model.to(d), tuple(a.to(d) if isinstance(a, torch.Tensor) else a for a in args)


def jax_put(x: Any) -> Any:
    """``x`` (NumPy or JAX) on the JAX device matching ``device()``, for the JAX floors."""
    import jax

    platform = "gpu" if device().type == "cuda" else "cpu"
    return jax.device_put(x, jax.devices(platform)[0])


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


def mlp_model() -> tuple[nn.Module, tuple[Any, ...]]:
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
    return model, (torch.randn(64, 512),)


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


def encoder_model() -> tuple[nn.Module, tuple[Any, ...]]:
    model = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    return model, (torch.randn(8, 128, 256),)


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


def attention_model() -> tuple[nn.Module, tuple[Any, ...]]:
    return _CausalSelfAttention(256, 4), (torch.randn(8, 512, 256),)


def gpt2_model(
    layers: int = 4, width: int = 256, heads: int = 4, vocab: int = 1024, batch: int = 4
) -> tuple[nn.Module, tuple[Any, ...]]:
    """A GPT-2 built from its config, on (batch, 128) tokens (by default the rows'
    4-layer one)."""
    from tests.models import gpt2, tokens

    model = gpt2(layers=layers, width=width, heads=heads, vocab=vocab)
    return model, (tokens(batch, 128, vocab),)


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


def resnet_model() -> tuple[nn.Module, tuple[Any, ...]]:
    return ResNet18(), (torch.randn(8, 3, 64, 64),)


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
