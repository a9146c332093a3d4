"""An exported program's calling convention, as ``jax_function`` reads it: which of
its graph's inputs are parameters, buffers, constants and the user's arguments, which
outputs are the user's and which are updates, and how the arguments are flattened."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from dynajax.errors import JaxFunctionError
from dynajax.interop import kv_caches as caches
from dynajax.interop.trees import jax_tree
from dynajax.runtime.conversion import to_jax


@dataclasses.dataclass(frozen=True)
class Input:
    """One placeholder of the graph: where its value comes from when the function runs."""

    kind: InputKind
    name: str  # the state name, constant name, or user input's position
    example: Any  # its fake value (a FakeTensor, or a Python value)


@dataclasses.dataclass
class Signature:
    """The calling convention of one export (``Signature.of``).

    Attributes:
        inputs: each placeholder of the graph, in order: where its value comes from.
        outputs: each output's kind and the state entry or input it updates.
        parameter_names, buffer_names: the state entries, tied tensors once, under the
            name ``named_parameters()`` gives them.
        constants: the lifted tensor constants' values (NumPy copies).
        mutated_buffers: the buffers (and parameters) updated in place.
        user_positions: each user input's placeholder name -> its position among the
            flattened user inputs.
        mutated_inputs: the positions of user inputs updated in place.
        updates_returned: every updated input is also returned (``fn(...)`` then loses
            nothing).
        in_spec, out_spec: torch's pytree specs of the call's arguments and outputs.
        jax_in_spec: the arguments as JAX values (a transformers cache as its dict).
        ranges: the export's range constraints of its symbolic sizes.
    """

    inputs: list[Input]
    outputs: list[tuple[OutputKind, str | None]]
    parameter_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    constants: dict[str, np.ndarray]
    mutated_buffers: tuple[str, ...]
    user_positions: dict[str, int]
    mutated_inputs: tuple[int, ...]
    updates_returned: bool
    in_spec: Any
    out_spec: Any
    jax_in_spec: Any
    ranges: dict[Any, Any]

    @classmethod
    def of(
        cls, ep: ExportedProgram, gm: torch.fx.GraphModule, aliases: Mapping[str, str]
    ) -> Signature:
        """``ep``'s convention over ``gm`` (its graph after the driver's passes), tied
        tensors under the names ``aliases`` maps them to."""
        sig = ep.graph_signature
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(sig.input_specs):
            raise JaxFunctionError(
                f"the exported graph has {len(placeholders)} inputs but its signature "
                f"lists {len(sig.input_specs)}; please report this dynajax bug."
            )
        inputs: list[Input] = []
        user = 0
        for node, spec in zip(placeholders, sig.input_specs, strict=True):
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                assert spec.target is not None
                name = aliases.get(spec.target, spec.target)
            elif spec.kind is InputKind.CONSTANT_TENSOR:
                assert spec.target is not None
                name = spec.target
            elif spec.kind is InputKind.USER_INPUT:
                name, user = str(user), user + 1
            else:
                raise JaxFunctionError(
                    f"the exported graph takes a {spec.kind.name} input ('{node.name}'); "
                    "jax_function supports models whose inputs are parameters, buffers, "
                    "tensor constants and tensors (no script objects or effect tokens)."
                )
            inputs.append(Input(spec.kind, name, node.meta.get("val")))
        # Tied tensors (GPT-2's lm_head.weight is transformer.wte.weight) are one entry.
        parameter_names = tuple(
            dict.fromkeys(i.name for i in inputs if i.kind is InputKind.PARAMETER)
        )
        buffer_names = tuple(dict.fromkeys(i.name for i in inputs if i.kind is InputKind.BUFFER))
        constants = {
            i.name: constant_array(ep, i.name)
            for i in inputs
            if i.kind is InputKind.CONSTANT_TENSOR
        }
        outputs: list[tuple[OutputKind, str | None]] = []
        for spec in sig.output_specs:
            if spec.kind not in (
                OutputKind.USER_OUTPUT,
                OutputKind.BUFFER_MUTATION,
                OutputKind.PARAMETER_MUTATION,
                OutputKind.USER_INPUT_MUTATION,
            ):
                raise JaxFunctionError(
                    f"the exported graph returns a {spec.kind.name} output; jax_function "
                    "supports user outputs and buffer updates only."
                )
            outputs.append((spec.kind, spec.target))
        outputs = [(k, aliases.get(t, t) if t is not None else None) for k, t in outputs]
        mutated_buffers = tuple(
            t
            for k, t in outputs
            if k in (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION) and t
        )
        user_input_names = [s.arg.name for s in sig.input_specs if s.kind is InputKind.USER_INPUT]
        # The user inputs' placeholder names, by position among the flattened inputs.
        user_positions = {name: i for i, name in enumerate(user_input_names)}
        mutated_inputs = tuple(
            user_positions[t]
            for k, t in outputs
            if k is OutputKind.USER_INPUT_MUTATION and t in user_positions
        )
        # Whether every new value of an input is also an output (a transformers
        # StaticCache, updated in place and returned): fn(...) then loses nothing.
        updated = {s.arg.name for s in sig.output_specs if s.kind is OutputKind.USER_INPUT_MUTATION}
        returned = {s.arg.name for s in sig.output_specs if s.kind is OutputKind.USER_OUTPUT}
        updates_returned = updated <= returned
        in_spec = ep.call_spec.in_spec
        out_spec = ep.call_spec.out_spec
        # The arguments as JAX values: a transformers cache as its dict (interop/kv_caches.py).
        jax_in_spec = caches.jax_spec(in_spec, jax_tree)
        ranges = dict(ep.range_constraints)
        return cls(
            inputs,
            outputs,
            parameter_names,
            buffer_names,
            constants,
            mutated_buffers,
            user_positions,
            mutated_inputs,
            updates_returned,
            in_spec,
            out_spec,
            jax_in_spec,
            ranges,
        )


def constant_array(ep: ExportedProgram, name: str) -> np.ndarray:
    """A lifted tensor constant as a NumPy copy, made once; each trace embeds it in the
    caller's JAX mode."""
    value = ep.constants[name]
    if not isinstance(value, torch.Tensor):
        raise JaxFunctionError(
            f"the model's constant '{name}' is a {type(value).__name__}, not a tensor; "
            "jax_function supports tensor constants only."
        )
    return np.array(to_jax(value.detach().cpu()))
