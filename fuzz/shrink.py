"""Shrinking a failing program to a small one that still fails the same way.

Greedy and deterministic: each simplification below proposes candidate programs, and
the first candidate that still fails (``fails``, which the caller defines: the same
``Mismatch.key`` for the fuzzer) replaces the program; passes repeat until none helps
or the budget is spent. In the order tried:

1. keep a prefix of the ops (what follows the failing op rarely matters);
2. drop one op, its result replaced by its first argument, or with every op that
   reads it;
3. drop an output;
4. an in-place op becomes its out-of-place kind (later reads see the new value);
5. no gradients, then one input at a time not requiring grad;
6. inputs contiguous, without special values or out-of-range indices, and arguments
   rather than a module's parameters or buffers;
7. simpler dtypes: float32 for floating inputs and dtype parameters, int64 for int32;
8. smaller inputs: each dim to 1, then to half its size.

A candidate that no longer runs (a shape an op's parameters no longer fit) simply
does not fail the same way, so it is not kept; no simplification needs to know the ops.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from fuzz import ops
from fuzz.program import (
    CONTIGUOUS,
    FLOAT_DTYPES,
    INPUT,
    NORMAL,
    OpRecord,
    Program,
    TensorInput,
    compact,
)

Candidates = Callable[[Program], list[Program]]


def _defined(program: Program) -> bool:
    """Every value is defined before it is read."""
    known = set(range(len(program.inputs)))
    for rec in program.ops:
        if any(a not in known for a in rec.args):
            return False
        if rec.out is not None:
            known.add(rec.out)
    return all(o in known for o in program.outputs)


def _substitute(program: Program, old: int, new: int, start: int) -> Program:
    """Reads of ``old`` by ops from ``start`` on, and the outputs, read ``new``."""
    ops_ = list(program.ops)
    for i in range(start, len(ops_)):
        rec = ops_[i]
        ops_[i] = dataclasses.replace(rec, args=tuple(new if a == old else a for a in rec.args))
    outputs = tuple(dict.fromkeys(new if o == old else o for o in program.outputs))
    return program.replace(ops=tuple(ops_), outputs=outputs)


def _without_dependents(program: Program, i: int) -> Program:
    """``program`` without op ``i`` and every op that reads what it defines (and
    outputs of those); the outputs fall back to the last value left if none remain."""
    dead = {program.ops[i].out} - {None}
    kept: list[OpRecord] = []
    for j, rec in enumerate(program.ops):
        if j == i or (dead & set(rec.args)):
            if rec.out is not None:
                dead.add(rec.out)
            continue
        kept.append(rec)
    outputs = tuple(o for o in program.outputs if o not in dead)
    if not outputs:
        last = [r.out for r in kept if r.out is not None]
        outputs = tuple(last[-1:]) or (0,)
    return program.replace(ops=tuple(kept), outputs=outputs)


def _prefixes(program: Program) -> list[Program]:
    out = []
    for n in range(1, len(program.ops)):
        ops_ = program.ops[:n]
        defined = {r.out for r in ops_} - {None}
        outputs = tuple(o for o in program.outputs if o in defined or o < len(program.inputs))
        last = [r.out for r in ops_ if r.out is not None]
        out.append(program.replace(ops=ops_, outputs=outputs or tuple(last[-1:]) or (0,)))
    return out


def _drop_ops(program: Program) -> list[Program]:
    out = []
    for i in reversed(range(len(program.ops))):
        rec = program.ops[i]
        without = program.replace(ops=program.ops[:i] + program.ops[i + 1 :])
        if rec.out is None:
            out.append(without)
            continue
        if rec.args:
            out.append(_substitute(without, rec.out, rec.args[0], i))
        out.append(_without_dependents(program, i))
    return out


def _drop_outputs(program: Program) -> list[Program]:
    if len(program.outputs) < 2:
        return []
    return [
        program.replace(outputs=program.outputs[:j] + program.outputs[j + 1 :])
        for j in range(len(program.outputs))
    ]


def _functional(program: Program) -> list[Program]:
    out = []
    next_out = max([r.out for r in program.ops if r.out is not None], default=999) + 1
    for i, rec in enumerate(program.ops):
        kind = ops.functional_of(ops.KINDS[rec.kind])
        if kind is None or not rec.args:
            continue
        new = dataclasses.replace(rec, kind=kind.name, out=next_out)
        candidate = program.replace(ops=program.ops[:i] + (new,) + program.ops[i + 1 :])
        out.append(_substitute(candidate, rec.args[0], next_out, i + 1))
    return out


def _no_grad(program: Program) -> list[Program]:
    out = [program.replace(grad=False)] if program.grad else []
    for i, spec in enumerate(program.inputs):
        if spec.requires_grad:
            inputs = list(program.inputs)
            inputs[i] = dataclasses.replace(spec, requires_grad=False)
            out.append(program.replace(inputs=tuple(inputs)))
    return out


def _input_variants(
    program: Program, change: Callable[[TensorInput], list[TensorInput]]
) -> list[Program]:
    out = []
    for i, spec in enumerate(program.inputs):
        for new in change(spec):
            if new != spec:
                inputs = list(program.inputs)
                inputs[i] = new
                out.append(program.replace(inputs=tuple(inputs)))
    return out


def _plain_inputs(program: Program) -> list[Program]:
    def change(spec: TensorInput) -> list[TensorInput]:
        return [
            dataclasses.replace(spec, layout=CONTIGUOUS),
            dataclasses.replace(spec, specials=False),
            dataclasses.replace(spec, bad=False),
            dataclasses.replace(spec, role=INPUT),
        ]

    return _input_variants(program, change)


def _simple_dtypes(program: Program) -> list[Program]:
    def change(spec: TensorInput) -> list[TensorInput]:
        if spec.kind != NORMAL:
            return []
        if spec.dtype in FLOAT_DTYPES and spec.dtype != "float32":
            return [dataclasses.replace(spec, dtype="float32")]
        if spec.dtype == "int32":
            return [dataclasses.replace(spec, dtype="int64")]
        return []

    out = _input_variants(program, change)
    for i, rec in enumerate(program.ops):
        dtype = rec.p.get("dtype")
        if dtype in FLOAT_DTYPES and dtype != "float32":
            params = tuple((k, "float32" if k == "dtype" else v) for k, v in rec.params)
            new = dataclasses.replace(rec, params=params)
            out.append(program.replace(ops=program.ops[:i] + (new,) + program.ops[i + 1 :]))
    return out


def _smaller_inputs(program: Program) -> list[Program]:
    def change(spec: TensorInput) -> list[TensorInput]:
        variants = []
        for d, size in enumerate(spec.shape):
            for new in dict.fromkeys([1, size // 2]):
                if 0 < new < size:
                    shape = (*spec.shape[:d], new, *spec.shape[d + 1 :])
                    variants.append(dataclasses.replace(spec, shape=shape))
        return variants

    return _input_variants(program, change)


SIMPLIFICATIONS: tuple[Candidates, ...] = (
    _prefixes,
    _drop_ops,
    _drop_outputs,
    _functional,
    _no_grad,
    _plain_inputs,
    _simple_dtypes,
    _smaller_inputs,
)


@dataclasses.dataclass
class ShrinkStats:
    """What a shrink did: candidates checked, kept, and whether the budget ran out."""

    checks: int = 0
    kept: int = 0
    out_of_budget: bool = False


def _candidates(program: Program, make: Candidates) -> Iterator[Program]:
    for candidate in make(program):
        if _defined(candidate):
            yield compact(candidate)


def shrink(
    program: Program,
    fails: Callable[[Program], bool],
    *,
    seconds: float = 90.0,
    max_checks: int = 400,
    stats: ShrinkStats | None = None,
) -> Program:
    """The smallest program reached from ``program`` on which ``fails`` holds.

    Args:
        program: a program on which ``fails`` holds.
        fails: whether a candidate still fails the same way.
        seconds: the time budget; the best program so far is returned when it ends.
        max_checks: the most candidates checked.
        stats: filled with what the shrink did, if given.
    """
    stats = stats if stats is not None else ShrinkStats()
    deadline = time.monotonic() + seconds
    current = compact(program)
    seen = {current}
    progress = True
    while progress:
        progress = False
        for make in SIMPLIFICATIONS:
            index = 0
            while True:
                candidates = list(_candidates(current, make))
                if index >= len(candidates):
                    break
                candidate = candidates[index]
                index += 1
                if candidate in seen:
                    continue
                seen.add(candidate)
                if time.monotonic() > deadline or stats.checks >= max_checks:
                    stats.out_of_budget = True
                    return current
                stats.checks += 1
                if fails(candidate):
                    current, progress = candidate, True
                    stats.kept += 1
                    index -= 1
    return current
