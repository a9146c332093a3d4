"""Users' graph passes and pattern rewrites (options ``passes`` and ``rewrites``).

    torch.compile(model, backend="dynajax", options={
        "passes": {"post_aot": [MyPass()], "pre_aot": [my_function]},
        "rewrites": [dynajax.Rewrite(attention_pattern, attention_jax)],
    })

Stages a pass can run at (``STAGES``):

* ``pre_aot``: Dynamo's torch-level graph (``torch.matmul``, ``torch.softmax``,
  ``call_method transpose``), before aot_autograd; what a pass changes there is traced,
  differentiated and decomposed like the user's own code. Run after the rewrites.
* ``post_aot``: each ATen graph aot_autograd makes (inference, forward, backward),
  before dynajax's own passes, in the same pass list (``pipeline.run_passes``).
* ``post_passes``: each ATen graph after dynajax's passes, before the capability
  stage, in the same pass list.

A pass is a ``torch.fx.passes.infra.pass_base.PassBase`` or a callable on a
``GraphModule`` that changes it in place (returning None) or returns a GraphModule or
a ``PassResult``. The graph is linted after every pass.

Rewrites are applied to Dynamo's torch-level graph, before aot_autograd. There a pattern
written the way users write PyTorch matches the way they wrote it (``torch.matmul(q,
k.transpose(-2, -1))``); after aot_autograd the same lines are ``expand``/``view``/
``bmm``/``view`` chains whose shape arguments differ with every input shape, so an ATen
pattern would have to be written per shape. A ``Rewrite``'s pattern is traced once with
``torch.fx.symbolic_trace`` and matched by torch.fx's ``SubgraphMatcher`` through
``subgraph_rewriter.replace_pattern_with_filters``; its replacement is traced for each
match with ``make_fx`` on that match's example inputs, so it may call anything that
``make_fx`` can trace, ``dynajax.call_jax`` included (which becomes one op that the JAX
partition inlines). Each applied rewrite is recorded (``RewriteRecord``: which pattern,
how many matches, the user's source line of each) and shown by the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.utils.matcher_utils import InternalMatch
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from dynajax.capability.verdict import source_line

STAGES = ("pre_aot", "post_aot", "post_passes")

# node.meta key naming the rewrite that inserted a node.
REWRITE_KEY = "dynajax_rewrite"

MatchFilter = Callable[[InternalMatch, torch.fx.Graph, torch.fx.Graph], bool]


class CallablePass(PassBase):
    """A user's function on a GraphModule as a ``PassBase`` for ``run_pass_list``."""

    def __init__(self, fn: Callable[[torch.fx.GraphModule], Any]) -> None:
        super().__init__()
        self.fn = fn

    def __repr__(self) -> str:
        return f"CallablePass({getattr(self.fn, '__qualname__', self.fn)!r})"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        result = self.fn(graph_module)
        if result is None:
            return PassResult(graph_module, True)
        if isinstance(result, PassResult):
            return result
        if isinstance(result, torch.fx.GraphModule):
            return PassResult(result, True)
        raise TypeError(
            f"the pass {self.fn!r} returned {type(result).__name__}; a pass changes the "
            "GraphModule in place and returns None, or returns a GraphModule or a PassResult."
        )


def as_pass(value: Any) -> PassBase:
    """``value`` as a PassBase (a callable is wrapped in ``CallablePass``)."""
    if isinstance(value, PassBase):
        return value
    if callable(value):
        return CallablePass(value)
    raise TypeError(
        f"a pass must be a torch.fx PassBase or a function of a GraphModule, got {value!r}"
    )


def normalize_rewrites(value: Any) -> tuple[Rewrite, ...]:
    """The ``rewrites`` option as a tuple of ``Rewrite``s: one rewrite (a ``Rewrite`` or
    what ``Rewrite.coerce`` takes) or an iterable of them.

    Raises:
        TypeError: an entry is not a rewrite.
    """
    if isinstance(value, Rewrite) or callable(value):
        value = [value]
    return tuple(Rewrite.coerce(r) for r in value)


