"""Rules for the custom ops of Hugging Face ``transformers``.

transformers computes a mixture of experts' grouped matmul (Mixtral, Qwen-MoE, ...) in
ops of its own when Dynamo traces weights other than bfloat16
(``transformers/integrations/moe.py``): ``transformers::grouped_mm_fallback`` (forward)
and ``transformers::grouped_mm_fallback_backward`` (its autograd formula's backward).
Both are a loop of ``torch.mm`` over groups of rows, one group per expert:

    out[offs[e-1]:offs[e]] = input[offs[e-1]:offs[e]] @ weight[e]     (offs[-1] = 0)

and rows past ``offs[-1]`` stay zero. ``jax.lax.ragged_dot`` is that product, zero rows
included; the backward is its VJP (JAX differentiates ``ragged_dot``), so forward and
backward run inside the surrounding JAX partitions.

dynajax never imports transformers: the rules are registered by name
(``lower_when_defined``) and join the table when a graph first holds the op, so the
user may import transformers before or after dynajax.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dynajax.lowering.registry import lower_when_defined


def _grouped_mm_fallback_check(input: Any, weight: Any, offs: Any) -> str | None:
    if input.dtype != weight.dtype:
        return f"input is {input.dtype} and weight {weight.dtype}; transformers casts them alike"
    if np.dtype(offs.dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
        return f"offs must be int32 or int64, got {offs.dtype}"
    return None


@lower_when_defined("transformers::grouped_mm_fallback.default", check=_grouped_mm_fallback_check)
def _grouped_mm_fallback(input: Any, weight: Any, offs: Any) -> Any:
    # Group sizes from the cumulative ends; ragged_dot leaves rows past the last group 0.
    sizes = jnp.diff(offs, prepend=jnp.zeros((1,), offs.dtype)).astype(jnp.int32)
    return jax.lax.ragged_dot(input, weight, sizes, preferred_element_type=input.dtype)


def _grouped_mm_fallback_backward_check(
    input: Any, weight: Any, offs: Any, grad_output: Any
) -> str | None:
    return _grouped_mm_fallback_check(input, weight, offs)


@lower_when_defined(
    "transformers::grouped_mm_fallback_backward.default",
    check=_grouped_mm_fallback_backward_check,
)
def _grouped_mm_fallback_backward(
    input: Any, weight: Any, offs: Any, grad_output: Any
) -> tuple[Any, Any]:
    _, pullback = jax.vjp(lambda a, w: _grouped_mm_fallback(a, w, offs), input, weight)
    grad_input, grad_weight = pullback(grad_output.astype(input.dtype))
    return grad_input, grad_weight
