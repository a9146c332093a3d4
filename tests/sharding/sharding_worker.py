"""Runs in a subprocess with eight JAX CPU devices (tests/sharding/test_mesh.py): every
sharding strategy against eager PyTorch, printing one line of JSON facts.

Strategies: data parallel, FSDP, tensor parallel (column- then row-parallel MLP and
GPT-2 attention/MLP projections) and a 2-D data x model mesh; each runs inference and
five optimizer steps of training, compared with an eager copy of the same model. Plus:
a mesh of one device, an indivisible rule, an op kept in PyTorch between two sharded
partitions, and ``jax_function``'s state placed by the same rules under ``jax.jit``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dynajax  # noqa: E402
from dynajax.runtime.compiled import CompiledPartition  # noqa: E402
from tests.models import gpt2, mlp, tokens  # noqa: E402

STEPS = 5

# Column-parallel first layer (nn.Linear's weight is [out, in]: split the outputs),
# row-parallel second layer (split its inputs); XLA adds the one all-reduce.
MLP_TP = [
    (r"^0\.weight$", P("model", None)),
    (r"^0\.bias$", P("model")),
    (r"^2\.weight$", P(None, "model")),
]
# GPT-2's Conv1D weights are [in, out]: column-parallel splits dim 1, row-parallel dim 0.
GPT2_TP = [
    (r"attn\.c_attn\.weight$", P(None, "model")),
    (r"attn\.c_attn\.bias$", P("model")),
    (r"attn\.c_proj\.weight$", P("model", None)),
    (r"mlp\.c_fc\.weight$", P(None, "model")),
    (r"mlp\.c_fc\.bias$", P("model")),
    (r"mlp\.c_proj\.weight$", P("model", None)),
]


class Case:
    """A model, how to run it for inference, and its training loss."""

    def __init__(
        self,
        model: torch.nn.Module,
        infer: Callable[[torch.nn.Module], torch.Tensor],
        loss: Callable[[torch.nn.Module], torch.Tensor],
    ) -> None:
        self.model, self.infer, self.loss = model, infer, loss


def mlp_case() -> Case:
    # d_out=12: the last layer's weight and bias do not divide by 8 (FSDP replicates them).
    model = mlp(32, 64, 12)
    x, target = torch.randn(16, 32), torch.randn(16, 12)
    return Case(
        model,
        lambda m: m(x),
        lambda m: torch.nn.functional.mse_loss(m(x), target),
    )


def gpt2_case() -> Case:
    model = gpt2(layers=1).eval()  # eval: no dropout, so eager's answer is defined
    ids = tokens(8, 16)
    return Case(model, lambda m: m(ids).logits, lambda m: m(ids, labels=ids).loss)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def partitions(backend: dynajax.Backend, kind: str) -> list[CompiledPartition]:
    return [
        m
        for g in backend.graphs
        if g.kind == kind
        for m in g.graph_module.children()
        if isinstance(m, CompiledPartition)
    ]


def collectives(parts: list[CompiledPartition]) -> list[str]:
    ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    found = set()
    for p in parts:
        if p._compiled is not None:
            text = p._compiled.as_text()
            found |= {op for op in ops if op in text}
    return sorted(found)


def strategy(make: Callable[[], Case], mesh: Mesh, rules: Any, **options: Any) -> dict:
    started = time.perf_counter()
    torch._dynamo.reset()  # each strategy compiles afresh (Dynamo's recompile limit)
    torch.manual_seed(0)
    case = make()
    reference = copy.deepcopy(case.model)
    backend = dynajax.Backend(mesh=mesh, sharding=rules, cache_dir="", **options)
    compiled = torch.compile(case.model, backend=backend)
    facts: dict[str, Any] = {}
    with torch.no_grad():
        facts["inference_diff"] = max_diff(case.infer(compiled), case.infer(reference))
    opt = torch.optim.SGD(case.model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        for model, optimizer, out in (
            (compiled, opt, losses),
            (reference, ref_opt, ref_losses),
        ):
            loss = case.loss(model)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            out.append(loss.item())
    facts["losses"], facts["ref_losses"] = losses, ref_losses
    pairs = list(zip(case.model.parameters(), reference.parameters(), strict=True))
    facts["grad_diff"] = max(max_diff(p.grad, q.grad) for p, q in pairs)
    facts["param_diff"] = max(max_diff(p, q) for p, q in pairs)
    # The layout, measured from the arrays the forward graph's partitions hold.
    forward = next(g for g in backend.graphs if g.kind == "forward")
    assert forward.sharding is not None
    state = forward.sharding.state()
    facts["state"] = {
        s.name: {
            "spec": s.spec,
            "nbytes": s.nbytes,
            "per_device": sorted(set(s.per_device.values())),
            "devices": len(s.per_device),
            "note": s.note,
        }
        for s in state
    }
    facts["bytes_per_device"] = sorted(set(forward.sharding.bytes_per_device().values()))
    facts["total_bytes"] = sum(s.nbytes or 0 for s in state)
    fw, bw = partitions(backend, "forward"), partitions(backend, "backward")
    facts["collectives"] = collectives(fw + bw)
    facts["input_specs"] = sorted(
        {
            str(s.spec)
            for p in fw
            if p._compiled is not None
            for s in p._compiled.input_shardings[0]
            if isinstance(s, NamedSharding)
        }
    )
    # Forward and backward share one resident copy of each weight.
    fw_arrays = {id(a) for p in fw for a in p.inputs.resident.values()}
    bw_arrays = [a for p in bw for a in p.inputs.resident.values()]
    facts["backward_shares_forward_copies"] = bool(bw_arrays) and all(
        id(a) in fw_arrays for a in bw_arrays
    )
    facts["output_is_whole"] = list(case.infer(compiled).shape) == list(case.infer(reference).shape)
    facts["report"] = dynajax.Report(backend.graphs).text(width=None)
    facts["seconds"] = round(time.perf_counter() - started, 1)
    return facts


def one_device_mesh() -> dict:
    """A mesh of one device is ``device=`` that device: state resident on it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(4, 32)
    mesh = Mesh(np.array(jax.devices()[1:2]), ("data",))
    backend = dynajax.Backend(mesh=mesh, cache_dir="")
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        diff = max_diff(out, model(x))
    [part] = partitions(backend, "inference")
    devices = {str(d) for a in part.inputs.resident.values() for d in a.devices()}
    return {
        "diff": diff,
        "device": str(backend.placement.device if backend.placement else None),
        "multi_device": backend.placement.multi_device if backend.placement else None,
        "resident_devices": sorted(devices),
    }


