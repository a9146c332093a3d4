"""A JAX rule for a custom op of your own: ``dynajax.register_rule``.

    python examples/custom_op_rule.py

``mylib::soft_clip`` is a ``torch.library.custom_op`` whose kernel is NumPy code,
opaque to PyTorch's compilers. Without a rule, dynajax runs it in eager PyTorch and
the JAX program is split around it. With a rule (a JAX function of the op's
arguments), the op runs inside the JAX partition. The op has no autograd formula of
its own, so ``register_rule`` installs one whose backward is ``jax.vjp`` of the rule:
a training step then compiles to one JAX partition forward and one backward.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import torch

import dynajax


@torch.library.custom_op("mylib::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    """``limit * tanh(x / limit)``, computed by NumPy (PyTorch cannot trace it)."""
    return torch.from_numpy(limit * np.tanh(x.detach().numpy() / limit))


@soft_clip.register_fake
def _(x: torch.Tensor, limit: float) -> torch.Tensor:
    return torch.empty_like(x)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(soft_clip(self.a(x), 3.0))


class Reference(Model):
    """The same model in differentiable torch ops: eager's answer, gradients included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(3.0 * torch.tanh(self.a(x) / 3.0))


def main() -> None:
    torch.manual_seed(0)
    model, x = Model(), torch.randn(8, 16)
    reference = Reference()
    reference.load_state_dict(model.state_dict())

    # Without a rule: the custom op runs in eager PyTorch, between two JAX partitions.
    backend = dynajax.Backend()
    with torch.no_grad():
        torch.compile(copy.deepcopy(model), backend=backend)(x)
    before = dynajax.Report(backend.graphs)
    print(before, "\n")
    assert [f.target for f in before.fallbacks] == ["mylib.soft_clip.default"]

    # With a rule: one JAX partition, forward and backward.
    @dynajax.register_rule("mylib::soft_clip")
    def _soft_clip(x, limit):
        return limit * jnp.tanh(x / limit)

    torch._dynamo.reset()
    backend = dynajax.Backend()
    loss = torch.compile(model, backend=backend)(x).pow(2).mean()
    loss.backward()
    expected = reference(x).pow(2).mean()
    expected.backward()
    after = dynajax.Report(backend.graphs)
    print(after)
    grad_err = max(
        float((p.grad - q.grad).abs().max())
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    print(
        f"\nloss {loss.item():.6f} (eager {expected.item():.6f}); gradients within {grad_err:.1e}"
    )
    assert abs(loss.item() - expected.item()) < 1e-6 and grad_err < 1e-6
    assert after.fallbacks == [] and all(len(g.partitions) == 1 for g in after.graphs)
    assert {g.kind for g in after.graphs} == {"forward", "backward"}


if __name__ == "__main__":
    main()
