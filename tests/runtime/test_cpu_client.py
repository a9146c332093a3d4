"""JAX's CPU client runs dynajax's executables inline (dynajax.runtime.cpu_client).

The setting belongs to the CPU client, created once per process, so each case runs in a
fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "DYNAJAX_CPU_ASYNC_DISPATCH"}
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environ,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


_ASYNC = "jax.config.read('jax_cpu_enable_async_dispatch')"


def test_importing_dynajax_first_makes_cpu_executions_inline() -> None:
    out = _run(f"""
        import dynajax, jax, torch
        f = torch.compile(lambda x: x * 2 + 1, backend="dynajax")
        y = f(torch.arange(40000.0))
        assert torch.equal(y, torch.arange(40000.0) * 2 + 1)
        print({_ASYNC})
    """)
    assert out == "False"


def test_environment_keeps_jax_default() -> None:
    out = _run(f"import dynajax, jax\nprint({_ASYNC})", DYNAJAX_CPU_ASYNC_DISPATCH="1")
    assert out == "True"


def test_client_started_before_import_is_left_alone_and_logged() -> None:
    out = _run(f"""
        import logging, jax, jax.numpy as jnp
        jnp.zeros(3).block_until_ready()          # the CPU client starts here
        records = []
        class Keep(logging.Handler):
            def emit(self, record): records.append(record.getMessage())
        logging.getLogger("dynajax.runtime").addHandler(Keep())
        logging.getLogger("dynajax.runtime").setLevel(logging.INFO)
        import dynajax, torch
        from dynajax.runtime import cpu_client
        assert cpu_client.prefer_inline() is False
        f = torch.compile(lambda x: x + 1, backend="dynajax")
        f(torch.ones(3)); f(torch.ones(4, 2))      # two compiles, one message
        hits = [r for r in records if "jax_cpu_enable_async_dispatch" in r]
        print({_ASYNC}, len(hits))
    """)
    assert out == "True 1"


@pytest.mark.parametrize("started", [False, True])
def test_backends_started_reports_the_client(started: bool) -> None:
    start = "jax.devices()" if started else "None"
    out = _run(f"""
        import jax
        from dynajax.runtime.jax_internals import backends_started
        {start}
        print(backends_started())
    """)
    assert out == str(started)
