"""PyTorch's kernel inside the XLA program, decided per node for both drivers.

A node refused for a reason PyTorch's own kernel can stand in for (no rule, a rule
refusing the arguments, the kernel measured faster) runs that kernel as a custom call
inside its program where ``ffi.kernel_refusal`` allows (a C++ kernel, static shapes, no
randomness, no writes, no storage read); ``mark`` records it in the node's meta
(``KERNEL_KEY``), which lowering reads. In the backend the node is then Supported, its
refusal kept as the verdict's ``kernel`` (``inside``): its partition calls the kernel
instead of being cut around it. The whole-graph driver keeps the refusal and lists the
node among its callbacks, run as the kernel (``program/driver.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.fx

from dynajax.capability.verdict import META_KEY, Reason, Supported, Unsupported, Verdict
from dynajax.ffi import kernel_refusal
from dynajax.lowering.registry import KERNEL_KEY

log = logging.getLogger("dynajax.capability")

# The refusals PyTorch's kernel inside XLA can stand in for (the others are the user's
# choice, sizes and dtypes no program holds, or eager's own error).
KERNEL_REASONS = frozenset({Reason.NO_LOWERING, Reason.CHECK_REFUSED, Reason.PERF})


def mark(
    node: torch.fx.Node,
    verdict: Unsupported,
    reasons: Iterable[Reason] = KERNEL_REASONS,
    *,
    static: bool = True,
) -> bool:
    """Whether ``node``, refused with ``verdict``, runs PyTorch's kernel inside its
    program (one of ``reasons``, and ``ffi.kernel_refusal`` says None; ``static`` as
    there); marks it ``KERNEL_KEY`` where it does, and unmarks it where not."""
    node.meta.pop(KERNEL_KEY, None)
    if verdict.reason not in reasons or "val" not in node.meta:
        return False
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    refusal = kernel_refusal(node.target, args, kwargs, node.meta["val"], static=static)
    if refusal is not None:
        log.debug("%s stays out of XLA: %s", node.name, refusal)
        return False
    node.meta[KERNEL_KEY] = True
    return True


def inside(node: torch.fx.Node, verdict: Verdict) -> Verdict:
    """The backend's verdict: Supported with ``verdict`` as its ``kernel`` where the
    node runs PyTorch's kernel inside its partition (``mark``), else ``verdict``."""
    if isinstance(verdict, Unsupported) and mark(node, verdict):
        return Supported(verdict.target, kernel=verdict)
    return verdict


def kernel_verdicts(gm: torch.fx.GraphModule) -> list[Unsupported]:
    """The refusals the annotated graph's kernels inside XLA stand in for (strict mode
    objects to those that are no choice, as to fallbacks)."""
    found = []
    for node in gm.graph.nodes:
        verdict = node.meta.get(META_KEY)
        if isinstance(verdict, Supported) and verdict.kernel is not None:
            found.append(verdict.kernel)
    return found
