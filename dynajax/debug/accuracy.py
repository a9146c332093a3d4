"""How close is close enough: the tolerance table and the float64 criterion.

Two questions decide whether a value computed by dynajax is eager's answer:

``within_tolerance``
    The values agree with eager's within the tolerance table (per dtype: XLA may
    reassociate a sum or use another transcendental approximation); integers and
    booleans exactly, NaN where eager has NaN.
``as_accurate``
    Where they do not, the computation runs once more in eager PyTorch with floating
    tensors in float64 (complex128), and dynajax's value must be at least as close to
    that result as eager's own: ``max |ours - f64| <= max |eager - f64| + atol``. A value
    that passes rounds differently from eager; one that fails is wrong. This is the
    criterion PyTorch's tests use for reference implementations, and the one the OpInfo
    suite and the differential fuzzer accept differences by.

The test suite compares with the same table (``tests/tolerances.py`` imports it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

# dtype -> (rtol, atol) of one op.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-5, 1e-5),
    torch.complex64: (1.3e-5, 1e-5),
    torch.complex128: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1.6e-2, 2e-2),
}

# Whole models accumulate differences over many layers.
MODEL_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-7, 1e-7),
}


def tolerance(dtype: torch.dtype, model: bool = False) -> tuple[float, float]:
    """``(rtol, atol)`` for values of ``dtype``: of one op, or of a whole ``model``'s
    outputs; ``(0, 0)`` (exact) for integers and booleans."""
    table = MODEL_TOLERANCES if model else TOLERANCES
    return table.get(dtype, TOLERANCES.get(dtype, (0.0, 0.0)))


@dataclasses.dataclass(frozen=True)
class Error:
    """How far a tensor is from eager's.

    Attributes:
        max_abs: the largest ``|ours - eager|`` (inf where only one side is NaN or an
            infinity; 0 where both are the same).
        max_rel: the largest ``|ours - eager| / |eager|`` over elements where eager is
            not 0 (``max_abs`` where it is 0 everywhere).
        rtol: the relative tolerance applied.
        atol: the absolute tolerance applied.
        within: every element satisfies ``|ours - eager| <= atol + rtol * |eager|``,
            and dtype and shape are eager's.
        detail: why the values could not be compared (dtype or shape differ), else "".
    """

    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    within: bool
    detail: str = ""

    def describe(self) -> str:
        """``max abs 1.2e-03, max rel 4.5e-03 (rtol 1.3e-05, atol 1e-05)``."""
        if self.detail:
            return self.detail
        return (
            f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g} "
            f"(rtol {self.rtol:.3g}, atol {self.atol:.3g})"
        )


def error(ours: torch.Tensor, eager: torch.Tensor, *, model: bool = False) -> Error:
    """How far ``ours`` is from ``eager`` under the tolerance of ``eager``'s dtype."""
    rtol, atol = tolerance(eager.dtype, model)
    if ours.dtype != eager.dtype or ours.shape != eager.shape:
        detail = f"{_layout(ours)} where eager has {_layout(eager)}"
        return Error(float("inf"), float("inf"), rtol, atol, False, detail)
    if eager.numel() == 0:
        return Error(0.0, 0.0, rtol, atol, True)
    wide = torch.complex128 if eager.is_complex() else torch.float64
    a, e = ours.detach().to(wide), eager.detach().to(wide)
    diff = _difference(a, e)
    bound = atol + rtol * e.abs()
    within = bool((diff <= bound).all())
    nonzero = e != 0
    rel = diff[nonzero] / e.abs()[nonzero]
    max_abs = float(diff.max())
    max_rel = float(rel.max()) if rel.numel() else max_abs
    return Error(max_abs, max_rel, rtol, atol, within)


def _layout(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _difference(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``|x - ref|``, 0 where both are NaN or the same infinity, inf where only one is."""
    both_nan = x.isnan() & ref.isnan()
    same_inf = x.isinf() & ref.isinf() & (x == ref)
    d = (x - ref).abs()
    d = torch.where(both_nan | same_inf, torch.zeros((), dtype=d.dtype), d)
    return torch.where(d.isnan(), torch.full((), float("inf"), dtype=d.dtype), d)


def distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| in ``ref``'s dtype; 0 where both are NaN or the same infinity, inf
    where only one of them is."""
    d = _difference(x.detach().to(ref.dtype), ref)
    return float(d.max()) if d.numel() else 0.0


def as_accurate(ours: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor) -> bool:
    """The float64 criterion: ``ours`` is at least as close to the float64 (complex128)
    ``reference`` as ``eager`` is, within the absolute tolerance of ``eager``'s dtype.
    Non-floating values must equal eager's exactly."""
    if ours.dtype != eager.dtype or ours.shape != eager.shape:
        return False
    if not (eager.is_floating_point() or eager.is_complex()):
        return bool(torch.equal(ours, eager))
    if reference.shape != eager.shape:
        return False
    ref = reference.detach().to(torch.complex128 if eager.is_complex() else torch.float64)
    return distance(ours, ref) <= distance(eager, ref) + tolerance(eager.dtype)[1]


def float64(value: Any) -> Any:
    """A copy of a nest of arguments with floating tensors in float64 (complex in
    complex128) and other tensors cloned, for the float64 reference computation."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return value.detach().to(torch.complex128, copy=True)
        if value.is_floating_point():
            return value.detach().to(torch.float64, copy=True)
        return value.detach().clone()
    if isinstance(value, list | tuple):
        items = [float64(v) for v in value]
        return type(value)(items) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        return {k: float64(v) for k, v in value.items()}
    return value
