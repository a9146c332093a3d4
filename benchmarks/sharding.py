"""Sharded training steps on emulated CPU devices: step time on 1 device and on 8, and
the bytes of parameters each device holds, per strategy.

    python -m benchmarks.sharding              # runs itself with eight JAX CPU devices
    python -m benchmarks.sharding --steps 10

The 8 devices are XLA's host-platform emulation (``--xla_force_host_platform_device_count``)
sharing this machine's cores: the step times show what sharding costs in dispatch and
collectives on one machine, not what 8 real devices would gain. The bytes per device
are measured from the placed arrays (``GraphSharding.bytes_per_device``).

A step is forward, backward and an SGD step of ``torch.optim`` on a fixed batch (MLP
512-2048-512 on 64 rows; GPT-2 2 layers x 128 wide on 8 x 64 tokens), median of the
timed steps after two warm-up steps, each row in the same process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def _rows(steps: int) -> None:
    import jax
    import torch
    from jax.sharding import PartitionSpec as P

    import dynajax
    from tests.models import gpt2, tokens

    def mlp_case() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
        model = torch.nn.Sequential(
            torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
        )
        x, y = torch.randn(64, 512), torch.randn(64, 512)
        return model, lambda m: torch.nn.functional.mse_loss(m(x), y)

    def gpt2_case() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
        model = gpt2(layers=2, width=128).eval()
        ids = tokens(8, 64)
        return model, lambda m: m(ids, labels=ids).loss

    tp = {
        "MLP": [(r"^0\.weight$", P("model", None)), (r"^0\.bias$", P("model")),
                (r"^2\.weight$", P(None, "model"))],
        "GPT-2": [(r"attn\.c_attn\.weight$", P(None, "model")),
                  (r"attn\.c_attn\.bias$", P("model")),
                  (r"attn\.c_proj\.weight$", P("model", None)),
                  (r"mlp\.c_fc\.weight$", P(None, "model")), (r"mlp\.c_fc\.bias$", P("model")),
                  (r"mlp\.c_proj\.weight$", P("model", None))],
    }  # fmt: skip
    devices = jax.devices("cpu")
    one = jax.sharding.Mesh(devices[:1], ("data",))
    data8 = jax.sharding.Mesh(devices[:8], ("data",))
    model8 = jax.sharding.Mesh(devices[:8], ("model",))
    grid = jax.sharding.Mesh([devices[0:4], devices[4:8]], ("data", "model"))

    print(f"{'model':<6} {'strategy':<18} {'devices':>7} {'ms/step':>9} {'x 1 device':>10} "
          f"{'param bytes/device':>19} {'of total':>9}")  # fmt: skip
    for name, make in (("MLP", mlp_case), ("GPT-2", gpt2_case)):
        ways: list[tuple[str, Any, Any]] = [
            ("1 device", one, None),
            ("data parallel", data8, dynajax.ShardingRules.data_parallel()),
            ("FSDP", data8, dynajax.ShardingRules.fsdp()),
            ("tensor parallel", model8, tp[name]),
            ("2-D (4 x 2)", grid, tp[name]),
        ]
        base = None
        for label, mesh, rules in ways:
            torch._dynamo.reset()
            torch.manual_seed(0)
            model, loss_of = make()
            backend = dynajax.Backend(mesh=mesh, sharding=rules, cache_dir="")
            compiled = torch.compile(model, backend=backend)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def step(m: torch.nn.Module = compiled, o: Any = opt, f: Any = loss_of) -> None:
                loss = f(m)
                o.zero_grad()
                loss.backward()
                o.step()

            for _ in range(2):
                step()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            base = base or ms
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            # Per device, over the graphs (forward and backward share the copies); one
            # CPU device runs on the tensors' own memory: all of it, nothing placed.
            per_dev = max(
                (n for g in backend.graphs if g.sharding is not None
                 for n in g.sharding.bytes_per_device().values()),
                default=total,
            )  # fmt: skip
            print(f"{name:<6} {label:<18} {mesh.size:>7} {ms:>9.2f} {ms / base:>10.2f} "
                  f"{per_dev:>19,} {per_dev / total:>9.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
        cmd = [sys.executable, "-m", "benchmarks.sharding", "--worker", "--steps", str(args.steps)]
        return subprocess.run(cmd, env=env, check=False).returncode
    _rows(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
