"""The two ways an OpInfo sample may differ from eager and still be right.

``tests/tolerances.assert_same`` is the first comparison of every sample: dynajax's
result within the tolerance table of eager's. When it fails, the harness asks, in
this order, whether the difference is one PyTorch itself leaves open:

``ties``
    ``sort``/``argsort`` without ``stable=True``, ``topk``, ``kthvalue`` and ``mode``
    return the index of *some* element among equal values; PyTorch's CPU kernels pick
    one by their introsort, quickselect or sort order. Accepted when the values match eager and the
    indices are a valid answer: they pick, from the input, exactly eager's values along
    the op's dim (and, for ``sort``/``argsort``, form a permutation; for ``topk``,
    distinct positions).
``float64``
    Floating-point results that differ from eager's by more than the tolerance because
    the two round differently (a fused or reordered computation, an ill-conditioned
    sample). The sample runs once more in eager PyTorch in float64 (complex128), and
    each floating output of dynajax must be at least as close to that result as
    eager's own output is: ``max |ours - f64| <= max |eager - f64| + atol`` (atol of
    the dtype from the tolerance table), with NaN and infinities where the float64
    result has them. This is the criterion PyTorch's own tests use for its reference
    implementations. Non-floating outputs must still equal eager's exactly.

Both are reported apart from plain matches (``Outcome.accuracy``), per dtype, by
``python -m tests.opinfo_full``.
"""

from __future__ import annotations

from typing import Any

import torch

# distance() is the package's (dynajax.debug uses the same float64 criterion); fuzz/
# imports it from here.
from dynajax.debug.accuracy import distance
from tests.tolerances import assert_same, assert_same_layout, tolerance

TIES, FLOAT64 = "ties", "float64"

# op name -> (position of ``dim`` in the sample's args, position of ``keepdim``,
# whether the indices are the op's only output, whether they are a permutation)
_TIE_OPS: dict[str, tuple[int, int | None, bool, bool]] = {
    "sort": (0, None, False, True),
    "argsort": (0, None, True, True),
    "topk": (1, None, False, False),
    "kthvalue": (1, 2, False, False),
    "mode": (0, 1, False, False),
}


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str, default: Any) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _assert_valid_ties(op_name: str, sample: Any, actual: Any, expected: Any) -> None:
    dim_pos, keepdim_pos, indices_only, permutation = _TIE_OPS[op_name]
    x, args, kwargs = sample.input, tuple(sample.args), dict(sample.kwargs)
    if op_name in ("sort", "argsort") and kwargs.get("stable"):
        raise AssertionError("stable sort: the order of ties is specified")
    if indices_only:
        ours, theirs = actual, expected
    else:
        assert_same(actual[0], expected[0], path="out[0]")
        ours, theirs = actual[1], expected[1]
    assert ours.shape == theirs.shape, f"indices: shape {ours.shape} != {theirs.shape}"
    if x.dim() == 0:
        assert_same(ours, theirs, path="indices")
        return
    dim = _arg(args, kwargs, dim_pos, "dim", -1) % x.dim()
    keepdim = keepdim_pos is not None and _arg(args, kwargs, keepdim_pos, "keepdim", False)
    if keepdim_pos is not None and not keepdim:
        ours, theirs = ours.unsqueeze(dim), theirs.unsqueeze(dim)
    n = x.shape[dim]
    assert bool(((ours >= 0) & (ours < max(n, 1))).all()), "indices out of range"
    picked, wanted = x.gather(dim, ours), x.gather(dim, theirs)
    torch.testing.assert_close(picked, wanted, rtol=0, atol=0, equal_nan=True)
    if ours.numel() and ours.shape[dim] > 1:
        s = ours.sort(dim).values
        if permutation:
            assert s.shape[dim] == n, "sort indices are not a permutation"
            steps = torch.arange(n).view([-1 if d == dim else 1 for d in range(x.dim())])
            assert torch.equal(s, steps.expand_as(s)), "sort indices are not a permutation"
        else:
            assert bool((s.diff(dim=dim) > 0).all()), "repeated indices"


def input_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a nest of arguments, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in input_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in input_tensors(v)]
    return []


def _float64(value: Any) -> Any:
    """A copy of a nest of arguments with floating tensors in float64 (complex128)."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return value.to(torch.complex128, copy=True)
        if value.is_floating_point():
            return value.to(torch.float64, copy=True)
        return value.clone()
    if isinstance(value, list | tuple):
        items = [_float64(v) for v in value]
        return type(value)(items) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        return {k: _float64(v) for k, v in value.items()}
    return value


def _assert_as_accurate(actual: Any, expected: Any, reference: Any, path: str = "out") -> None:
    if isinstance(expected, torch.Tensor):
        assert_same_layout(actual, expected, path)
        if not (expected.is_floating_point() or expected.is_complex()):
            assert_same(actual, expected, path=path)
            return
        assert isinstance(reference, torch.Tensor) and reference.shape == expected.shape, (
            f"{path}: no float64 reference of this shape"
        )
        ref = reference.detach().to(torch.complex128 if expected.is_complex() else torch.float64)
        ours, eager = distance(actual, ref), distance(expected, ref)
        atol = tolerance(expected.dtype)[1]
        assert ours <= eager + atol, (
            f"{path}: differs from eager beyond the tolerance and is farther from the "
            f"float64 result ({ours:.3g}) than eager ({eager:.3g})"
        )
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple), f"{path}: expected a sequence"
        assert isinstance(reference, list | tuple) and len(reference) == len(expected)
        assert len(actual) == len(expected), f"{path}: {len(actual)} values != {len(expected)}"
        for i, (a, e, r) in enumerate(zip(actual, expected, reference, strict=True)):
            _assert_as_accurate(a, e, r, f"{path}[{i}]")
    else:
        assert_same(actual, expected, path=path)


def _float64_reference(op: Any, sample: Any) -> Any:
    """The op on the sample with floating tensors in float64 (complex in complex128):
    (outputs, arguments after the call), or None when the op refuses those dtypes."""
    args = _float64((sample.input, *sample.args))
    kwargs = _float64(dict(sample.kwargs))
    try:
        out = op.op(*args, **kwargs)
    except Exception:  # an op without float64 support: no reference
        return None
    return out, (args, kwargs)


def accept_difference(
    op: Any, sample: Any, actual: Any, expected: Any, inputs: list[Any], eager_inputs: list[Any]
) -> str:
    """Called when ``actual`` differs from eager's ``expected``: ``TIES`` or ``FLOAT64``
    when the difference is one of those this module accepts, else raises the
    AssertionError that says why not. ``inputs`` and ``eager_inputs`` are the tensors
    of the arguments after the compiled and the eager call (ops may write to them)."""
    if op.name in _TIE_OPS:
        try:
            assert_same(inputs, eager_inputs, path="inputs")
            _assert_valid_ties(op.name, sample, actual, expected)
            return TIES
        except AssertionError:
            pass
    ref = _float64_reference(op, sample)
    if ref is None:
        raise AssertionError("no float64 reference (the op refuses float64 inputs)")
    out64, after64 = ref
    _assert_as_accurate(actual, expected, out64)
    _assert_as_accurate(inputs, eager_inputs, input_tensors(after64), path="inputs")
    return FLOAT64
