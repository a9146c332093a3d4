"""``dynajax.export``: a torch model as a ``jax.export.Exported`` (serialized StableHLO).

    exported = dynajax.export(model, ids, dynamic_shapes=({0: Dim("batch")},))
    exported.save("gpt2.stablehlo")                      # + gpt2.npz for weights="separate"

How it is built: ``jax_function(model, *example_args, dynamic_shapes=...,
strict=True)`` gives the model as a pure JAX function of its state and inputs (every
op through a JAX rule: an op without one is an error, since a StableHLO program cannot
call PyTorch). ``jax.export.export`` traces it once on abstract inputs whose dynamic
dims are ``jax.export`` symbols (one per ``torch.export`` size symbol, named after the
``Dim``, its ``min``/``max`` carried as symbolic constraints), under JAX's 64-bit mode
so that every dtype is torch's own. The weights are either closed over (constants of
the program) or the program's first argument.

Loading needs only ``jax``, ``numpy`` and ``flatbuffers`` (the serialization format of
``jax.export``): see ``ExportedModel``.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
import sympy
import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from dynajax.capability import Unsupported
from dynajax.errors import CallbackOpsError, ExportError, ExportOpsError, JaxFunctionError
from dynajax.interop.function import JaxFunction, jax_function
from dynajax.interop.trees import jax_tree, jax_values
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.program.interpreter import SizeBindings

Weights = Literal["embedded", "separate"]

# Dtypes an Exported can only take or return with JAX's 64-bit mode on.
_WIDE = frozenset(np.dtype(t) for t in (np.int64, np.uint64, np.float64, np.complex128))

# Words of jax.export's shape grammar, which cannot name a dimension.
_RESERVED = frozenset({"_", "floordiv", "mod", "max", "min", "non_negative"})


@dataclasses.dataclass(frozen=True, eq=False)
class ExportedModel:
    """A torch model exported to a serializable JAX program, and its weights.

    Run it in this process with ``exported_model.call(*args)``, or save it and load it
    anywhere with JAX alone (no torch, no dynajax)::

        exported_model.save("model.stablehlo")   # weights="separate": also model.npz

        import jax, numpy as np
        jax.config.update("jax_enable_x64", True)   # int64 token ids, float64 (see below)
        with open("model.stablehlo", "rb") as f:
            exp = jax.export.deserialize(bytearray(f.read()))
        out = exp.call(ids)                          # weights="embedded"
        state = dict(np.load("model.npz"))           # weights="separate"
        out = exp.call(state, ids)

    **Arguments and outputs.** ``exp.call`` takes the inputs nested as the example
    arguments were (arrays of exactly the exported dtypes: ``exp.in_avals``), preceded
    by the state dict for separate weights, and returns the outputs nested as
    ``jax_function``'s (a ``transformers`` ModelOutput is a dict: ``out["logits"]``).
    Dynamic dims are symbols in ``exp.in_avals`` (``int64[batch,16]``): any size within
    the ``Dim``'s ``min``/``max`` works, each new shape compiled once; a size outside
    them fails the program's own check (a ``ValueError`` whose cause says "Input shapes
    do not match the symbolic shape constraint batch <= 8"). JAX's sizes are at least
    1, so an empty batch cannot be called even where torch allowed it.

    **64-bit types.** The program keeps torch's dtypes exactly (it is exported under
    JAX's 64-bit mode), so a model that takes int64 token ids or has an int64 buffer
    (BatchNorm's ``num_batches_tracked``, in separate weights) needs 64-bit mode on
    where it is called: ``jax.config.update("jax_enable_x64", True)`` before creating
    the arrays, or ``with jax.enable_x64(True):`` around them and the call
    (``needs_x64`` tells; ``call`` does it itself). Without it JAX narrows the int64
    ids to int32 and the call fails: "Dtype mismatch for args[0]: expected int64 and
    called with int32".

    **bfloat16 weights.** ``np.savez`` cannot store bfloat16 (nor float8): it reads
    back as raw bytes. Such state entries are stored, and taken by the program, as
    their bit patterns in the unsigned integer type of the same width (``uint16`` for
    bfloat16), which the program reinterprets; ``dict(np.load(...))`` is therefore
    exactly what ``exp.call`` takes. Read the values with
    ``state[name].view(ml_dtypes.bfloat16)``.

    Attributes:
        exported: the ``jax.export.Exported``: ``in_avals``, ``out_avals``,
            ``serialize()``, ``call(...)``, ``platforms``.
        state: for ``weights="separate"``, the state dict the program takes first
            (every parameter and buffer by torch name, as NumPy arrays, bfloat16 as
            uint16); None when the weights are constants of the program.
        dims: each symbolic dimension's name and its ``(min, max)`` sizes (max None:
            unbounded), as ``torch.export``'s range constraints allow them (JAX sizes
            are at least 1).
    """

    exported: jax.export.Exported
    state: dict[str, np.ndarray] | None
    dims: dict[str, tuple[int, int | None]]

    @property
    def weights(self) -> Weights:
        """``"embedded"`` or ``"separate"``, as ``export`` was asked."""
        return "embedded" if self.state is None else "separate"

    @property
    def needs_x64(self) -> bool:
        """Whether the program takes or returns 64-bit values, so that it must be called
        with JAX's 64-bit mode on."""
        avals = (*self.exported.in_avals, *self.exported.out_avals)
        return any(np.dtype(a.dtype) in _WIDE for a in avals)

    def serialize(self) -> bytes:
        """The program as bytes (``jax.export.deserialize(bytearray(data))`` reads it);
        the weights are in it for ``weights="embedded"`` only."""
        return bytes(self.exported.serialize())

    def save(self, path: str | os.PathLike[str]) -> tuple[Path, ...]:
        """Writes the program to ``path`` and, for separate weights, the state next to
        it (``path`` with the suffix ``.npz``, readable by ``np.load``).

        Returns:
            The paths written: ``(program,)`` or ``(program, weights)``.
        """
        program = Path(path)
        if program.suffix == ".npz":
            raise ExportError(
                f"save({str(path)!r}): the program is not an .npz file (the separate "
                "weights are written next to it with that suffix); use another suffix, "
                "e.g. 'model.stablehlo'."
            )
        program.write_bytes(self.serialize())
        if self.state is None:
            return (program,)
        weights = program.with_suffix(".npz")
        # np.savez's own format, written entry by entry: savez(file, **state) would
        # collide with state entries named like its parameters ("file").
        with zipfile.ZipFile(weights, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, value in self.state.items():
                with archive.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, value, allow_pickle=False)
        return program, weights

    def call(self, *args: Any) -> Any:
        """Runs the program on ``args`` (arrays or tensors, nested as the example
        arguments), with the separate state where there is one, in JAX's 64-bit mode
        where the program needs it."""
        args = jax_values(args)
        if self.state is not None:
            args = (self.state, *args)
        if not self.needs_x64:
            return self.exported.call(*args)
        with jax.enable_x64(True):
            return self.exported.call(*args)

    def __repr__(self) -> str:
        # The state's entries come first in the flat inputs (it is the first argument).
        inputs = self.exported.in_avals[len(self.state or ()) :]
        state = "" if self.state is None else f", state of {len(self.state)} arrays"
        return (
            f"<dynajax.ExportedModel: weights={self.weights}, "
            f"platforms={list(self.exported.platforms)}, inputs "
            f"({', '.join(map(str, inputs))}){state}>"
        )


