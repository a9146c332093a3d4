"""A PyTorch model trained by a loop written in pure JAX (optax), next to the same loop
in PyTorch: the losses agree step by step.

    python examples/jax_training.py

``dynajax.jax_function`` turns the model into a pure function ``fn(state, x)`` of a
dict of ``jax.Array``s; ``jax.value_and_grad``, ``jax.jit`` and optax do the rest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import torch

import dynajax


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    fn, state = dynajax.jax_function(model, x)  # before the PyTorch loop changes the model

    # The loop in PyTorch.
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch_losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())

    # The same loop in JAX, over the same model as a JAX function.
    params, buffers = fn.split_state(state)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    xj, yj = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            return jnp.mean((fn({**p, **buffers}, xj) - yj) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jax_losses = []
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state)
        jax_losses.append(float(loss))

    print("step  torch loss  jax loss")
    for i, (a, b) in enumerate(zip(torch_losses, jax_losses, strict=True)):
        print(f"{i:>4}  {a:10.6f}  {b:8.6f}")
    worst = max(abs(a - b) for a, b in zip(torch_losses, jax_losses, strict=True))
    print(f"largest difference: {worst:.2e}")
    assert worst < 1e-4, "the JAX loop left the PyTorch loop"


if __name__ == "__main__":
    main()
