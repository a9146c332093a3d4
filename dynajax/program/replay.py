"""Random numbers drawn again from a generator state that drew before, as in eager.

``torch.utils.checkpoint`` restores the CPU generator's state before it recomputes a
region in the backward, so that the recomputed dropout masks are the forward's. A
trace through the backward (``train_step``, torch's backward in ``jax_function``)
keeps that promise with ``ReplayedRandom`` around the forward and the backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


class ReplayedRandom(TorchDispatchMode):
    """Random ops drawn again from a generator state that drew before give what they
    gave then, as in eager: ``torch.utils.checkpoint`` restores the CPU generator's
    state before it recomputes a region in the backward, so that its dropout masks are
    the forward's. In the trace a random op reads no generator (its numbers come from
    the program's key), so here each random op moves the CPU generator on by a step of
    its own, and one called again where the generator stands as it stood for an
    earlier call of the same op on the same arguments is that earlier call's result
    (the graph's recomputation reads the forward's mask; an in-place op such as
    ``bernoulli_`` writes a copy of what it wrote then). ``restore`` puts the
    generator back as it was before the trace."""

    def __init__(self) -> None:
        super().__init__()
        with _disable_current_modes():
            self._saved = torch.default_generator.get_state()
        self._seen: dict[Any, Any] = {}

    def restore(self) -> None:
        with _disable_current_modes():
            torch.default_generator.set_state(self._saved)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        gen = torch.default_generator
        with _disable_current_modes():
            state = hash(gen.get_state().numpy().tobytes())
        key = (func, state, _signature((args, kwargs)))
        in_place = func._schema.is_mutable  # bernoulli_: fills its first argument
        if key not in self._seen:
            out = func(*args, **kwargs)
            # What the op wrote, as it wrote it (the tensor may be written again later).
            self._seen[key] = out.clone() if in_place else out
        elif in_place:
            out = args[0].copy_(self._seen[key])
        else:
            out = self._seen[key]
        with _disable_current_modes():
            gen.manual_seed(state & 0x7FFF_FFFF_FFFF_FFFF)  # the next state, from this one
        return out


def _signature(tree: Any) -> Any:
    """Arguments as a key: a tensor by its shape and dtype (the recomputation's are
    other tensors of the same values)."""
    leaves, spec = pytree.tree_flatten(tree)
    return str(spec), tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves
    )
