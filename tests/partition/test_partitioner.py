"""The partition stage: one decision (propose, assign to node.meta, fuse), read by the
backend, the what-if analysis and the report alike; and the stitched callable."""

from __future__ import annotations

import collections
import operator

import pytest
import torch
import torch.fx

import dynajax
from dynajax import Reason
from dynajax.capability import META_KEY, CapabilityChecker
from dynajax.partition import (
    PARTITION_KEY,
    VerdictSupport,
    assign_partitions,
    fuse_partitions,
    propose_partitions,
    stitched_callable,
)
from tests.tolerances import assert_same

aten = torch.ops.aten


@torch.library.custom_op("dynajax_parttest::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@opaque.register_fake
def _(x):
    return torch.empty_like(x)


def _aten_graph(fn, *args) -> torch.fx.GraphModule:
    """``fn`` traced to an ATen graph with verdicts in node.meta (no partitions yet)."""
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(*args)
    CapabilityChecker().annotate(gm)
    return gm


def _ops(nodes) -> list[str]:
    return [str(n.target) for n in nodes if n.target is not operator.getitem]


def islands(x):
    # JAX-capable runs of 1, 3 and 2 ops, split by the custom op (no rule).
    a = opaque(torch.sin(x))
    b = opaque(torch.exp(torch.cos(a)) * 2)
    return torch.tanh(b) - 1


@pytest.mark.parametrize("min_block_size", [1, 2, 3, 4])
def test_propose_keeps_partitions_of_at_least_min_block_size(min_block_size: int) -> None:
    gm = _aten_graph(islands, torch.randn(4))
    proposal = propose_partitions(gm, min_block_size)
    sizes = {1: [["aten.sin.default"]], 3: [], 2: []}
    sizes[3] = [["aten.cos.default", "aten.exp.default", "aten.mul.Tensor"]]
    sizes[2] = [["aten.tanh.default", "aten.sub.Tensor"]]
    expected_kept = [ops for n in (1, 3, 2) if n >= min_block_size for ops in sizes[n]]
    assert [_ops(p) for p in proposal.kept] == expected_kept
    assert len(proposal.too_small) == 3 - len(expected_kept)
    # Proposing decides nothing in the graph.
    assert not any(PARTITION_KEY in n.meta for n in gm.graph.nodes)
    assert all(
        n.meta[META_KEY].reason is not Reason.BLOCK_TOO_SMALL
        for n in gm.graph.nodes
        if META_KEY in n.meta and not n.meta[META_KEY].supported
    )


def test_assign_records_partitions_and_block_too_small_in_meta() -> None:
    gm = _aten_graph(islands, torch.randn(4))
    proposal = assign_partitions(gm, min_block_size=2)
    where = {n.name: n.meta.get(PARTITION_KEY) for n in gm.graph.nodes}
    assert where["sin"] is None
    assert (
        gm.graph.find_nodes(op="call_function", target=aten.sin.default)[0].meta[META_KEY].reason
        is Reason.BLOCK_TOO_SMALL
    )
    assert {where["cos"], where["exp"], where["mul"]} == {"jax_0"}
    assert {where["tanh"], where["sub"]} == {"jax_1"}
    assert [len(p) for p in proposal.kept] == [3, 2]
    assert proposal.jax_ops == 5


def test_fuse_builds_the_assigned_submodules() -> None:
    x = torch.randn(4)
    gm = _aten_graph(islands, x)
    proposal = assign_partitions(gm, min_block_size=1)
    fused = fuse_partitions(gm, proposal)
    subs = dict(fused.named_children())
    assert sorted(subs) == ["jax_0", "jax_1", "jax_2"]
    for name, nodes in zip(("jax_0", "jax_1", "jax_2"), proposal.kept, strict=True):
        inner = [n for n in subs[name].graph.nodes if n.op == "call_function"]
        assert _ops(inner) == _ops(nodes)
    assert_same(fused(x), islands(x))


def test_assume_supported_is_a_what_if() -> None:
    gm = _aten_graph(islands, torch.randn(4))
    support = VerdictSupport(assume_supported=frozenset({"dynajax_parttest.opaque.default"}))
    [whole] = propose_partitions(gm, 1, support).kept
    assert _ops(whole).count("dynajax_parttest.opaque.default") == 2
    assert len(_ops(whole)) == 8


def two_chains(x, y):
    # Every op supported: two chains with no edge between them, a multi-output op (and
    # its getitems), a view returned.
    values, indices = torch.sort(x.sin())
    return values.exp() + indices, y.cos().t(), torch.tanh(y)


def test_every_op_supported_proposes_what_the_partitioner_merges() -> None:
    # The short path (one partition of every op) is torch's partitioner's result.
    gm = _aten_graph(two_chains, torch.randn(4), torch.randn(3, 2))
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

    torch_partitions = CapabilityBasedPartitioner(
        gm, VerdictSupport(), allows_single_node_partition=True
    ).propose_partitions()
    assert [set(p.nodes) for p in torch_partitions] == [
        {n for n in gm.graph.nodes if n.op == "call_function"}
    ]
    [kept] = propose_partitions(gm, 1).kept
    assert set(kept) == set(torch_partitions[0].nodes)


def test_block_too_small_nodes_stay_capable_for_what_ifs() -> None:
    # Re-proposing on an assigned graph (as the what-if does) sees dissolved blocks.
    gm = _aten_graph(islands, torch.randn(4))
    assign_partitions(gm, min_block_size=3)
    assert [len(p) for p in propose_partitions(gm, 1).kept] == [1, 3, 2]


@pytest.mark.parametrize("min_block_size", [1, 2, 3, 4])
def test_report_and_compiled_graph_agree(min_block_size: int) -> None:
    x = torch.randn(4)
    backend = dynajax.Backend(min_block_size=min_block_size)
    assert_same(torch.compile(islands, backend=backend)(x), islands(x))
    [graph] = backend.graphs
    compiled = {
        name: collections.Counter(
            _ops(n for n in sub.graph_module.graph.nodes if n.op == "call_function")
        )
        for name, sub in graph.graph_module.named_children()
    }
    snapshot = {n.name: n for n in graph.snapshot.nodes}
    reported: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for node_name, part in graph.node_partition.items():
        node = snapshot[node_name]
        if node.target is not operator.getitem:
            reported[part][str(node.target)] += 1
    assert reported == compiled
    assert {p.name: p.op_count for p in graph.partitions} == {
        k: sum(v.values()) for k, v in compiled.items()
    }
    expected_parts = sum(1 for n in (1, 3, 2) if n >= min_block_size)
    assert len(compiled) == expected_parts
    too_small = [f for f in graph.fallbacks if f.reason is Reason.BLOCK_TOO_SMALL]
    assert len(too_small) == sum(n for n in (1, 3, 2) if n < min_block_size)
    # The what-if base is the compiled partition count.
    [what_if] = graph.what_if
    assert what_if.partitions_before == expected_parts
    assert what_if.partitions_after == 1


# ---------------------------------------------------------------------------------
# The stitched callable
# ---------------------------------------------------------------------------------


def _stitched(fn, *args) -> tuple[torch.fx.GraphModule, list[int]]:
    """The stitched module of ``fn``, its ``forward`` counting its calls."""
    backend = dynajax.Backend()
    torch.compile(fn, backend=backend)(*args)
    [graph] = backend.graphs
    gm = graph.graph_module
    calls: list[int] = []
    forward = gm.forward

    def counted(*inputs):
        calls.append(1)
        return forward(*inputs)

    gm.forward = counted
    return gm, calls


def test_one_partition_is_called_directly() -> None:
    def fn(x, y):
        return x.sin() * y, x.cos()

    x, y = torch.randn(3), torch.randn(3)
    gm, forward_calls = _stitched(fn, x, y)
    run = stitched_callable(gm)
    args = [x, y]
    outs = run(args)
    assert args == []  # boxed convention: the callee clears its inputs
    assert_same(tuple(outs), fn(x, y))
    assert run._boxed_call and run.graph_module is gm
    assert forward_calls == []  # the partition ran without the GraphModule


def test_partitions_with_eager_ops_between_run_the_graph() -> None:
    x = torch.randn(3)
    gm, forward_calls = _stitched(islands, x)
    run = stitched_callable(gm)
    args = [x]
    assert_same(tuple(run(args)), (islands(x),))
    assert args == []
    assert forward_calls == [1]
