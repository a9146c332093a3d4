"""The user's passes and rewrites (the backend's ``passes`` and ``rewrites`` options) in
``jax_function`` and ``export``, at the stages the backend runs them.

* ``rewrites`` and ``pre_aot`` passes change a torch-level graph, as in the backend: the
  model is captured with Dynamo (``torch._dynamo.export``), whose graph calls
  ``torch.matmul`` and ``F.softmax`` the way the user wrote them, so a ``Rewrite``'s
  pattern matches as it does under ``torch.compile``. The changed graph is then the
  module torch.export captures, and the module whose backward ``jax.grad`` runs.
  Its parameters and buffers keep their torch names (Dynamo's mangled names are mapped
  back by identity), so the state dict is the model's.
* ``post_aot`` and ``post_passes`` passes run on the exported ATen graph, before and
  after dynajax's own passes, in the same pass list (``run_passes``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._dynamo
import torch.fx
from torch import nn

from dynajax.errors import JaxFunctionError
from dynajax.passes.pipeline import run_pass_list
from dynajax.passes.user import (
    Rewrite,
    RewriteRecord,
    apply_rewrites,
    normalize_passes,
    normalize_rewrites,
    passes_at,
)


@dataclasses.dataclass(frozen=True)
class UserPasses:
    """The user's ``passes`` (by stage) and ``rewrites``, as the backend's options take
    them."""

    passes: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    rewrites: tuple[Rewrite, ...] = ()

    @classmethod
    def of(cls, passes: Any, rewrites: Any) -> UserPasses:
        """Validates ``passes`` (``{"post_aot": [...], ...}``) and ``rewrites`` (a
        ``Rewrite``, a pattern function's pair, or a list of them) as ``Options`` does."""
        return cls(normalize_passes(passes), normalize_rewrites(rewrites or ()))

    @property
    def torch_level(self) -> bool:
        """Whether any of them changes the torch-level graph."""
        return bool(self.rewrites or passes_at(self.passes, "pre_aot"))

    def at(self, stage: str) -> list[Any]:
        return passes_at(self.passes, stage)


def rewritten(
    source: nn.Module | Callable[..., Any], examples: tuple[Any, ...], user: UserPasses
) -> tuple[nn.Module | Callable[..., Any], list[RewriteRecord]]:
    """``source`` with the user's rewrites and ``pre_aot`` passes applied to its
    torch-level graph (a module with the model's parameter and buffer names), and what
    each rewrite matched; ``source`` itself when there are none."""
    if not user.torch_level:
        return source, []
    try:
        captured, _guards = torch._dynamo.export(source)(*examples)
    except Exception as e:  # Dynamo's own reason: a graph break, an unsupported construct
        raise JaxFunctionError(
            "rewrites and pre_aot passes change the model's torch-level graph, which "
            f"Dynamo could not capture whole ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}). Without them, "
            "post_aot and post_passes passes apply to the exported ATen graph."
        ) from e
    gm = _with_torch_names(captured, source)
    records = apply_rewrites(gm, user.rewrites)
    gm = run_pass_list(gm, user.at("pre_aot"))
    return gm, records


def _with_torch_names(captured: torch.fx.GraphModule, source: Any) -> torch.fx.GraphModule:
    """Dynamo's graph over ``source``'s own parameters and buffers, under their names
    (``0.weight``, not ``L__fn___0_weight``): the same tensors, found by identity."""
    if not isinstance(source, nn.Module):
        return captured
    names: dict[int, str] = {}
    for name, t in itertools.chain(
        source.named_parameters(remove_duplicate=False),
        source.named_buffers(remove_duplicate=False),
    ):
        names.setdefault(id(t), name)
    for node in captured.graph.nodes:
        if node.op == "get_attr":
            value = _attr(captured, node.target)
            if id(value) in names:
                node.target = names[id(value)]
    # The root is the model itself: get_attr targets by torch name resolve there.
    root = _Root(source, captured)
    gm = torch.fx.GraphModule(root, captured.graph, class_name=type(source).__name__)
    gm.train(source.training)
    return gm


class _Root(nn.Module):
    """Attribute lookups for ``GraphModule(root, graph)``: the model's first, then the
    captured graph module's (tensors Dynamo lifted that are not the model's). Neither
    is registered as a submodule, so no name of the model's is shadowed."""

    def __init__(self, model: nn.Module, captured: torch.fx.GraphModule) -> None:
        super().__init__()
        object.__setattr__(self, "_dynajax_owners", (model, captured))

    def __getattr__(self, name: str) -> Any:
        for owner in object.__getattribute__(self, "_dynajax_owners"):
            try:
                return getattr(owner, name)
            except AttributeError:
                continue
        raise AttributeError(name)


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def describe(records: Sequence[RewriteRecord]) -> list[str]:
    """The report's lines for the rewrites that matched."""
    if not records:
        return []
    return ["  rewrites applied:"] + [line for r in records for line in r.lines("    ")]
