"""What ``import dynajax`` changes in the process, checked against the list in
docs/architecture.md ("Settings at import"): in a fresh process, the environment, JAX's
configuration and a set of torch's process-wide settings before and after the import."""

from __future__ import annotations

import json

from tests.helpers import run_python

_PROBE = r"""
import json, os
import jax
import torch

def torch_settings():
    from torch.nn.modules import module
    return {
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad_enabled": torch.is_grad_enabled(),
        "num_threads": torch.get_num_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "is_compiling_flag": torch.compiler._is_compiling_flag,
        "module_hooks": [
            len(module._global_parameter_registration_hooks),
            len(module._global_buffer_registration_hooks),
            len(module._global_module_registration_hooks),
            len(module._global_forward_pre_hooks),
            len(module._global_forward_hooks),
        ],
        "dynamo_config": sorted(
            (k, repr(v)) for k, v in torch._dynamo.config.get_config_copy().items()
        ),
    }

env, config, settings = dict(os.environ), dict(jax.config.values), torch_settings()
from torch._dynamo.backends.registry import list_backends
import dynajax
after_env, after_config = dict(os.environ), dict(jax.config.values)
print(json.dumps({
    "env": sorted(k for k in set(env) | set(after_env) if env.get(k) != after_env.get(k)),
    "config": sorted(
        k for k in set(config) | set(after_config) if config.get(k) != after_config.get(k)
    ),
    "torch": sorted(k for k, v in torch_settings().items() if settings[k] != v),
    "backend": "dynajax" in list_backends(exclude_tags=()),
    "ops": hasattr(torch.ops.dynajax, "call_jax"),
}))
"""


def test_import_changes_only_the_documented_settings() -> None:
    # torch is imported before dynajax here, as most programs do: GOMP_SPINCOUNT is then
    # left alone (libgomp has read its setting already), and said so at the first compile.
    found = json.loads(
        run_python(
            "-c",
            _PROBE,
            unset=(
                "GOMP_SPINCOUNT",
                "OMP_WAIT_POLICY",
                "XLA_PYTHON_CLIENT_PREALLOCATE",
                "XLA_PYTHON_CLIENT_MEM_FRACTION",
                "XLA_PYTHON_CLIENT_ALLOCATOR",
                "DYNAJAX_CPU_ASYNC_DISPATCH",
                "DYNAJAX_GOMP_SPINCOUNT",
            ),
        )
    )
    assert found == {
        "env": ["XLA_PYTHON_CLIENT_PREALLOCATE"],
        "config": ["jax_cpu_enable_async_dispatch"],
        "torch": [],
        "backend": True,
        "ops": True,
    }


def test_dynajax_first_shortens_libgomps_spin_and_the_opt_outs_hold() -> None:
    probe = (
        "import os; import dynajax, jax; print(repr((os.environ.get('GOMP_SPINCOUNT'), "
        "os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'), "
        "jax.config.values['jax_cpu_enable_async_dispatch'])))"
    )
    unset = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "XLA_PYTHON_CLIENT_PREALLOCATE")
    assert run_python("-c", probe, unset=unset) == "('10000', 'false', False)"
    opted_out = run_python(
        "-c",
        probe,
        unset=unset,
        DYNAJAX_GOMP_SPINCOUNT="off",
        XLA_PYTHON_CLIENT_PREALLOCATE="true",
        DYNAJAX_CPU_ASYNC_DISPATCH="1",
    )
    assert opted_out == "(None, 'true', True)"
