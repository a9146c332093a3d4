"""A Pallas kernel inside a PyTorch model, compiled by dynajax into the model's own XLA
program.

    python examples/pallas_in_torch.py

``dynajax.call_jax`` calls any JAX function (here a Pallas kernel, in interpret mode so
it runs on a CPU) from PyTorch code: eagerly, under autograd (the backward is the JAX
function's VJP), and inside ``torch.compile``, where dynajax inlines it into the
surrounding JAX partition (the report shows one partition and nothing in PyTorch).

A ``pallas_call`` has no reverse-mode derivative of its own, so this runs inference
(``torch.no_grad``); to train through a kernel, give it a ``jax.custom_vjp``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

import dynajax


def _scaled_tanh_kernel(x_ref, o_ref, *, scale):
    o_ref[...] = jnp.tanh(x_ref[...]) * scale


def scaled_tanh(x, *, scale):
    kernel = functools.partial(_scaled_tanh_kernel, scale=scale)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(kernel, out_shape=out, interpret=jax.default_backend() == "cpu")(x)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return dynajax.call_jax(scaled_tanh, h, scale=2.0) + x


def main() -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(8, 32)

    backend = dynajax.Backend()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    with torch.no_grad():
        expected = torch.tanh(block.proj(x)) * 2.0 + x
        eager = block(x)  # the kernel, called eagerly
        out = compiled(x)
    print(f"eager call_jax vs reference:    {float((eager - expected).abs().max()):.2e}")
    print(f"compiled call_jax vs reference: {float((out - expected).abs().max()):.2e}")
    report = dynajax.Report(backend.graphs)
    print(report)
    assert torch.allclose(out, expected, atol=1e-5) and torch.allclose(eager, expected, atol=1e-5)
    assert report.fallbacks == [] and len(report.partitions) == 1


if __name__ == "__main__":
    main()
