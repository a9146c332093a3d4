"""Verdicts: whether a node runs in JAX, and if not, why. Verdicts are data.

They live in ``node.meta["dynajax_verdict"]``; the partitioner reads them, the report
prints them, tests assert on them.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Sequence

import torch
import torch.fx

META_KEY = "dynajax_verdict"


class Reason(enum.Enum):
    """Why a node stays in eager PyTorch."""

    NO_LOWERING = "no JAX rule for this op"
    CHECK_REFUSED = "the JAX rule refuses these arguments"
    DATA_DEPENDENT_SHAPE = "a size or scalar depends on tensor values"
    DTYPE = "dtype not supported by JAX/XLA"
    BLOCK_TOO_SMALL = "its JAX partition is smaller than min_block_size"
    USER_FALLBACK = "listed in fallback_ops"
    HOST_SCALAR = "computes Python scalars or assertions on the host, not tensors"
    EAGER_STORAGE = "an op in eager PyTorch reads this value's storage (as_strided)"
    EAGER_REFUSES = "eager PyTorch's CPU kernel raises for these dtypes; it runs there to raise"
    PERF = "faster in PyTorch: JAX could run it, but a JAX partition would cost more"
    OUTPUT_ALIAS = "a view of a tensor the graph also returns: PyTorch keeps them aliased"

    @property
    def is_fallback(self) -> bool:
        """Whether a node with this reason is tensor work that PyTorch does instead of JAX.

        HOST_SCALAR nodes (``sym_size``, ``_assert_scalar``, ``operator.ge`` on sizes)
        are shape bookkeeping that no JAX rule could take; reports count them apart.
        """
        return self is not Reason.HOST_SCALAR

    @property
    def is_choice(self) -> bool:
        """Whether the fallback is no gap of dynajax (strict mode accepts these).

        USER_FALLBACK and BLOCK_TOO_SMALL are the user's choices. EAGER_STORAGE nodes only
        follow another node into eager PyTorch: strict mode objects to that node, when it
        is not the user's choice. EAGER_REFUSES nodes are the user's program raising in
        eager, which it must do under dynajax too (with eager's error, not strict's).
        PERF nodes have a rule; dynajax keeps them in PyTorch because that is faster.
        OUTPUT_ALIAS nodes have a rule; PyTorch runs them so outputs alias as in eager."""
        return self in (
            Reason.USER_FALLBACK,
            Reason.BLOCK_TOO_SMALL,
            Reason.EAGER_STORAGE,
            Reason.EAGER_REFUSES,
            Reason.PERF,
            Reason.OUTPUT_ALIAS,
        )


@dataclasses.dataclass(frozen=True)
class Supported:
    """The node runs in its JAX partition.

    Attributes:
        target: the op, e.g. ``aten.add.Tensor``.
        kernel: where the node runs PyTorch's own kernel inside the XLA program
            (``dynajax/ffi``), the verdict it would have had otherwise (no rule, a rule
            that refuses the arguments, or a measured choice of PyTorch's kernel).
    """

    target: str
    kernel: Unsupported | None = None

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
        by_partitioner: set by a partition policy applied after the partitions were
            proposed (block size, views trimmed for PyTorch, output aliases): JAX can
            run the node, and re-proposing (the what-if analysis) sees it as capable.
    """

    reason: Reason
    node: str
    target: str
    detail: str = ""
    source_line: str = ""
    by_partitioner: bool = False

    @property
    def supported(self) -> bool:
        return False

    def describe(self) -> str:
        """``aten.sort.default (node 'sort'): NO_LOWERING: detail [file:line (code)]``."""
        detail = f": {self.detail}" if self.detail else ""
        where = f" [{self.source_line}]" if self.source_line else ""
        return f"{self.target} (node '{self.node}'): {self.reason.name}{detail}{where}"

    def with_reason(self, reason: Reason, detail: str) -> Unsupported:
        return dataclasses.replace(self, reason=reason, detail=detail)


Verdict = Supported | Unsupported


def target_name(node: torch.fx.Node) -> str:
    """``aten.add.Tensor`` for OpOverloads, the qualified name for anything else."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    if node.op == "call_function":
        return f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', t)}".lstrip(".")
    return str(t)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')

# Frames inside these directories are library internals (F.pad calling torch._C, our
# own backend), not the line a user would edit.
_LIBRARY_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


def _is_user_frame(path: str) -> bool:
    return not os.path.abspath(path).startswith(_LIBRARY_DIRS)


def source_line(node: torch.fx.Node) -> str:
    """The user's line that produced the node, as ``file:line (code)``.

    ``node.meta["stack_trace"]`` lists the frames Dynamo saw, outermost first; for
    nodes of aot_autograd graphs (backward ones too) it is the trace of the forward
    op they came from. The innermost frame outside torch and dynajax is the one a user
    can act on (``F.pad(...)`` in their model, not ``torch/nn/functional.py``); when
    every frame is library code, the innermost frame is returned.
    """
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return ""
    user = [f for f in frames if _is_user_frame(f[0])]
    path, line, _fn, code = (user or frames)[-1]
    return f"{path}:{line} ({code.strip()})"


def verdict_of(node: torch.fx.Node) -> Verdict | None:
    return node.meta.get(META_KEY)


def strict_objections(refused: Sequence[Unsupported]) -> list[Unsupported]:
    """The refusals strict mode objects to, on either driver: those that are a gap of
    dynajax, not a choice (``Reason.is_choice``: the user's ``fallback_ops``, a
    measured cost, eager's own error)."""
    return [v for v in refused if not v.reason.is_choice]
