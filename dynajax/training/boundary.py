"""The shapes a step's state has at its program's boundary.

On one CPU device, ``train_step``'s program takes and returns each state array of 3 or
more dimensions (a convolution's weight, its optimizer moments) flat, and
``passes/flat_updates.py`` makes the elementwise update of those arrays flat inside it:
XLA's CPU compiler emits an elementwise fusion with a short last dimension (a 3x3
window) unvectorized, several times slower than the same update on a flat array. The
step keeps its arrays in their own shapes between steps (what syncs, checkpoints and
the module read); around each call ``FlatBoundary`` reshapes the arrays that cross it
flat, in small programs that donate them (the output aliases the input's buffer: no
copy, about 0.1 ms for ResNet-18's 62 arrays both ways).

Elsewhere (a GPU, a mesh) every array crosses in its own shape and there is no
``FlatBoundary``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax

Shapes = Sequence[Sequence[tuple[int, ...]]]  # the shapes of each group of arrays


def flat_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape an array of ``shape`` crosses the program in: flat where its last
    dimensions can be a convolution's window (3 or more dimensions), else its own."""
    return (math.prod(shape),) if len(shape) >= 3 else tuple(shape)


def flat_avals(groups: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """The state arrays' abstract values as ``FlatBoundary.stored`` gives them to the
    program (``jax.ShapeDtypeStruct``s where flat), for lowering."""
    return [
        [
            a
            if flat_shape(a.shape) == tuple(a.shape)
            else jax.ShapeDtypeStruct(flat_shape(a.shape), a.dtype, sharding=a.sharding)
            for a in group
        ]
        for group in groups
    ]


@functools.lru_cache(maxsize=64)
def _reshaper(shapes: tuple[tuple[int, ...], ...]) -> Any:
    """The donating reshape of arrays into ``shapes``; one per list of shapes, so that
    the programs of a step's boundaries share what they can (the first step's outputs
    leave as the steady program's do: one compile)."""

    def reshape(arrays: list[Any]) -> list[Any]:
        return [a.reshape(s) for a, s in zip(arrays, shapes, strict=True)]

    return jax.jit(reshape, donate_argnums=0)


class FlatBoundary:
    """Which arrays of a step's state cross its program's boundary flat.

    Args:
        inputs: the shapes of the state the program takes, in groups (parameters,
            buffers, optimizer state).
        outputs: the shapes of the state it returns, in the same groups.
    """

    def __init__(self, inputs: Shapes, outputs: Shapes) -> None:
        self.inputs = [[tuple(s) for s in group] for group in inputs]
        self.outputs = [[tuple(s) for s in group] for group in outputs]
        self._in = self._flat(self.inputs)
        self._out = self._flat(self.outputs)
        self._to_flat = _reshaper(tuple(flat_shape(self.inputs[g][i]) for g, i in self._in))
        self._to_inputs = _reshaper(tuple(self.inputs[g][i] for g, i in self._in))
        self._to_shapes = _reshaper(tuple(self.outputs[g][i] for g, i in self._out))

    @staticmethod
    def _flat(groups: list[list[tuple[int, ...]]]) -> list[tuple[int, int]]:
        return [
            (g, i)
            for g, group in enumerate(groups)
            for i, s in enumerate(group)
            if flat_shape(s) != s
        ]

    def __bool__(self) -> bool:
        return bool(self._in or self._out)

    def flat_outputs(self, offsets: Sequence[int]) -> list[int]:
        """The indices of the graph's outputs that leave flat, given where each group
        of the state starts among them."""
        return [offsets[g] + i for g, i in self._out]

    def stored(self, groups: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """The state arrays as the program takes them (the flat ones donated)."""
        return _splice(groups, self._in, self._to_flat([groups[g][i] for g, i in self._in]))

    def unstored(self, groups: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """``stored``'s inverse: the state the program took, in its own shapes."""
        return _splice(groups, self._in, self._to_inputs([groups[g][i] for g, i in self._in]))

    def shaped(self, groups: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """The program's state outputs in their own shapes (the flat ones donated)."""
        return _splice(groups, self._out, self._to_shapes([groups[g][i] for g, i in self._out]))

    def inside(self, groups: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """In the program (traced): the state it took, in its own shapes."""
        out = [list(group) for group in groups]
        for g, i in self._in:
            out[g][i] = out[g][i].reshape(self.inputs[g][i])
        return out

    def leaving(self, groups: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """In the program (traced): the state it returns, as it leaves."""
        out = [list(group) for group in groups]
        for g, i in self._out:
            out[g][i] = out[g][i].reshape(flat_shape(self.outputs[g][i]))
        return out


def _splice(
    groups: Sequence[Sequence[Any]], at: list[tuple[int, int]], values: list[Any]
) -> list[list[Any]]:
    out = [list(group) for group in groups]
    for (g, i), v in zip(at, values, strict=True):
        out[g][i] = v
    return out
