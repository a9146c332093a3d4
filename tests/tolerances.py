"""The one tolerance table of the test suite, and the comparison every test uses.

Values computed by XLA may differ from PyTorch's by reassociation and different
transcendental implementations; integers and booleans must be exact; dtype and shape
always exact.
"""

from __future__ import annotations

from typing import Any

import torch

# The tables and ``tolerance(dtype, model)`` are the package's (``dynajax.debug``
# compares with them too): one table for the suite and the accuracy debugger.
from dynajax.debug.accuracy import MODEL_TOLERANCES, TOLERANCES, tolerance

__all__ = ["MODEL_TOLERANCES", "TOLERANCES", "assert_same", "assert_same_layout", "tolerance"]


def assert_same_layout(actual: Any, expected: torch.Tensor, path: str = "out") -> None:
    """``actual`` is a tensor of ``expected``'s dtype and shape (values not compared)."""
    assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual)}"
    assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"


def assert_same(actual: Any, expected: Any, *, model: bool = False, path: str = "out") -> None:
    """Same structure, dtype and shape; values within the tolerance table (exact for
    integers and booleans); NaN where eager has NaN."""
    if isinstance(expected, torch.Tensor):
        assert_same_layout(actual, expected, path)
        rtol, atol = tolerance(expected.dtype, model)
        torch.testing.assert_close(
            actual.detach(),
            expected.detach(),
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m: f"{path}: {m}",
        )
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple), f"{path}: expected a sequence, got {type(actual)}"
        assert len(actual) == len(expected), f"{path}: {len(actual)} values != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, model=model, path=f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{path}: keys differ"
        for k in expected:
            assert_same(actual[k], expected[k], model=model, path=f"{path}[{k!r}]")
    elif hasattr(expected, "to_tuple"):  # transformers ModelOutput
        assert_same(actual.to_tuple(), expected.to_tuple(), model=model, path=path)
    else:
        assert actual == expected or (actual != actual and expected != expected), (
            f"{path}: {actual!r} != {expected!r}"
        )
