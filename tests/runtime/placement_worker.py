"""Runs in a subprocess with two JAX CPU devices (tests/runtime/test_placement.py):
a model compiled with ``device="cpu:1"`` against eager, printing JSON facts."""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import torch  # noqa: E402

import dynajax  # noqa: E402
from dynajax.runtime.compiled import CompiledPartition  # noqa: E402
from tests.models import cnn  # noqa: E402


def partitions(backend: dynajax.Backend) -> list[CompiledPartition]:
    return [
        m
        for g in backend.graphs
        for m in g.graph_module.children()
        if isinstance(m, CompiledPartition)
    ]


def resident(part: CompiledPartition) -> dict[int, jax.Array]:
    return part.inputs.resident


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def main() -> None:
    facts: dict[str, object] = {"devices": len(jax.devices("cpu"))}
    torch.manual_seed(0)
    model = cnn().train()
    reference = cnn().train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 16, 16)
    target = torch.randint(0, 10, (4,))

    backend = dynajax.Backend(device="cpu:1", cache_dir="")
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(3):
        loss = torch.nn.functional.cross_entropy(compiled(x), target)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            fw = partitions(backend)[0]
            arrays = resident(fw).values()
            facts["resident_devices"] = sorted({str(d) for a in arrays for d in a.devices()})
            facts["resident_count"] = len(arrays)
        opt.step()
        losses.append(loss.item())
        ref_loss = torch.nn.functional.cross_entropy(reference(x), target)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    facts["losses"] = losses
    facts["ref_losses"] = ref_losses
    facts["param_diff"] = max(
        max_diff(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    facts["buffer_diff"] = max(
        max_diff(p.float(), q.float())
        for p, q in zip(model.buffers(), reference.buffers(), strict=True)
    )
    # Between calls with no change, the resident arrays are the same objects.
    model.eval()
    reference.eval()
    with torch.no_grad():
        inference = dynajax.Backend(device="cpu:1", cache_dir="")
        run = torch.compile(model, backend=inference)
        out1 = run(x)
        part = partitions(inference)[0]
        ids1 = {i: id(a) for i, a in resident(part).items()}
        out2 = run(x)
        ids2 = {i: id(a) for i, a in resident(part).items()}
        facts["eval_diff"] = max(max_diff(out1, reference(x)), max_diff(out2, reference(x)))
        facts["kept_between_calls"] = bool(ids1) and ids1 == ids2
        facts["output_device"] = str(out1.device)
        # load_state_dict writes in place: the next call sees the new weights.
        fresh = cnn().eval()
        model.load_state_dict(fresh.state_dict())
        out3 = run(x)
        facts["after_load_diff"] = max_diff(out3, fresh(x))
        ids3 = {i: id(a) for i, a in resident(part).items()}
        facts["refreshed_after_load"] = ids3 != ids2
    json.dump(facts, sys.stdout)


if __name__ == "__main__":
    main()
