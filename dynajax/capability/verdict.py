"""Verdicts: whether a node runs in JAX, and if not, why. Verdicts are data.

They live in ``node.meta["dynajax_verdict"]``; the partitioner reads them, the report
prints them, tests assert on them.
"""

from __future__ import annotations

import dataclasses
import enum
import re

import torch.fx

META_KEY = "dynajax_verdict"


class Reason(enum.Enum):
    """Why a node stays in eager PyTorch."""

    NO_LOWERING = "no JAX rule for this op"
    CHECK_REFUSED = "the JAX rule refuses these arguments"
    DATA_DEPENDENT_SHAPE = "output shape depends on tensor values"
    DTYPE = "dtype not supported by JAX/XLA"
    BLOCK_TOO_SMALL = "its JAX partition is smaller than min_block_size"
    USER_FALLBACK = "listed in fallback_ops"


@dataclasses.dataclass(frozen=True)
class Supported:
    """The node runs in JAX."""

    target: str

    @property
    def supported(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """The node runs in eager PyTorch.

    Attributes:
        reason: the category.
        node: the FX node's name.
        target: the op, e.g. ``aten.nonzero.default``.
        detail: the specifics (a check's message, the offending dtype, ...).
        source_line: ``file:line (code)`` of the user code that produced the node.
    """

    reason: Reason
    node: str
    target: str
    detail: str = ""
    source_line: str = ""

    @property
    def supported(self) -> bool:
        return False

    def describe(self) -> str:
        detail = f": {self.detail}" if self.detail else ""
        where = f" [{self.source_line}]" if self.source_line else ""
        return f"{self.target} (node '{self.node}'): {self.reason.name}{detail}{where}"

    def with_reason(self, reason: Reason, detail: str) -> Unsupported:
        return dataclasses.replace(self, reason=reason, detail=detail)


Verdict = Supported | Unsupported


def target_name(node: torch.fx.Node) -> str:
    """``aten.add.Tensor`` for OpOverloads, the qualified name for anything else."""
    t = node.target
    if hasattr(t, "_overloadname"):
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    if node.op == "call_function":
        return f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', t)}".lstrip(".")
    return str(t)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def source_line(node: torch.fx.Node) -> str:
    """The innermost user frame of the node's stack trace, as ``file:line (code)``."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return ""
    path, line, _fn, code = frames[-1]
    return f"{path}:{line} ({code.strip()})"


def verdict_of(node: torch.fx.Node) -> Verdict | None:
    return node.meta.get(META_KEY)