def normalize_passes(value: Any) -> tuple[tuple[str, tuple[PassBase, ...]], ...]:
    """The ``passes`` option as ``((stage, (pass, ...)), ...)`` in ``STAGES`` order.

    Accepts a mapping ``{stage: pass or [passes]}`` (None or empty: no passes).

    Raises:
        ValueError: an unknown stage.
        TypeError: not a mapping, or an entry is not a pass.
    """
    if not value:
        return ()
    if isinstance(value, tuple) and all(
        isinstance(v, tuple) and len(v) == 2 and v[0] in STAGES for v in value
    ):
        value = dict(value)  # already normalized
    if not isinstance(value, Mapping):
        raise TypeError(
            f"passes must be a mapping of stage to passes, e.g. {{'post_aot': [my_pass]}} "
            f"(stages: {', '.join(STAGES)}), got {value!r}"
        )
    unknown = sorted(set(value) - set(STAGES))
    if unknown:
        raise ValueError(
            f"passes: unknown stage(s) {unknown}; the stages are {', '.join(STAGES)} "
            "(pre_aot: Dynamo's torch-level graph; post_aot: each ATen graph before "
            "dynajax's passes; post_passes: after them)."
        )
    out = []
    for stage in STAGES:
        entries = value.get(stage)
        if entries is None:
            continue
        if isinstance(entries, PassBase) or not isinstance(entries, Iterable):
            entries = [entries]
        passes = tuple(as_pass(p) for p in entries)
        if passes:
            out.append((stage, passes))
    return tuple(out)


def passes_at(passes: Sequence[tuple[str, Sequence[PassBase]]], stage: str) -> list[PassBase]:
    """The passes of one stage."""
    return [p for s, ps in passes if s == stage for p in ps]


# -- rewrites -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Rewrite:
    """Replace every match of ``pattern`` in Dynamo's graph by ``replacement``.

    Attributes:
        pattern: a function of tensors written as the model writes the computation
            (``torch.matmul``, ``torch.softmax(x, dim=-1)``, ``x.transpose(-2, -1)``);
            traced by ``torch.fx.symbolic_trace``. Its arguments match any value; its
            literals (``dim=-1``, a scale ``/ 8.0``) must be equal unless
            ``ignore_literals``.
        replacement: a function of the same arguments computing the same values (torch
            ops, ``dynajax.call_jax``); traced with ``make_fx`` for each match on the
            match's inputs (their shapes and dtypes).
        name: what the report calls it (default: the pattern's name).
        match_filters: functions ``(match, graph, pattern_graph) -> bool`` that keep or
            drop a match (torch.fx's ``InternalMatch``: ``match.nodes_map`` maps the
            pattern's nodes to the graph's, whose ``meta["example_value"]`` holds
            shapes), e.g. to check literals when ``ignore_literals`` is set.
        ignore_literals: match any literal (scales, dims): then a filter should check
            the ones the replacement relies on.
    """

    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    name: str = ""
    match_filters: tuple[MatchFilter, ...] = ()
    ignore_literals: bool = False

    def __post_init__(self) -> None:
        if not callable(self.pattern) or not callable(self.replacement):
            raise TypeError(
                f"Rewrite needs a pattern function and a replacement function, got "
                f"{self.pattern!r} and {self.replacement!r}"
            )
        object.__setattr__(self, "match_filters", tuple(self.match_filters))
        if not self.name:
            object.__setattr__(self, "name", getattr(self.pattern, "__name__", "rewrite"))

    @classmethod
    def coerce(cls, value: Any) -> Rewrite:
        """A Rewrite, or one from a ``(pattern, replacement)`` pair."""
        if isinstance(value, Rewrite):
            return value
        if isinstance(value, tuple) and len(value) == 2:
            return cls(*value)
        raise TypeError(
            f"a rewrite is a dynajax.Rewrite(pattern, replacement) or a (pattern, "
            f"replacement) pair of functions, got {value!r}"
        )