def export(
    model: nn.Module | Callable[..., Any],
    *example_args: Any,
    dynamic_shapes: Any = None,
    weights: Weights = "embedded",
    platforms: Sequence[str] | None = None,
    passes: Any = None,
    rewrites: Any = (),
) -> ExportedModel:
    """A torch model as a serializable JAX program (StableHLO), which runs without torch.

        exported = dynajax.export(model, ids, dynamic_shapes=({0: Dim("batch")},))
        exported.save("model.stablehlo")
        out = exported.call(ids)          # or, anywhere: jax.export.deserialize(...).call

    Args:
        model: an ``nn.Module`` (exported in its current mode: call ``model.eval()``
            first) or a function of tensors, as for ``jax_function``.
        *example_args: example inputs (tensors or arrays, or tuples/lists/dicts of
            them). Every input must be a tensor: Python values would be constants of
            the program (close over them instead).
        dynamic_shapes: ``torch.export``'s ``dynamic_shapes``: each dim a
            ``torch.export.Dim`` names becomes a ``jax.export`` symbol of that name
            (``int64[batch,16]``), its ``min``/``max`` carried as symbolic constraints
            that the program checks when it is called. Other dims are fixed.
        weights: ``"embedded"``: the parameters and buffers are constants of the
            program, which takes the inputs only; ``"separate"``: the program takes
            the state dict first (``ExportedModel.state``, saved as an ``.npz`` file),
            so one program serves other weights of the same shapes and the program
            file stays small.
        platforms: the platforms the program is lowered for (``("cpu", "cuda")``);
            default: JAX's default backend here.
        passes: the user's graph passes, applied as ``jax_function`` applies them (the
            backend's option of that name).
        rewrites: the user's ``dynajax.Rewrite``s, applied as ``jax_function`` applies
            them (the backend's option of that name).

    Returns:
        An ``ExportedModel``: the ``jax.export.Exported`` (``.exported``), the separate
        state (``.state``) and the symbolic dims (``.dims``); its docstring shows how
        to load and call it with JAX alone.

    Raises:
        ExportOpsError: ops of the model have no JAX rule (each listed with its source
            line): a StableHLO program cannot call PyTorch.
        ExportError: the model draws random numbers or updates buffers (train mode:
            export it in eval mode), takes non-tensor inputs, a JAX rule needs a
            concrete value of a dynamic size, or ``weights`` is unknown.
        JaxFunctionError: the graph has what no JAX function can express (sizes that
            depend on tensor data, dtypes JAX lacks, control flow).
    """
    if weights not in ("embedded", "separate"):
        raise ExportError(f"weights={weights!r}: use 'embedded' or 'separate'.")
    # Torch's dtypes exactly (int64 ids and buffers, float64), in the state too:
    # jax.export traces and lowers inside this call, so the mode applies to both.
    with jax.enable_x64(True):
        try:
            fn, state = jax_function(
                model,
                *example_args,
                dynamic_shapes=dynamic_shapes,
                strict=True,
                passes=passes,
                rewrites=rewrites,
            )
        except CallbackOpsError as e:
            raise ExportOpsError(e.verdicts) from None
        _check_exportable(fn)
        arg_avals, dims = _input_avals(fn.exported_program)
        dtypes = {name: value.dtype for name, value in state.items()}

        def embedded(*args: Any) -> Any:
            return _serializable(fn(state, *args))

        def separate(stored: dict[str, Any], *args: Any) -> Any:
            st = {name: _restored(value, dtypes[name]) for name, value in stored.items()}
            return _serializable(fn(st, *args))

        if weights == "embedded":
            program, stored, avals = embedded, None, arg_avals
        else:
            stored = {name: _storable(value) for name, value in state.items()}
            state_avals = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in stored.items()}
            program, avals = separate, (state_avals, *arg_avals)
        try:
            exported = jax.export.export(
                jax.jit(program), platforms=None if platforms is None else tuple(platforms)
            )(*avals)
        except JaxFunctionError as e:
            raise ExportError(f"dynajax.export: {e}") from e
    return ExportedModel(exported, stored, dims)


