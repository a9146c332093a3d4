"""Eager's float32 precision in the whole-graph programs (``jax_function``, torch's
backward in JAX, ``train_step``), as in the backend's partitions: PyTorch multiplies
float32 in float32 unless ``torch.set_float32_matmul_precision`` says otherwise, where
JAX's own default on a GPU is TF32. On this CPU the numbers agree either way, so the
tests read the setting in the lowered program and in the persistent cache's key."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import torch
from torch import nn

import dynajax


@contextlib.contextmanager
def _torch_precision(value: str) -> Iterator[None]:
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _precisions(text: str) -> set[str]:
    return set(re.findall(r"precision = \[(\w+)", text))


def test_jax_function_multiplies_at_eagers_precision() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    fn, state = dynajax.jax_function(model, x)
    xs = jnp.asarray(x.numpy())
    for torch_name, jax_name in (("highest", "HIGHEST"), ("high", "HIGH")):
        with _torch_precision(torch_name):
            # (a new function per setting: JAX reuses a function's trace)
            forward = jax.jit(lambda s, x: fn(s, x))
            assert _precisions(forward.lower(state, xs).as_text()) == {jax_name}
            backward = jax.jit(jax.grad(lambda s, x: fn(s, x).sum()))
            assert _precisions(backward.lower(state, xs).as_text()) == {jax_name}


def test_train_steps_precision_keys_its_cached_program(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 8)

    def step_stats() -> dynajax.runtime.cache.CompileStats:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        step = dynajax.train_step(
            model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum()
        )
        float(step(x))
        return step.compile_stats

    assert step_stats().xla_compiles == 1
    assert step_stats().cache_hits == 1  # the same precision: the same program
    with _torch_precision("high"):
        other = step_stats()
    assert (other.xla_compiles, other.cache_hits) == (1, 0)
