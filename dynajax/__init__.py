"""dynajax: a torch.compile backend that runs PyTorch programs on JAX/XLA.

import torch
compiled = torch.compile(model, backend="dynajax")
print(dynajax.explain(model, x))
"""

# ruff: noqa: E402 (the imports below follow omp.shorten_spin(), which must run first)
# Before torch loads libgomp: its threads' spin after each parallel region shortened
# (runtime/omp.py), unless torch is imported already or the environment says otherwise.
from dynajax.runtime import omp

omp.shorten_spin()

from dynajax import debug  # dynajax.debug.compare: the accuracy debugger
from dynajax._version import __version__
from dynajax.backend import Backend, dynajax_backend, register_name
from dynajax.capability import Reason, Supported, Unsupported
from dynajax.config import Options
from dynajax.diagnostics import GraphReport, Report, WhatIf
from dynajax.errors import (
    CallbackOpsError,
    CallJaxError,
    ConversionError,
    DynajaxError,
    ExportError,
    ExportOpsError,
    JaxFunctionError,
    OptionsError,
    ShardingError,
    TrainStepError,
    UnsupportedNodesError,
)
from dynajax.explain import explain
from dynajax.extending import RuleOverrideWarning, register_rule, unregister_rule
from dynajax.interop import JaxFunction, ValueCheckResult, jax_function, jax_values
from dynajax.interop.call_jax import call_jax
from dynajax.lowering.registry import supported_ops
from dynajax.passes.user import Rewrite, RewriteRecord
from dynajax.runtime import cpu_client, gpu_memory
from dynajax.sharding import ShardingRules
from dynajax.stablehlo import ExportedModel, export
from dynajax.training import TrainStep, train_step

# Unless JAX is already in use: its CPU client runs executions on the calling thread
# (dynajax waits for every result; a hand-off to a worker thread is pure cost).
cpu_client.prefer_inline()
# Unless JAX is already in use or the environment says otherwise: JAX's GPU client
# allocates as it needs instead of reserving 75% of the card PyTorch shares.
gpu_memory.share_with_torch()
# backend="dynajax" from a checkout on PYTHONPATH too (an installed one has an entry point).
register_name()

__all__ = [
    "Backend",
    "CallJaxError",
    "CallbackOpsError",
    "ConversionError",
    "DynajaxError",
    "ExportError",
    "ExportOpsError",
    "ExportedModel",
    "GraphReport",
    "JaxFunction",
    "JaxFunctionError",
    "Options",
    "OptionsError",
    "Reason",
    "RuleOverrideWarning",
    "Report",
    "Rewrite",
    "RewriteRecord",
    "ShardingError",
    "ShardingRules",
    "TrainStep",
    "TrainStepError",
    "Supported",
    "Unsupported",
    "UnsupportedNodesError",
    "ValueCheckResult",
    "WhatIf",
    "__version__",
    "call_jax",
    "debug",
    "dynajax_backend",
    "explain",
    "export",
    "jax_function",
    "jax_values",
    "register_rule",
    "supported_ops",
    "train_step",
    "unregister_rule",
]