@dataclasses.dataclass(frozen=True)
class RewriteRecord:
    """What one rewrite did to one Dynamo graph.

    Attributes:
        name: the rewrite's name.
        pattern: the pattern function's qualified name.
        sources: the user's source line of each match (``file:line (code) in module``),
            from the stack trace and module path of the match's last node (the one whose
            value the replacement computes).
    """

    name: str
    pattern: str
    sources: tuple[str, ...]

    @property
    def matches(self) -> int:
        return len(self.sources)

    def lines(self, indent: str = "") -> list[str]:
        out = [f"{indent}{self.name} (pattern {self.pattern}): {self.matches} match(es)"]
        out += [f"{indent}  at {s}" for s in self.sources if s]
        return out


def _traced_pattern(rewrite: Rewrite) -> torch.fx.Graph:
    return torch.fx.symbolic_trace(rewrite.pattern).graph


def _has_example_values(match: InternalMatch, graph: torch.fx.Graph, pattern: Any) -> bool:
    # The replacement is traced on the matched inputs' values: every one must be known.
    return all(
        isinstance(n, torch.fx.Node) and "example_value" in n.meta for n in match.placeholder_nodes
    )


def _replacement_tracer(rewrite: Rewrite) -> Callable[[InternalMatch, Any, Any], torch.fx.Graph]:
    def trace(
        match: InternalMatch, graph: torch.fx.Graph, pattern: torch.fx.Graph
    ) -> torch.fx.Graph:
        values = [n.meta["example_value"] for n in match.placeholder_nodes]
        # In the values' own fake mode, so that no op of the replacement runs for real
        # (and no tensor constant is lifted into the graph).
        modes = [v.fake_mode for v in values if isinstance(v, FakeTensor)]
        with modes[0] if modes else contextlib.nullcontext():
            traced = make_fx(rewrite.replacement, tracing_mode="real")(*values)
        traced.graph.eliminate_dead_code()
        return traced.graph

    return trace


def apply_rewrites(gm: torch.fx.GraphModule, rewrites: Sequence[Rewrite]) -> list[RewriteRecord]:
    """Applies each rewrite to Dynamo's graph ``gm`` in order; returns what matched.

    Inserted nodes carry the replaced node's ``stack_trace`` (so reports and errors
    name the user's line) and ``meta[REWRITE_KEY]``, the rewrite's name.
    """
    records = []
    for rewrite in rewrites:
        replaced = replace_pattern_with_filters(
            gm,
            _traced_pattern(rewrite),
            None,
            match_filters=[_has_example_values, *rewrite.match_filters],
            ignore_literals=rewrite.ignore_literals,
            replacement_callback=_replacement_tracer(rewrite),
        )
        if not replaced:
            continue
        sources = []
        for match in replaced:
            returned = [match.nodes_map[n] for n in _pattern_outputs(match)]
            anchor = returned[-1] if returned else match.anchor
            sources.append(_where(anchor))
            for node in match.replacements:
                node.meta.setdefault("stack_trace", anchor.meta.get("stack_trace"))
                node.meta[REWRITE_KEY] = rewrite.name
        records.append(
            RewriteRecord(
                rewrite.name,
                getattr(rewrite.pattern, "__qualname__", repr(rewrite.pattern)),
                tuple(sources),
            )
        )
    if records:
        gm.graph.lint()
        gm.recompile()
    return records


def _where(node: torch.fx.Node) -> str:
    """``file:line (code)`` of the node, and the module it ran in (``in blocks.1``)."""
    where = source_line(node)
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, _cls = list(stack.values())[-1]
        module = re.sub(r"^L\['self'\]\.?", "", str(path))
        if module:
            where += f" in {module}"
    return where


def _pattern_outputs(match: Any) -> list[torch.fx.Node]:
    """The pattern nodes whose values the pattern returns (keys of ``nodes_map``)."""
    return [
        n
        for n in match.nodes_map
        if isinstance(n, torch.fx.Node)
        and n.op != "placeholder"
        and any(u.op == "output" for u in n.users)
    ]
