"""One of two processes of a multi-host run (tests/sharding/test_multihost.py): four
JAX CPU devices each, joined by ``jax.distributed`` into one mesh of eight (CPU
collectives over gloo), training an MLP with dynajax and comparing with eager.

    python -m tests.sharding.multihost_worker PROCESS_ID NUM_PROCESSES PORT

Every process runs the same PyTorch program on the same *global* batch (seeded alike):
dynajax builds each process's shards of it, the partitions run SPMD over all eight
devices, and every process gets the whole outputs back. Prints one line of JSON.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402


def main() -> None:
    process_id, processes, port = (int(a) for a in sys.argv[1:4])
    # Before anything touches a JAX backend (importing dynajax may).
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=processes,
        process_id=process_id,
        initialization_timeout=120,
    )
    import numpy as np
    import torch
    from jax.sharding import Mesh

    import dynajax
    from tests.models import mlp

    mesh = Mesh(np.array(jax.devices()), ("data",))
    facts: dict[str, Any] = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "global_devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "collectives": jax.config.jax_cpu_collectives_implementation,
    }
    for label, rules in (
        ("dp", dynajax.ShardingRules.data_parallel()),
        ("fsdp", dynajax.ShardingRules.fsdp()),
    ):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = mlp(32, 64, 16)
        reference = copy.deepcopy(model)
        x, target = torch.randn(16, 32), torch.randn(16, 16)  # the global batch
        backend = dynajax.Backend(mesh=mesh, sharding=rules, cache_dir="")
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        losses, ref_losses = [], []
        for _ in range(5):
            for m, o, out in ((compiled, opt, losses), (reference, ref_opt, ref_losses)):
                loss = torch.nn.functional.mse_loss(m(x), target)
                o.zero_grad()
                loss.backward()
                o.step()
                out.append(loss.item())
        pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
        forward = next(g for g in backend.graphs if g.kind == "forward")
        assert forward.sharding is not None
        facts[label] = {
            "losses": losses,
            "ref_losses": ref_losses,
            "grad_diff": max(float((p.grad - q.grad).abs().max()) for p, q in pairs),
            "param_diff": max(float((p - q).detach().abs().max()) for p, q in pairs),
            "bytes_per_device": forward.sharding.bytes_per_device(),
            "total_bytes": sum(s.nbytes or 0 for s in forward.sharding.state()),
            "report": str(forward),
        }
    facts["train_step"] = _train_step(mesh, sys.argv[4] if len(sys.argv) > 4 else None)
    json.dump(facts, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    jax.distributed.shutdown()


def _train_step(mesh: Any, directory: str | None) -> dict[str, Any]:
    """``dynajax.train_step`` with FSDP over both processes' devices: 10 AdamW steps
    against eager, with a checkpoint (each process writing its own shards) saved after
    5 and restored into a fresh model that runs the last 5."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import dynajax
    from tests.models import mlp

    def build(seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return mlp(32, 64, 16)

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(x), y)

    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen)) for _ in range(10)
    ]
    reference = build()
    ref_opt = make(reference)
    ref_losses = []
    for batch in batches:
        ref_opt.zero_grad()
        loss = loss_fn(reference, *batch)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    rules = dynajax.ShardingRules.fsdp()
    model = build()
    step = dynajax.train_step(model, make(model), loss_fn, mesh=mesh, sharding=rules)
    losses = [float(step(*b)) for b in batches[:5]]
    restored = None
    if directory is not None:
        step.save(directory)
        model = build(seed=7)
        step = dynajax.train_step(model, make(model), loss_fn, mesh=mesh, sharding=rules)
        restored = step.restore(directory)
    losses += [float(step(*b)) for b in batches[5:]]
    arrays = [*step.params, *step.state.values()]
    per_device = dynajax.training.state.bytes_per_device(arrays)
    step.sync()  # gathers each sharded array from both processes
    trained = dict(model.state_dict())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "restored_at": restored,
        "param_diff": max(
            float((trained[k] - v).abs().max()) for k, v in reference.state_dict().items()
        ),
        "per_device": sorted(per_device.values()),
        "whole_bytes": sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays),
        "replicated_bytes": sum(
            int(np.prod(a.shape)) * a.dtype.itemsize
            for a in arrays
            if a.sharding.is_fully_replicated
        ),
    }


if __name__ == "__main__":
    main()
