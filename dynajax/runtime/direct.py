"""The executable's own entry point, for a partition's calls whose inputs are cached.

The C++ dispatch of a compiled function checks every argument's type, shape and
placement on each call (~0.5 µs each). When every input is a cached array whose
identity, version and pointer ``InputCache.hit`` has just checked, those checks are
known to pass, and the loaded executable can run the very same arrays (~0.15 µs per
argument), its outputs wrapped by the same C++ result handlers the dispatch path uses.
Worth it from ``DIRECT_MIN_INPUTS`` inputs up.

Inputs that are new tensors on every call (a decode step's token, a batch of data,
activations between partitions) are a snapshot's ``volatile`` positions: on the CPU each
is put into an array of the shape and dtype the executable takes, as the dispatch path
would (``jax_internals.array_putter``, ~3.5 µs), in its slot among the cached arrays
(``fresh_args``); a tensor of another shape or dtype takes the regular path. Elsewhere,
or where this JAX release lacks the internal, such snapshots keep the regular path.

``DirectEntry`` decides, after a regular call, whether and how later calls take the
entry point (``CompiledPartition.run``); the partition calls it (``Direct``) itself.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import torch

from dynajax.lowering.checks import CheckTable
from dynajax.runtime.conversion import cpu_device, fast_to_jax
from dynajax.runtime.jax_internals import array_putter, direct_executor

# From this many inputs, a call whose cached inputs are unchanged skips the executable's
# argument checks. Measured side by side (``benchmarks/overhead.py``), the direct entry
# point is cheaper from one input up; with a new token tensor every call
# (``python -m benchmarks.decode --profile``) a decode step costs 6 µs more than with the
# same tensor, 44 µs more on the dispatch path.
DIRECT_MIN_INPUTS = 1


class Fresh(NamedTuple):
    """A per-call input of a direct call: where it goes and how it gets there."""

    slot: int  # its place among the arguments XLA takes
    pos: int  # its input position
    put: Callable[[Any], jax.Array]  # NumPy view -> array (jax_internals.array_putter)
    shape: tuple[int, ...]  # what the executable takes
    dtype: np.dtype


class Direct(NamedTuple):
    """What a call whose inputs are cached runs."""

    snap: Any  # the InputCache snapshot these arguments were taken from
    execute: Callable[[Sequence[jax.Array]], Any]  # the executable's own entry point
    args: list[Any]  # the cached arrays XLA takes, in its order (None: a fresh slot)
    kept: list[int]  # their input positions
    handlers: list[Any]  # the results' handlers (output arrays as the dispatch makes)
    checked: CheckTable | None  # the value checks read from the last output, if any
    fresh: list[Fresh]  # the per-call inputs among them (snap.volatile XLA reads)


def fresh_args(
    cached: list[Any], fresh: list[Fresh], tensors: Sequence[torch.Tensor]
) -> list[Any] | None:
    """The cached arrays with this call's arrays of the per-call inputs ``fresh`` in
    their slots, or None where one is not of the shape and dtype the executable takes."""
    args = cached.copy()
    for slot, pos, put, shape, dtype in fresh:
        view = fast_to_jax(tensors[pos])
        if not isinstance(view, np.ndarray) or view.shape != shape or view.dtype != dtype:
            return None
        args[slot] = put(view)
    return args


class DirectEntry:
    """Whether a partition's calls may take the executable's own entry point, and the
    ``Direct`` they take.

    Args:
        is_open: False where the entry point is never taken (the results of several
            devices: it is checked on one device's outputs only; a partition with a
            seed or under dynamic shapes is found closed at its first try).
        value_checks: the partition's value checks (its last output, where any).
    """

    def __init__(self, *, is_open: bool, value_checks: CheckTable | None) -> None:
        self.is_open = is_open
        self.value_checks = value_checks
        # A snapshot whose per-call inputs cannot take the direct entry point.
        self.refused: Any = None
        # The executable whose direct entry point gave the regular path's outputs.
        self._checked: Any = None

    def after_call(
        self,
        current: Direct | None,
        compiled: Any,
        snap: Any,
        tensors: Sequence[torch.Tensor],
        outs: list[torch.Tensor],
        **how: Any,
    ) -> Direct | None:
        """The ``Direct`` for calls after a regular call of ``tensors`` (outputs
        ``outs``) that left the input cache at a new snapshot ``snap`` (the caller has
        checked that it is one: not ``current``'s, not ``refused``): ``current`` moved
        to it where its arrays are the same, else a new one; None where the entry point
        is closed (for good: ``is_open`` turns False). ``how``: the partition's
        ``needs_seed``, ``dynamic``, ``by_putter`` (per-call inputs reach the entry
        point through a putter: CPU, zero-copy) and ``to_torch`` (its results as
        tensors, for the one check)."""
        if current is not None and all(
            map(operator.is_, current.args, [snap.arrays[i] for i in current.kept])
        ):  # versions moved on (in-place updates), arrays are the same memory
            return current._replace(snap=snap)
        return self._build(compiled, snap, tensors, outs, **how)

    def _build(
        self,
        compiled: Any,
        snap: Any,
        tensors: Sequence[torch.Tensor],
        outs: list[torch.Tensor],
        *,
        needs_seed: bool,
        dynamic: bool,
        by_putter: bool,
        to_torch: Callable[[Any], torch.Tensor],
    ) -> Direct | None:
        """The executable's entry point for ``snap``'s arrays, checked once against the
        regular path's outputs ``outs``; on any mismatch, or where this JAX release
        lacks the entry point (``jax_internals.direct_executor``), closed for good."""
        found = direct_executor(compiled) if compiled is not None else None
        if found is None or needs_seed or dynamic:
            self.is_open = False
            return None
        args = [snap.arrays[i] for i in found.kept]
        fresh: list[Fresh] = []
        if snap.volatile:
            slots = _fresh_slots(compiled, found.kept, snap.volatile) if by_putter else None
            if slots is None:
                self.refused = snap  # not tried again until the inputs change
                return None
            fresh = slots
            args_now = fresh_args(args, fresh, tensors)
            if args_now is None:
                return None
        else:
            args_now = args
        checks = self.value_checks
        checked = checks if checks is not None and checks.checks else None
        if self._checked is compiled:
            # Checked already with other arrays in its slots (the snapshot changed: an
            # input re-promoted to the cache, a parameter replaced); what the check
            # covers is the entry point and the handlers, the same for this executable.
            return Direct(snap, found.execute, args, found.kept, found.handlers, checked, fresh)
        try:
            results = found.execute(args_now).consume_with_handlers(found.handlers)
        except (TypeError, ValueError, RuntimeError):  # XLA refused the arguments
            self.is_open = False
            return None
        if checked is not None:
            results = results[:-1]  # the regular path just passed the same inputs
        check = [to_torch(r) for r in results]
        if not (
            len(check) == len(outs)
            and all(
                a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                for a, b in zip(check, outs, strict=True)
            )
        ):
            self.is_open = False
            return None
        self._checked = compiled
        return Direct(snap, found.execute, args, found.kept, found.handlers, checked, fresh)


def _fresh_slots(compiled: Any, kept: list[int], volatile: list[int]) -> list[Fresh] | None:
    """How each per-call input reaches the entry point: its slot among XLA's arguments,
    its input position and its putter; None where this JAX release has no putter."""
    avals = list(compiled.in_avals[0])
    slot_of = {pos: slot for slot, pos in enumerate(kept)}
    fresh = []
    for pos in volatile:
        if pos not in slot_of:
            continue  # an input XLA dropped: never read
        aval = avals[pos]
        put = array_putter(tuple(aval.shape), aval.dtype, cpu_device())
        if put is None:
            return None
        fresh.append(Fresh(slot_of[pos], pos, put, tuple(aval.shape), np.dtype(aval.dtype)))
    return fresh
