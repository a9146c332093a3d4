"""Per-call cost of ``dynajax.jax_function``: host callbacks, and the model rows.

    python -m benchmarks.interop
    python -m benchmarks.interop --rows callback      # only the callback comparison
    python -m benchmarks.interop --rows mlp,gpt2 --calls 50

Two measurements, printed as microseconds per call (median over rounds of the mean
per call; peers interleaved round by round, as in ``benchmarks/harness.py``):

* **callback**: a small MLP (64-64-64, batch 8, tanh between the linears) under
  ``jax.jit(fn)``, with ``tanh`` in its JAX rule and with ``tanh`` forced through a host
  callback (``fallback_ops=["aten.tanh"]``): the difference is what one callback costs
  per call, forward only and forward + backward (``jax.value_and_grad``, whose backward
  is a second callback running ``torch.autograd.grad``).
* **mlp**, **encoder**, **gpt2**: the rows of ``benchmarks/workloads.py`` (eval, no_grad):
  ``jax.jit(jax_function(model))`` on ``jax.Array``s against eager,
  ``torch.compile`` (inductor) and ``torch.compile(backend="dynajax")`` on tensors; and
  ``jax.jit(jax.value_and_grad)`` over the parameters, through torch's backward (the
  function's VJP) and through JAX's autodiff of the same rules.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Step = Callable[[], Any]


def _per_call_us(steps: dict[str, Step], calls: int, rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of the mean µs per call of each step, peers interleaved."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step = steps[name]
            step()  # untimed: let the previous peer's threads settle
            start = time.perf_counter()
            for _ in range(calls):
                step()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def _jax_step(model: nn.Module, args: tuple[torch.Tensor, ...], **options: Any) -> Step:
    import jax
    import jax.numpy as jnp

    import dynajax

    fn, state = dynajax.jax_function(model, *args, **options)
    jitted = jax.jit(fn)
    arrays = [jnp.asarray(a.numpy()) for a in args]
    return lambda: jax.block_until_ready(jitted(state, *arrays))


def _jax_grad_step(
    model: nn.Module, args: tuple[torch.Tensor, ...], jax_autodiff: bool = False, **options: Any
) -> Step:
    """``jax.jit(jax.value_and_grad)`` of the model's output sum over its parameters:
    torch's backward (``jax_function``'s VJP), or with ``jax_autodiff`` JAX's autodiff of
    the lowering rules (the function's ``torch_backward`` removed before it is traced)."""
    import jax
    import jax.numpy as jnp

    import dynajax

    fn, state = dynajax.jax_function(model, *args, **options)
    if jax_autodiff:
        fn.torch_backward = None
    params, buffers = fn.split_state(state)
    arrays = [jnp.asarray(a.numpy()) for a in args]

    def loss(p: Any) -> Any:
        out = fn({**p, **buffers}, *arrays)
        return sum(x.sum() for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating))

    step = jax.jit(jax.value_and_grad(loss))
    return lambda: jax.block_until_ready(step(params))


def callback_rows(calls: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    args = (torch.randn(8, 64),)
    steps = {
        "forward, tanh in its JAX rule": _jax_step(model, args),
        "forward, tanh as a host callback": _jax_step(model, args, fallback_ops=["aten.tanh"]),
        "value_and_grad, tanh in its JAX rule": _jax_grad_step(model, args),
        "value_and_grad, tanh as a host callback": _jax_grad_step(
            model, args, fallback_ops=["aten.tanh"]
        ),
    }
    for step in steps.values():
        step()
    return _per_call_us(steps, calls, rounds)


def model_rows(name: str, calls: int, rounds: int) -> dict[str, float]:
    from benchmarks.harness import compile_fn
    from benchmarks.workloads import encoder_model, gpt2_model, mlp_model

    torch.manual_seed(0)
    model, args = {"mlp": mlp_model, "encoder": encoder_model, "gpt2": gpt2_model}[name]()
    model.eval()
    steps: dict[str, Step] = {}
    for peer in ("eager", "inductor", "dynajax"):
        f = compile_fn(peer)(model)

        def step(f: Callable[..., Any] = f) -> Any:
            with torch.no_grad():
                return f(*args)

        steps[peer] = step
    steps["jax.jit(jax_function)"] = _jax_step(model, args)
    # jax.grad through torch's backward (which traces the forward again inside the
    # VJP; under jax.jit XLA shares it with the forward) against JAX's own autodiff.
    steps["value_and_grad, torch's backward"] = _jax_grad_step(model, args)
    steps["value_and_grad, JAX's autodiff of the rules"] = _jax_grad_step(
        model, args, jax_autodiff=True
    )
    for step in steps.values():
        step()  # compile
        step()
    return _per_call_us(steps, calls, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="callback,mlp,encoder,gpt2")
    parser.add_argument("--calls", type=int, default=0, help="calls per round (0: per row)")
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    for row in options.rows.split(","):
        if row == "callback":
            results = callback_rows(options.calls or 2000, options.rounds)
        else:
            default = {"mlp": 200, "encoder": 40, "gpt2": 20}[row]
            results = model_rows(row, options.calls or default, options.rounds)
        print(f"{row}:")
        for peer, us in results.items():
            print(f"  {peer:<42} {us:>10.1f} µs/call")


if __name__ == "__main__":
    main()
