"""Importing dynajax keeps JAX's GPU client from reserving 75% of the card up front
(dynajax.runtime.gpu_memory), unless the user or an earlier use of JAX decided.

The setting is read once, when JAX creates its clients, so each case runs in a fresh
interpreter; what is checked is the environment JAX's GPU client reads (CI has no GPU).
"""

from __future__ import annotations

import textwrap

from dynajax.runtime import gpu_memory
from tests.helpers import run_python

_SETTINGS = gpu_memory._USER_SETTINGS
_READ = "import os; print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))"


def _fresh(code: str, **env: str) -> str:
    return run_python("-c", textwrap.dedent(code), timeout=300, unset=_SETTINGS, **env)


def test_import_turns_the_reservation_off() -> None:
    assert _fresh(f"import dynajax\n{_READ}") == "false"


def test_the_users_setting_is_kept() -> None:
    assert _fresh(f"import dynajax\n{_READ}", XLA_PYTHON_CLIENT_PREALLOCATE="true") == "true"
    out = _fresh(f"import dynajax\n{_READ}", XLA_PYTHON_CLIENT_MEM_FRACTION=".5")
    assert out == "None"


def test_jax_started_before_import_is_left_alone() -> None:
    out = _fresh(f"""
        import jax
        jax.devices()  # JAX's clients start here, with JAX's own defaults
        import dynajax
        {_READ}
    """)
    assert out == "None"
