"""The partitioner's view of verdicts: a torch.fx OperatorSupport over node.meta."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx
from torch.fx.passes.operator_support import OperatorSupportBase

from dynajax.capability.verdict import META_KEY


class VerdictSupport(OperatorSupportBase):
    """Supported iff the node is a call_function whose stored verdict is Supported.

    Placeholders, get_attr and output nodes are never supported, so they never enter a
    partition.
    """

    def is_node_supported(
        self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node
    ) -> bool:
        if node.op != "call_function":
            return False
        verdict = node.meta.get(META_KEY)
        return verdict is not None and verdict.supported
