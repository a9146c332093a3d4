"""dynajax's features one after another in one process: none changes what another
compiles. Each order is a fresh process (``tests/features_worker.py``); every feature
is checked against eager there, and a model compiled by the backend at the start is
called again after each feature without compiling again."""

from __future__ import annotations

import pytest

from tests.features_worker import FEATURES
from tests.helpers import run_worker

_NAMES = list(FEATURES)
# Each feature first once, and each in every position once (the rotations).
_ORDERS = [_NAMES[i:] + _NAMES[:i] for i in range(len(_NAMES))]

# The compiles each feature makes on its own, in a fresh process.
_ALONE = {"train_step": 1, "backend": 1, "jax_function": 1, "export": 1, "explain": 1}


@pytest.mark.parametrize("order", _ORDERS, ids=lambda order: "-".join(order))
def test_features_run_one_after_another_compile_as_alone(order: list[str]) -> None:
    facts = run_worker("tests.features_worker", ",".join(order), timeout=600)
    assert facts["sentinel_first"] == 1
    assert facts["compiles"] == {name: _ALONE[name] for name in order}
    assert facts["sentinel"] == {name: 0 for name in order}
