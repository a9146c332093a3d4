"""drop_unused_vectors: asks SVD and eigh for values only when no one reads the vectors.

    before:  A -> _linalg_svd(A, False, True) -> getitem 1 -> out       (U, Vh unused)
    after:   A -> _linalg_svd(A, False, False) -> getitem 1 -> out

PyTorch's svdvals, eigvalsh, matrix_rank, cond and nuclear norm compute values only in
eager, but traced under fake tensors they request the vectors too (ATen's
``_may_require_fw_or_bw_grad`` is true for any tensor subclass). Singular values and
eigenvalues are unique, while the vectors' signs depend on the LAPACK build, so a
values-only node can run in JAX where the full decomposition cannot.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

aten = torch.ops.aten

# op -> (index of the flag that requests vectors, indices of the value outputs)
_VECTOR_FLAGS = {
    aten._linalg_svd.default: (2, "compute_uv", {1}),
    aten._linalg_eigh.default: (2, "compute_v", {0}),
}


def _only_values_read(node: torch.fx.Node, values: set[int]) -> bool:
    return all(
        user.op == "call_function" and user.target is operator.getitem and user.args[1] in values
        for user in node.users
    )


def _fake_value(node: torch.fx.Node):
    def val(a):
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    first, target = node.args[0], node.target
    if not isinstance(first, torch.fx.Node) or not callable(target):
        raise TypeError(f"'{node.name}' is not a call on a tensor node")
    args = torch.fx.node.map_aggregate(node.args, val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    with first.meta["val"].fake_mode:
        return target(*args, **kwargs)


class DropUnusedVectors(PassBase):
    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        modified = False
        for node in graph_module.graph.nodes:
            if node.op != "call_function" or node.target not in _VECTOR_FLAGS:
                continue
            position, name, values = _VECTOR_FLAGS[node.target]
            requested = node.kwargs.get(
                name, node.args[position] if len(node.args) > position else True
            )
            if not requested or not _only_values_read(node, values):
                continue
            if len(node.args) > position:
                node.update_arg(position, False)
            else:
                node.update_kwarg(name, False)
            if isinstance(node.args[0], torch.fx.Node) and "val" in node.args[0].meta:
                node.meta["val"] = _fake_value(node)
            modified = True
        return PassResult(graph_module, modified)