def _check_exportable(fn: JaxFunction) -> None:
    if fn.callbacks:  # ops strict mode accepts (they follow another op into PyTorch)
        raise ExportOpsError(
            [Unsupported(c.reason, c.node, c.op, c.detail, c.source_line) for c in fn.callbacks]
        )
    if fn.random_ops:
        raise ExportError(
            f"the model draws random numbers ({', '.join(fn.random_ops)}); an exported "
            "program is deterministic. Export the model in eval mode (model.eval(): "
            "dropout draws nothing), or use dynajax.jax_function, which takes a PRNG key."
        )
    if fn.mutated_buffers:
        raise ExportError(
            f"the model updates buffers in place ({', '.join(fn.mutated_buffers)}), which "
            "an exported program would drop. Export the model in eval mode (model.eval(): "
            "BatchNorm uses its running statistics), or use dynajax.jax_function's "
            "with_state, which returns the new values."
        )


def _input_avals(
    ep: ExportedProgram,
) -> tuple[tuple[Any, ...], dict[str, tuple[int, int | None]]]:
    """The abstract user inputs (``jax.ShapeDtypeStruct``, nested as the example
    arguments), each dynamic dim a ``jax.export`` symbol, and each symbol's bounds."""
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    fakes = [
        node.meta.get("val")
        for node, spec in zip(placeholders, ep.graph_signature.input_specs, strict=True)
        if spec.kind is InputKind.USER_INPUT
    ]
    for position, fake in enumerate(fakes):
        if fake is not None and not isinstance(fake, torch.Tensor):  # None: an empty pytree
            raise ExportError(
                f"input {position} is {fake!r}, not a tensor; an exported program takes "
                "arrays only. Close over Python values (functools.partial, or a module "
                "attribute) so that they are constants of the program."
            )
    symbols: dict[sympy.Symbol, None] = {}  # in order of appearance
    tensors = [fake for fake in fakes if fake is not None]
    for fake in tensors:
        for size in fake.shape:
            if isinstance(size, torch.SymInt):
                symbols.update(dict.fromkeys(sorted(size.node.expr.free_symbols, key=str)))
    names = _dim_names(tensors, list(symbols))
    dims: dict[str, tuple[int, int | None]] = {}
    constraints = []
    for symbol, name in names.items():
        low, high = _bounds(ep, symbol)
        dims[name] = (low, high)
        if low > 1:  # JAX's dims are >= 1 already
            constraints.append(f"{name} >= {low}")
        if high is not None:
            constraints.append(f"{name} <= {high}")
    sizes = SizeBindings()
    if names:
        jax_dims = jax.export.symbolic_shape(", ".join(names.values()), constraints=constraints)
        sizes.values.update(zip(names, jax_dims, strict=True))
    leaves = [
        None
        if fake is None
        else jax.ShapeDtypeStruct(
            tuple(sizes.resolve(s) for s in fake.shape), TORCH_TO_JAX[fake.dtype]
        )
        for fake in fakes
    ]
    args, _ = jax_tree(ep.call_spec.in_spec, iter(leaves))  # a cache as its dict
    return tuple(args), dims


