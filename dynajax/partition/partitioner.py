"""The partition decision: which supported nodes run together in which JAX partition.

One function proposes partitions from the verdicts in ``node.meta``
(``propose_partitions``); the backend and the what-if analysis both call it, so a
change of policy (block size today, a cost model or sharding later) changes both.
``assign_partitions`` records the decision in the graph: every node of a kept partition
gets ``node.meta[PARTITION_KEY] = "jax_<n>"``, and the nodes of a dissolved one get a
BLOCK_TOO_SMALL verdict; a view whose users all run in PyTorch gets a PERF one (it
costs nothing there; in a JAX partition it is a copy), and a view returned beside
another output over the same tensor an OUTPUT_ALIAS one (PyTorch makes it a real view,
so the outputs share storage as eager's do). ``fuse_partitions`` then turns each
recorded partition into a submodule of that name.

    before:  x -> sin -> custom_op -> cos -> add -> out
    assign:  sin: jax_0;  cos, add: jax_1                       (node.meta)
    fuse:    x -> jax_0(sin) -> custom_op -> jax_1(cos, add) -> out

Nodes left outside every partition run in eager PyTorch from the outer graph.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from dynajax.capability import META_KEY, Reason, Supported, Unsupported, target_name
from dynajax.capability.verdict import source_line
from dynajax.lowering.registry import KERNEL_KEY, get_rule

PREFIX = "jax_"

# node.meta key of the partition (``jax_<n>``) a node was assigned to; absent when the
# node runs in eager PyTorch.
PARTITION_KEY = "dynajax_partition"


def compute_op_count(nodes: Iterable[torch.fx.Node]) -> int:
    """ATen ops in a set of nodes (getitem is bookkeeping, not an op)."""
    return sum(1 for n in nodes if n.op == "call_function" and n.target is not operator.getitem)


def xla_op_count(nodes: Iterable[torch.fx.Node]) -> int:
    """ATen ops in ``nodes`` that XLA computes (not PyTorch's kernel inside XLA)."""
    return sum(
        1
        for n in nodes
        if n.op == "call_function"
        and n.target is not operator.getitem
        and not n.meta.get(KERNEL_KEY)
    )


def is_free_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a view that costs nothing in eager PyTorch (``t``, ``permute``,
    ``view``, ``expand``, ``slice``, ...): new strides over its input's storage, where a
    JAX partition must write a new array. Views whose rules address storage
    (``as_strided``: they need eager's layout) are not counted: where they run follows
    the layout rules of the capability stage."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not target.is_view:
        return False
    rule = get_rule(target)
    return rule is None or not rule.needs_layout


def output_alias_views(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The free views between an intermediate tensor and the graph outputs, where two or
    more outputs are that tensor or views of it.

        y = mul(x, 2);  v = view(y, [-1]);  return (y, v)       ->  {v}

    Eager returns ``v`` as a view of ``y``: writing into one changes the other. A JAX
    partition returns two arrays, and aot_autograd counts on the compiled graph to keep
    the relation (for outputs that alias an intermediate and need no gradient it does not
    regenerate them), so these views must run in PyTorch over the partition's output.
    Views of graph inputs are aot_autograd's to regenerate and are not listed.
    """
    output = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    if output is None:
        return set()
    chains: dict[torch.fx.Node, list[list[torch.fx.Node]]] = {}
    for leaf in torch.utils._pytree.tree_leaves(output.args):
        if not isinstance(leaf, torch.fx.Node):
            continue
        chain, base = [], leaf
        while is_free_view(base) and isinstance(base.args[0], torch.fx.Node):
            chain.append(base)
            base = base.args[0]
        if base.op == "call_function":
            chains.setdefault(base, []).append(chain)
    return {v for group in chains.values() if len(group) > 1 for chain in group for v in chain}


def trim_views(
    nodes: list[torch.fx.Node], output_aliases: AbstractSet[torch.fx.Node] = frozenset()
) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """``nodes`` (a proposed partition) without its free views whose every user is an
    op outside the partition (or, for ``output_aliases``, the graph output), and those
    views.

    Such a view feeds only PyTorch: there it is new strides over its input (``t`` of a
    weight before an ``addmm`` kept in PyTorch), in the partition a copy of its input
    written on every call and handed out. Trimming repeats until no such view is left
    (a chain of views). Views that are graph outputs stay: tests and users who compile
    a view alone get it from JAX. Removing nodes whose users are all outside keeps the
    partition free of cycles: a path from such a node back into the partition would
    already have been one from the partition out and back in.
    """
    inside = set(nodes)
    trimmed: list[torch.fx.Node] = []
    changed = True
    while changed:
        changed = False
        for n in reversed(nodes):
            if n in inside and is_free_view(n) and n.users:
                if all(
                    (u.op == "call_function" and u not in inside)
                    or (u.op == "output" and n in output_aliases)
                    for u in n.users
                ):
                    inside.discard(n)
                    trimmed.append(n)
                    changed = True
    return [n for n in nodes if n in inside], trimmed


class VerdictSupport(OperatorSupportBase):
    """The partitioner's view of verdicts: a node can join a JAX partition when it is a
    call_function whose stored verdict is Supported.

    The verdicts the partition policies gave (block size, trimmed views, output
    aliases: ``Unsupported.by_partitioner``) count as capable: those policies are
    applied after the partitions are proposed, so re-proposing on a graph that already
    carries them (the what-if analysis) must see those nodes as they were. A PERF
    verdict of the capability stage (an op measured faster in PyTorch) does not.
    Placeholders, get_attr and output nodes never enter a partition.

    Args:
        assume_supported: op names (``aten.sort.default``) to treat as supported
            whatever their verdict; a getitem follows its producer. Used to ask
            "what if this op had a rule".
    """

    def __init__(self, assume_supported: frozenset[str] = frozenset()) -> None:
        self.assume_supported = assume_supported

    def is_node_supported(
        self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node
    ) -> bool:
        if node.op != "call_function":
            return False
        if self.assume_supported:
            producer = node
            if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
                producer = node.args[0]
            if producer.op == "call_function" and target_name(producer) in self.assume_supported:
                return True
        verdict = node.meta.get(META_KEY)
        return verdict is not None and (verdict.supported or verdict.by_partitioner)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """Partitions proposed for one graph, under one block-size policy.

    Attributes:
        kept: the partitions that become ``jax_<n>``, ``kept[n]`` being ``jax_<n>``'s
            nodes, each in graph order, the partitions ordered by their first node.
        too_small: the partitions dissolved because they hold fewer than
            ``min_block_size`` ATen ops (their nodes run in eager PyTorch).
        min_block_size: the policy they were formed under.
        views: the views taken out of each partition by ``trim_views`` (their users
            all run in PyTorch): in PyTorch they cost nothing, in JAX a copy of the
            viewed tensor per call. They arise next to ops kept in PyTorch: ``t`` of a
            weight before an ``addmm`` in ``fallback_ops`` was a JAX partition that
            copied the transposed weight on every call (an MLP 512-2048-512 on batch
            64, both addmms in PyTorch, one torch thread, best of 40 interleaved calls:
            3.51 ms with the copies, 2.08 ms without, eager 1.78 ms).
    """

    kept: list[list[torch.fx.Node]]
    too_small: list[list[torch.fx.Node]]
    min_block_size: int
    views: list[list[torch.fx.Node]] = dataclasses.field(default_factory=list)
    output_aliases: set[torch.fx.Node] = dataclasses.field(default_factory=set)

    @property
    def jax_ops(self) -> int:
        return sum(compute_op_count(p) for p in self.kept)


def propose_partitions(
    graph: torch.fx.Graph | torch.fx.GraphModule,
    min_block_size: int = 1,
    support: OperatorSupportBase | None = None,
    *,
    output_aliases: bool = False,
) -> Proposal:
    """The partitions CapabilityBasedPartitioner forms from the verdicts in node.meta.

    Single-node partitions are allowed; partitions with no ATen op are ignored, those
    with fewer than ``min_block_size``, or whose every op runs PyTorch's kernel inside
    XLA (eager with a crossing more), are ``too_small``; views whose users all run in
    PyTorch are taken out first (``views``). Changes nothing in the graph.

    Args:
        graph: a graph whose call_function nodes carry verdicts (``META_KEY``).
        min_block_size: the smallest partition worth a JAX call, in ATen ops.
        support: which nodes may join a partition (default: ``VerdictSupport()``).
        output_aliases: take out the views that alias another output
            (``output_alias_views``): for inference graphs, all of whose outputs the
            user sees. A training forward's outputs are mostly tensors saved for the
            backward, and aot_autograd regenerates the aliases among its outputs that
            need gradients. Views already marked OUTPUT_ALIAS (a graph re-proposed by
            the what-if analysis) are taken out either way.
    """
    if isinstance(graph, torch.fx.GraphModule):
        gm = graph
    else:
        # The partitioner only walks the graph; get_attr values are never read.
        root = {n.target: torch.empty(0) for n in graph.nodes if n.op == "get_attr"}
        gm = torch.fx.GraphModule(root, graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    kept: list[list[torch.fx.Node]] = []
    too_small: list[list[torch.fx.Node]] = []
    views: list[list[torch.fx.Node]] = []
    aliases = output_alias_views(gm.graph) if output_aliases else set()
    aliases |= {
        n
        for n in gm.graph.nodes
        if getattr(n.meta.get(META_KEY), "reason", None) is Reason.OUTPUT_ALIAS
    }
    for proposed in _proposed(gm, support or VerdictSupport()):
        nodes, trimmed = trim_views(sorted(proposed, key=order.__getitem__), aliases)
        if trimmed:
            views.append(sorted(trimmed, key=order.__getitem__))
        ops = compute_op_count(nodes)
        if ops == 0:
            continue
        worth = ops >= min_block_size and xla_op_count(nodes) > 0
        (kept if worth else too_small).append(nodes)
    # Deterministic submodule names, in graph order.
    kept.sort(key=lambda nodes: order[nodes[0]])
    return Proposal(kept, too_small, min_block_size, views, aliases)


def _proposed(gm: torch.fx.GraphModule, support: OperatorSupportBase) -> list[list[torch.fx.Node]]:
    """The node sets CapabilityBasedPartitioner proposes. Where every op is supported
    (the usual model), that is one partition of them all, found without it: its merges
    end there (no node outside the partition lies between two of its nodes), and it
    costs about 0.3 ms per node (1.2 s on a 24-layer GPT-2's 4,000 nodes)."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    modules = dict(gm.named_modules())
    if ops and all(support.is_node_supported(modules, n) for n in ops):
        return [ops]
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    return [list(p.nodes) for p in partitioner.propose_partitions()]


def assign_partitions(
    gm: torch.fx.GraphModule, min_block_size: int = 1, *, output_aliases: bool = False
) -> Proposal:
    """Decides the partitions of ``gm`` and records them in its nodes' meta.

    Each node of ``kept[n]`` gets ``meta[PARTITION_KEY] = "jax_<n>"``; each node of a
    dissolved partition gets a BLOCK_TOO_SMALL verdict, each trimmed view a PERF or
    OUTPUT_ALIAS one (``output_aliases`` as in ``propose_partitions``). Returns the
    proposal.
    """
    proposal = propose_partitions(gm, min_block_size, output_aliases=output_aliases)
    dissolved = [
        (nodes, Reason.BLOCK_TOO_SMALL, f"< min_block_size={min_block_size}")
        for nodes in proposal.too_small
    ] + [
        (nodes, Reason.PERF, "a view for PyTorch ops: free in PyTorch, a copy in JAX")
        for nodes in proposal.views
    ]
    for nodes, reason, why in dissolved:
        ops = compute_op_count(nodes)
        for n in nodes:
            verdict = n.meta.get(META_KEY)
            if isinstance(verdict, Supported) and verdict.kernel is not None:
                # PyTorch's kernel, left outside XLA: eager runs it, for its own reason.
                n.meta.pop(KERNEL_KEY, None)
                n.meta[META_KEY] = verdict.kernel
                continue
            if verdict is not None:
                detail = why if reason is Reason.PERF else f"partition of {ops} op(s) {why}"
                if reason is Reason.PERF and n in proposal.output_aliases:
                    reason_n, detail = Reason.OUTPUT_ALIAS, "returned as a view, as eager does"
                else:
                    reason_n = reason
                n.meta[META_KEY] = Unsupported(
                    reason_n, n.name, target_name(n), detail, source_line(n), by_partitioner=True
                )
    for n in gm.graph.nodes:
        n.meta.pop(PARTITION_KEY, None)
    for i, nodes in enumerate(proposal.kept):
        for n in nodes:
            n.meta[PARTITION_KEY] = f"{PREFIX}{i}"
    return proposal


def fuse_partitions(gm: torch.fx.GraphModule, proposal: Proposal) -> torch.fx.GraphModule:
    """Fuses ``proposal.kept[n]`` into the submodule ``jax_<n>`` (``gm``'s graph in
    place; the module returned is a lazy one over it).

    Each submodule returns a tuple, even of one value, so callers index it uniformly.
    """
    if not proposal.kept:
        return gm
    # Lazy modules: a partition's graph is lowered by interpreting it, so its Python
    # code (0.1 s per 1,000 nodes) is made only if something calls or prints it; the
    # stitched graph's, at its first call.
    with _use_lazy_graph_module(True):
        return fuse_by_partitions(
            _LazyGraphModule.from_graphmodule(gm),
            [dict.fromkeys(nodes) for nodes in proposal.kept],
            prefix=PREFIX,
            always_return_tuple=True,
        )
