"""Which inputs of a graph are parameters and buffers, and their names.

Sharding rules match names (``"0.weight"``), but a JAX partition only sees placeholders.
The names travel in three steps:

1. Dynamo's graph: each placeholder's ``meta["grapharg"].source`` says where Dynamo read
   it from, e.g. ``L['self']._modules['h']._modules['0']._parameters['weight']``
   (PyTorch inlines ``nn.Module``s and lifts their state to inputs), which
   ``dynamo_input_names`` turns into ``StateName("h.0.weight", "parameter")``.
2. aot_autograd's ATen graphs: each placeholder's ``meta["desc"]`` says which input of
   Dynamo's graph it is (``PlainAOTInput(idx)``) or, when PyTorch lifted the state
   itself, its name (``ParamAOTInput(target)``, ``BufferAOTInput(target)``);
   ``aten_input_names`` maps them. A backward graph's primals keep their desc, so
   the parameters it takes are named too; saved activations and tangents are not state.
3. The partition: the outer graph's ``call_module`` node of ``jax_<n>`` takes its
   arguments in the order of the submodule's placeholders (``partition_input_names``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx

PARAMETER = "parameter"
BUFFER = "buffer"

# The roots under which a compiled module's own state is reached: its ``forward``'s
# ``self``, or the module torch.compile wraps (``fn``, ``fn.__self__``).
_SELF_ROOTS = ("self", "fn")
_ROOT = re.compile(r"""^[LG]\[['"]([^'"]+)['"]\]""")
_TOKEN = re.compile(r"""\.(\w+)|\[(?:'([^']*)'|"([^"]*)"|(-?\d+))\]""")
_CONTAINERS = {"_modules": None, "_parameters": PARAMETER, "_buffers": BUFFER}


@dataclasses.dataclass(frozen=True)
class StateName:
    """A parameter or buffer: its dotted name and its kind (``"parameter"``/``"buffer"``)."""

    name: str
    kind: str


def source_state_name(source_name: str) -> StateName | None:
    """The state a Dynamo source name reads, or None when it is not a parameter or
    buffer (a model input, a constant, a global tensor).

    ``L['self']._modules['0']._parameters['weight']`` -> ``0.weight`` (parameter);
    state reached through another variable keeps it as a prefix:
    ``G['model']._modules['0']._parameters['weight']`` -> ``model.0.weight``.
    """
    root = _ROOT.match(source_name)
    if root is None:
        return None
    parts: list[str] = [] if root.group(1) in _SELF_ROOTS else [root.group(1)]
    kind = None
    pos = root.end()
    while pos < len(source_name):
        tok = _TOKEN.match(source_name, pos)
        if tok is None:
            return None  # a call or an expression: not a plain attribute path
        pos = tok.end()
        attr, *keys = tok.groups()
        if attr is not None:
            if attr in _CONTAINERS:
                kind = _CONTAINERS[attr]
            elif attr != "__self__":
                parts.append(attr)
                kind = None
        else:
            parts.append(next(k for k in keys if k is not None))
    if kind is None or not parts:
        return None
    return StateName(".".join(parts), kind)


def dynamo_input_names(gm: torch.fx.GraphModule) -> list[StateName | None]:
    """One entry per placeholder of Dynamo's graph: its state name, or None."""
    out: list[StateName | None] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = None
        if source is not None:
            text = source.name() if callable(source.name) else source.name
            name = source_state_name(str(text))
        out.append(name)
    return out


def aten_input_names(
    gm: torch.fx.GraphModule, dynamo_names: Sequence[StateName | None]
) -> dict[str, StateName]:
    """Placeholder name -> state name, for the placeholders of an ATen graph that are
    parameters or buffers (through their aot_autograd ``desc``)."""
    out: dict[str, StateName] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = _desc_name(node.meta.get("desc"), dynamo_names)
        if name is not None:
            out[node.name] = name
    return out


def _desc_name(desc: Any, dynamo_names: Sequence[StateName | None]) -> StateName | None:
    kind = type(desc).__name__
    if kind == "PlainAOTInput":
        idx = getattr(desc, "idx", None)
        if isinstance(idx, int) and 0 <= idx < len(dynamo_names):
            return dynamo_names[idx]
        return None
    target = getattr(desc, "target", None)
    if kind == "ParamAOTInput" and isinstance(target, str):
        return StateName(target, PARAMETER)
    if kind == "BufferAOTInput" and isinstance(target, str):
        return StateName(target, BUFFER)
    return None


def partition_input_names(
    gm: torch.fx.GraphModule, names: Mapping[str, StateName]
) -> dict[str, list[StateName | None]]:
    """``jax_<n>`` -> one entry per placeholder of that submodule: the state name of the
    outer graph's placeholder it takes, or None (an activation, an intermediate)."""
    out: dict[str, list[StateName | None]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        out[str(node.target)] = [
            names.get(a.name) if isinstance(a, torch.fx.Node) and a.op == "placeholder" else None
            for a in node.args
        ]
    return out