def _bounds(ep: ExportedProgram, symbol: sympy.Symbol) -> tuple[int, int | None]:
    """``(min, max)`` of a size symbol from the export's range constraints (max None:
    unbounded; min at least 1, as JAX's symbolic dims are)."""
    bounds = ep.range_constraints.get(symbol)
    if bounds is None:
        return 1, None
    low = int(bounds.lower) if isinstance(bounds.lower, sympy.Integer) else 1
    high = int(bounds.upper) if isinstance(bounds.upper, sympy.Integer) else None
    return max(low, 1), high


def _dim_names(fakes: list[Any], symbols: list[sympy.Symbol]) -> dict[sympy.Symbol, str]:
    """A ``jax.export`` name for each size symbol: the name of the ``Dim`` the user gave
    it where torch's shape environment recorded one (``batch``), else torch's own
    (``s0``)."""
    shape_env = getattr(getattr(fakes[0], "fake_mode", None), "shape_env", None) if fakes else None
    # torch's record of each symbol's sources ("L['x'].size()[0]") and of the Dim name
    # given to each source; best effort: absent, the symbols keep torch's names.
    sources = getattr(shape_env, "var_to_sources", None) or {}
    dim_names = getattr(shape_env, "source_name_to_debug_name", None) or {}
    names: dict[sympy.Symbol, str] = {}
    for symbol in symbols:
        given = [dim_names.get(getattr(s, "name", None)) for s in sources.get(symbol, ())]
        name = next((g for g in given if isinstance(g, str)), None)
        for candidate in (name, str(symbol)):
            if (
                candidate
                and candidate.isidentifier()
                and candidate.isascii()
                and candidate not in _RESERVED
                and candidate not in names.values()
            ):
                names[symbol] = candidate
                break
        else:
            names[symbol] = f"d{len(names)}_{symbol}"
    return names


def _storable(value: jax.Array) -> np.ndarray:
    """A state entry as ``np.savez`` stores it: dtypes NumPy has no name for (bfloat16,
    float8, which ``np.load`` reads back as raw bytes) as the unsigned integers of the
    same width, bit for bit."""
    array = np.array(value)
    if array.dtype.kind == "V":
        array = array.view(np.dtype(f"uint{8 * array.dtype.itemsize}"))
    return array


def _restored(value: Any, dtype: np.dtype) -> Any:
    """A stored state entry (``_storable``) back in its dtype, inside the program."""
    return value if value.dtype == dtype else jax.lax.bitcast_convert_type(value, dtype)


def _serializable(tree: Any) -> Any:
    """Outputs with containers ``jax.export`` can serialize: namedtuples as tuples."""
    if isinstance(tree, dict):
        return {k: _serializable(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_serializable(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_serializable(v) for v in tree)
    return tree