def indivisible_rule() -> str:
    torch._dynamo.reset()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    model = mlp(32, 64, 12)  # 2.weight is [12, 64]: 12 rows do not split 8 ways
    backend = dynajax.Backend(mesh=mesh, sharding={r"^2\.weight$": P("data")}, cache_dir="")
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend)(torch.randn(8, 32))
    except torch._dynamo.exc.BackendCompilerFailed as e:
        inner = e.inner_exception
        return f"{type(inner).__name__}: {inner}"
    return "no error"


def eager_op_between_partitions() -> dict:
    """``relu`` kept in PyTorch between two FSDP partitions: it gets whole tensors."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    backend = dynajax.Backend(
        mesh=mesh, sharding=dynajax.ShardingRules.fsdp(), fallback_ops=["aten.relu"], cache_dir=""
    )
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x).square().mean()
    loss.backward()
    ref = reference(x).square().mean()
    ref.backward()
    pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
    return {
        "loss_diff": abs(loss.item() - ref.item()),
        "grad_diff": max(max_diff(p.grad, q.grad) for p, q in pairs),
        "partitions": len(partitions(backend, "forward")),
        "report": dynajax.Report(backend.graphs).text(width=None),
    }


def dynamic_batch() -> dict:
    """``dynamic=True``: the batch rule is decided per call from the concrete size."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mlp()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    backend = dynajax.Backend(mesh=mesh, sharding=dynajax.ShardingRules.fsdp(), cache_dir="")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    diffs = {}
    with torch.no_grad():
        for n in (16, 12):  # 12 rows do not split 8 ways: that call's batch is replicated
            x = torch.randn(n, 32)
            diffs[n] = max_diff(compiled(x), model(x))
    [part] = partitions(backend, "inference")
    return {"diffs": list(diffs.values()), "dynamic": part.executables.dynamic}


def interop() -> dict:
    """``jax_function``'s state placed by the same rules; ``jax.jit`` runs it sharded."""
    torch.manual_seed(0)
    model = mlp(32, 64, 16)
    x = torch.randn(16, 32)
    fn, state = dynajax.jax_function(model, x)
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes, as JAX makes them
    rules = dynajax.ShardingRules(MLP_TP)
    placed = dynajax.sharding.place(state, mesh, rules)
    by_batch = NamedSharding(mesh, P("data"))  # the input on the user's own mesh
    batch = jax.device_put(x.numpy(), by_batch)
    in_shardings = (dynajax.sharding.shardings(state, mesh, rules), by_batch)
    jitted = jax.jit(fn, in_shardings=in_shardings)
    out = jitted(placed, batch)
    grads = jax.jit(jax.grad(lambda s, b: fn(s, b).sum()))(placed, batch)
    with torch.no_grad():
        expected = model(x)
    model(x).sum().backward()
    return {
        "diff": float(np.abs(np.asarray(out) - expected.numpy()).max()),
        "grad_diff": max(
            float(np.abs(np.asarray(grads[n]) - p.grad.numpy()).max())
            for n, p in model.named_parameters()
        ),
        "specs": {k: str(v.sharding.spec) for k, v in placed.items()},
        "grad_specs": {k: str(v.sharding.spec) for k, v in grads.items()},
        "mesh_types": sorted({str(t) for v in placed.values() for t in v.sharding.mesh.axis_types}),
        "per_device": {
            k: sorted(set(dynajax.sharding.per_device_bytes(v).values())) for k, v in placed.items()
        },
    }


def main() -> None:
    started = time.perf_counter()
    devices = jax.devices()
    data = Mesh(np.array(devices), ("data",))
    model_axis = Mesh(np.array(devices), ("model",))
    two_d = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes: dynajax uses Auto
    facts: dict[str, Any] = {"devices": len(devices)}
    facts["dp_mlp"] = strategy(mlp_case, data, dynajax.ShardingRules.data_parallel())
    facts["fsdp_mlp"] = strategy(mlp_case, data, dynajax.ShardingRules.fsdp())
    facts["tp_mlp"] = strategy(mlp_case, model_axis, MLP_TP)
    facts["tp_gpt2"] = strategy(gpt2_case, model_axis, GPT2_TP)
    facts["2d_mlp"] = strategy(mlp_case, two_d, dynajax.ShardingRules(MLP_TP))
    facts["2d_gpt2"] = strategy(gpt2_case, two_d, dynajax.ShardingRules(GPT2_TP))
    facts["one_device_mesh"] = one_device_mesh()
    facts["indivisible"] = indivisible_rule()
    facts["eager_between"] = eager_op_between_partitions()
    facts["dynamic"] = dynamic_batch()
    facts["interop"] = interop()
    facts["seconds"] = round(time.perf_counter() - started, 1)
    json.dump(facts, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
