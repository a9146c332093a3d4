"""An exported program's calling convention, as ``jax_function`` reads it: which of
its graph's inputs are parameters, buffers, constants and the user's arguments, which
outputs are the user's and which are updates, and how the arguments are flattened."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from dynajax.errors import JaxFunctionError
from dynajax.interop import kv_caches as caches
from dynajax.interop.trees import jax_tree
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.program.interpreter import SizeBindings
from dynajax.runtime.conversion import to_jax
from dynajax.sharding.placement import gather_to_torch


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

    def values(
        self, state: Mapping[str, Any], leaves: Sequence[Any]
    ) -> tuple[list[Any], SizeBindings]:
        """The graph's inputs, in order, from the state dict and the flattened arguments
        (``leaves``), each checked against the export (dtype, rank, static sizes, the
        ranges of dynamic ones), and the sizes its dynamic dimensions take."""
        sizes = SizeBindings()
        values = []
        for inp in self.inputs:
            if inp.kind is InputKind.CONSTANT_TENSOR:
                values.append(jnp.asarray(self.constants[inp.name]))
            elif inp.kind is InputKind.USER_INPUT:
                position = int(inp.name)
                values.append(self._user_input(position, leaves[position], inp.example, sizes))
            else:
                values.append(as_array(state[inp.name], inp.example, f"state['{inp.name}']"))
        self._check_ranges(sizes)
        return values, sizes

    def decode(
        self, results: Sequence[Any], leaves: Sequence[Any], spec: Any
    ) -> tuple[Any, dict[str, Any], tuple[Any, ...]]:
        """The graph's outputs as the call returns them: the user's outputs (nested as
        torch's), the new values of the buffers (and parameters) it updates, and the
        arguments (unflattened by ``spec``) with the inputs it updates replaced."""
        user_outputs, updates = [], {}
        new_leaves = list(leaves)
        for (kind, target), value in zip(self.outputs, results, strict=True):
            if kind is OutputKind.USER_OUTPUT:
                user_outputs.append(value)
            elif kind in (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION):
                assert target is not None
                updates[target] = value
            elif kind is OutputKind.USER_INPUT_MUTATION:
                assert target is not None
                new_leaves[self.user_positions[target]] = value
        new_args, _ = pytree.tree_unflatten(new_leaves, spec)
        return jax_tree(self.out_spec, iter(user_outputs)), updates, tuple(new_args)

    def static_sizes_match(self, leaves: Sequence[Any]) -> bool:
        """Whether every argument has the export's rank and static sizes (else the model
        is exported again at the new sizes)."""
        for inp in self.inputs:
            if inp.kind is not InputKind.USER_INPUT or not isinstance(inp.example, torch.Tensor):
                continue
            shape = tuple(np.shape(leaves[int(inp.name)]))
            static = [s if isinstance(s, int) else None for s in inp.example.shape]
            if len(shape) != len(static) or any(
                want is not None and got != want for got, want in zip(shape, static, strict=True)
            ):
                return False
        return True

    def check_state_keys(self, state: Mapping[str, Any]) -> None:
        """Refuses a state dict without exactly the model's parameters and buffers."""
        names = set(self.parameter_names) | set(self.buffer_names)
        missing = sorted(names - set(state))
        extra = sorted(set(state) - names)
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
            if extra:
                parts.append(f"unknown {extra[:8]}{' ...' if len(extra) > 8 else ''}")
            raise JaxFunctionError(
                "the state must have exactly the model's parameters and buffers by torch "
                f"name (the dict jax_function returned): {'; '.join(parts)}."
            )

    def _user_input(self, position: int, value: Any, example: Any, sizes: SizeBindings) -> Any:
        where = f"input {position}"
        if not isinstance(example, torch.Tensor):
            # Python values are specialized by torch.export: they must not change.
            if value != example:
                raise JaxFunctionError(
                    f"{where} was {example!r} when the model was exported, and its value is "
                    f"part of the graph; got {value!r}. Export again for another value."
                )
            return value
        if isinstance(value, torch.Tensor):
            value = to_jax(value)
        array = as_array(value, example, where, static_only=True)
        for dim, (size, want) in enumerate(zip(array.shape, example.shape, strict=True)):
            if isinstance(want, torch.SymInt) and isinstance(want.node.expr, sympy.Symbol):
                sizes.bind(want.node.expr, size, f"dim {dim} of {where}")
        return array

    def _check_ranges(self, sizes: SizeBindings) -> None:
        for symbol, value in sizes.values.items():
            bounds = self.ranges.get(symbol)
            if bounds is None or not isinstance(value, int):
                continue
            low, high = bounds.lower, bounds.upper
            size = sympy.Integer(value)
            if bool(size < low) or bool(size > high):  # bounds may be (int_)oo
                raise JaxFunctionError(
                    f"a dynamic dimension ({symbol}) has size {value}, outside the range "
                    f"[{low}, {high}] torch.export allowed for it. Export with "
                    "dynamic_shapes whose Dim(min=..., max=...) include this size."
                )

    def load_into(self, model: torch.nn.Module, state: Mapping[str, Any], *, copy: bool) -> None:
        """``JaxFunction.load_into``: ``state`` written into ``model``'s parameters and
        buffers, each entry checked first (nothing written where one does not fit)."""
        self.check_state_keys(state)
        targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        targets.update(model.named_buffers(remove_duplicate=False))
        problems = []
        for name, value in state.items():
            t = targets.get(name)
            if t is None:
                problems.append(f"'{name}': the module has no such parameter or buffer")
            elif tuple(t.shape) != tuple(np.shape(value)):
                problems.append(
                    f"'{name}': {tuple(np.shape(value))} here, {tuple(t.shape)} in the module"
                )
            elif not _fits(t.dtype, np.dtype(value.dtype)):
                problems.append(f"'{name}': {value.dtype} here, {t.dtype} in the module")
        if problems:
            raise JaxFunctionError(
                "the state does not fit this module; nothing was written:\n"
                + "\n".join(f"  - {p}" for p in problems[:10])
            )
        with torch.no_grad():
            for name, value in state.items():
                t = targets[name]
                tensor = gather_to_torch(value)
                if tensor.dtype != t.dtype:
                    tensor = tensor.to(t.dtype)  # made with JAX's 64-bit mode off
                if copy or tensor.device != t.device or tensor.dtype != t.dtype:
                    t.copy_(tensor)
                else:
                    t.data = tensor


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


