"""CompiledPartition: one JAX partition, jitted, with conversion at its edges."""

from __future__ import annotations

from collections.abc import Callable
import jax
import numpy as np
import torch

from dynajax.lowering.interpreter import needs_key, to_jax_function
from dynajax.runtime.conversion import to_jax, to_torch


class CompiledPartition(torch.nn.Module):
    """Calls a jitted JAX function on torch tensors and returns torch tensors.

    It is an ``nn.Module`` so that the stitched GraphModule can hold it as the
    submodule ``jax_<n>``; ``__call__`` is overridden to skip nn.Module's hook
    machinery on the per-call path.

    Args:
        name: the partition's name (``jax_0``).
        fn: pure JAX function ``fn([seed,] *arrays) -> tuple of arrays``.
        needs_seed: ``fn`` takes a leading int64 seed for its random ops, drawn from
            PyTorch's default generator on every call (``torch.manual_seed`` applies).
        graph: the ATen graph this partition computes (kept for reports).
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., tuple[jax.Array, ...]],
        needs_seed: bool,
        graph: torch.fx.GraphModule,
    ) -> None:
        super().__init__()
        self.name = name
        self.needs_seed = needs_seed
        self.__dict__["graph_module"] = graph  # not a submodule: never called
        self._jitted = jax.jit(fn)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        arrays = [to_jax(t) for t in tensors]
        if self.needs_seed:
            arrays.insert(0, _draw_seed())
        with jax.enable_x64(True):  # a fresh context each call: they are not reentrant
            outs = self._jitted(*arrays)
        return tuple(to_torch(o) for o in outs)

    forward = __call__


def _draw_seed() -> np.ndarray:
    return np.asarray(torch.randint(0, 2**62, (), dtype=torch.int64).item(), np.int64)


def compile_partition(name: str, gm: torch.fx.GraphModule) -> CompiledPartition:
    """Lowers the ATen graph ``gm`` to JAX and wraps it for calls from torch."""
    return CompiledPartition(name, to_jax_function(gm), needs_key(gm), gm)

