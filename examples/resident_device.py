"""A PyTorch model run on a chosen JAX device, its weights resident there between calls.

    python examples/resident_device.py

JAX's second CPU device stands in for an accelerator PyTorch has no backend for
(``device="tpu"`` or ``"gpu:0"`` on a machine that has one). Parameters are copied to
the device once and reused until PyTorch changes them: here an optimizer step, after
which the next call sees the new weights.
"""

from __future__ import annotations

import os

# Two JAX CPU devices, for the example; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import torch  # noqa: E402

import dynajax  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    backend = dynajax.Backend(device="cpu:1")
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            eager = torch.nn.functional.mse_loss(model(x), y)
        print(f"step {step}: loss {loss.item():.6f}; after the step, eager {eager.item():.6f}")
    with torch.no_grad():
        ours, eager = compiled(x), model(x)
    part = next(
        m for g in backend.graphs for m in g.graph_module.children() if hasattr(m, "inputs")
    )
    devices = {str(d) for a in part.inputs.resident.values() for d in a.devices()}
    print(
        f"resident arrays on {sorted(devices)}; max |dynajax - eager| = "
        f"{float((ours - eager).abs().max()):.2e}"
    )
    assert devices == {"cpu:1"} and torch.allclose(ours, eager, atol=1e-5)


if __name__ == "__main__":
    main()
