"""A smoke test of dynajax as a user's ``pip install`` gives it: run with the python of
a venv that has the wheel installed (not editable), from outside the checkout
(``make wheel-check``). It fails where the wheel misses a file, an entry point or its
metadata, which an editable install would hide.

Not collected by pytest (its name does not start with ``test_``): the suite runs on the
checkout; this runs on the wheel.
"""

from __future__ import annotations  # noqa: I001 (dynajax first: its settings apply)

import dynajax
import importlib.metadata
import importlib.resources
import pathlib
import sys
import tempfile

import jax
import numpy as np
import torch
from torch import nn


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"smoke test failed: {what}")
    print(f"ok  {what}")


def main() -> None:
    where = pathlib.Path(dynajax.__file__).resolve()
    check("site-packages" in where.parts, f"dynajax is the installed one ({where.parent})")
    meta = importlib.metadata.metadata("dynajax")
    check(meta["Version"] == dynajax.__version__, f"version {dynajax.__version__} (metadata)")
    check(meta["License-Expression"] == "Apache-2.0", "license Apache-2.0 (metadata)")
    check(bool(meta["Author"] or meta["Author-email"]), "authors (metadata)")
    files = {str(f) for f in importlib.metadata.files("dynajax") or []}
    check(any(f.endswith("LICENSE") for f in files), "LICENSE in the wheel")
    check(importlib.resources.files("dynajax").joinpath("py.typed").is_file(), "py.typed")
    source = importlib.resources.files("dynajax").joinpath("ffi", "torch_op.cc")
    check(source.is_file(), "the FFI handler's source (ffi/torch_op.cc)")
    from dynajax import ffi

    check(ffi.available(), "PyTorch's kernels inside XLA: the extension builds and registers")
    points = importlib.metadata.entry_points(group="torch_dynamo_backends", name="dynajax")
    check(len(points) == 1, "the torch_dynamo_backends entry point")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)
        out = torch.compile(model, backend="dynajax")(x)  # by the entry point's name
    check(torch.allclose(out, expected, atol=1e-5), "torch.compile(backend='dynajax')")

    fn, state = dynajax.jax_function(model, x)

    def loss(state, x):
        return fn(state, x).sum()

    grads = jax.jit(jax.grad(loss))(state, x.numpy())
    model.zero_grad()
    model(x).sum().backward()
    check(
        np.allclose(np.asarray(grads["0.weight"]), model[0].weight.grad.numpy(), atol=1e-5),
        "jax_function under jax.jit(jax.grad(...)) gives torch.autograd's gradient",
    )

    twin = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = dynajax.train_step(
        twin, torch.optim.AdamW(twin.parameters(), lr=1e-2), lambda m, x: m(x).pow(2).mean()
    )
    for _ in range(3):
        eager_opt.zero_grad()
        expected_loss = model(x).pow(2).mean()
        expected_loss.backward()
        eager_opt.step()
        loss_value = float(step(x))
        check(abs(loss_value - expected_loss.item()) < 1e-5, f"train_step loss {loss_value:.6f}")
    with tempfile.TemporaryDirectory() as directory:
        check(step.save(directory) == 3, "train_step checkpoint (orbax)")

    report = dynajax.explain(model.eval(), x)
    check(report.fraction_in_jax == 1.0 and report.breaks == [], "dynajax.explain")
    print("smoke test passed")


if __name__ == "__main__":
    main()