def _jax_dtype(t: torch.Tensor) -> np.dtype:
    """The JAX dtype of a torch tensor in the caller's JAX mode (int64 is int32 when
    JAX's 64-bit mode is off)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(TORCH_TO_JAX[t.dtype]))


# The dtype a 64-bit value has when it was made with JAX's 64-bit mode off; the function
# casts such inputs back up when it runs with 64-bit mode on.
NARROWED = {
    np.dtype(np.int64): np.dtype(np.int32),
    np.dtype(np.uint64): np.dtype(np.uint32),
    np.dtype(np.float64): np.dtype(np.float32),
    np.dtype(np.complex128): np.dtype(np.complex64),
}


def as_array(value: Any, example: Any, where: str, *, static_only: bool = False) -> Any:
    """``value`` as a JAX value of ``example``'s dtype and shape (dynamic dims free)."""
    if not isinstance(value, jax.Array):
        try:
            value = jnp.asarray(value)
        except TypeError as e:
            raise JaxFunctionError(
                f"{where} must be an array, got {type(value).__name__}: {e}"
            ) from e
    want = _jax_dtype(example)
    if value.dtype != want:
        if NARROWED.get(want) == value.dtype:
            value = value.astype(want)  # made with 64-bit mode off, run with it on
        else:
            raise JaxFunctionError(
                f"{where} has dtype {value.dtype}; the model was exported with {want}. "
                f"Convert it (x.astype(jnp.{want.name}))."
            )
    if len(value.shape) != example.dim():
        raise JaxFunctionError(
            f"{where} has shape {tuple(value.shape)}; the model was exported with "
            f"{example.dim()} dims ({tuple(example.shape)})."
        )
    for dim, (got, want_size) in enumerate(zip(value.shape, example.shape, strict=True)):
        if isinstance(want_size, int) and got != want_size:
            dynamic = " (pass dynamic_shapes to jax_function to let it vary)" if static_only else ""
            raise JaxFunctionError(
                f"dim {dim} of {where} has size {got}; the model was exported with the "
                f"static size {want_size}{dynamic}."
            )
    return value


def _fits(dtype: torch.dtype, array_dtype: np.dtype) -> bool:
    """Whether an array of ``array_dtype`` holds a tensor of ``dtype`` (a 64-bit one as
    32 bits when made with JAX's 64-bit mode off)."""
    want = TORCH_TO_JAX.get(dtype)
    return want is not None and (want == array_dtype or NARROWED.get(want) == array_dtype)
