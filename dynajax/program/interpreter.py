"""Runs a whole exported ATen graph as one JAX function.

``JaxInterpreter`` (``dynajax/lowering/interpreter.py``) lowers the nodes of a JAX
partition through the lowering table. A ``jax_function`` has no partitions: every node
of the exported graph runs in the one JAX function, so this subclass also takes the
nodes the capability stage kept out of JAX:

    verdict Supported                 -> the node's JAX rule (JaxInterpreter)
    HOST_SCALAR (sym_size, operator.*,
      _assert_scalar, ...)            -> evaluated while tracing, from the traced shapes
    any other Unsupported             -> eager PyTorch through a host callback
                                         (program/callbacks.py)

Sizes are read from the arrays being traced (``x.shape[d]``), never from the hints
torch.export recorded, so one graph serves every shape its dynamic dims allow: under
``jax.jit`` each new shape is a new trace. Size arithmetic stays Python arithmetic on
those values, which ``jax.export`` sees as symbolic dimension expressions
(``dynajax.export``); a rule that fails on them raises ``JaxFunctionError`` naming its
op and source line.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree

from dynajax.capability import META_KEY, Reason, Unsupported
from dynajax.capability.eager_kernel import eager_refusal
from dynajax.capability.verdict import source_line
from dynajax.errors import DynajaxError, JaxFunctionError
from dynajax.lowering import checks as value_checks
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.lowering.interpreter import JaxInterpreter
from dynajax.lowering.registry import KERNEL_KEY
from dynajax.program.callbacks import call_on_host, flat_outputs
from dynajax.runtime.conversion import to_jax

aten = torch.ops.aten

# Host-scalar ops that check or constrain sizes and compute nothing a later node reads:
# torch.export's own assertions. The shapes they check were checked on entry
# (against the export's range constraints) or are the JAX values' own.
_ASSERTIONS = frozenset(
    {
        aten._assert_tensor_metadata.default,
        aten.sym_constrain_range.default,
        aten.sym_constrain_range_for_size.default,
    }
)

# torch's symbolic-size helpers, as the Python functions they are on plain ints.
_SYM_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    torch.sym_max: max,
    torch.sym_min: min,
    torch.sym_not: operator.not_,
    torch.sym_float: float,
    torch.sym_int: int,
    torch.sym_ite: lambda c, a, b: a if c else b,
}


# JAX's warning when a 64-bit dtype is asked for with its 64-bit mode off: a rule asks
# for int64/float64 by name, and with that mode off JAX gives 32 bits, which is
# jax_function's documented behaviour in that mode.
TRUNCATION_WARNING = "Explicitly requested dtype"


class SizeBindings:
    """The value of each export-time size symbol (``s0``) in the current trace.

    Bound from the shapes of the graph's user inputs (``bind``); ``resolve`` evaluates
    a symbolic size of any node from them.
    """

    def __init__(self) -> None:
        self.values: dict[sympy.Symbol, Any] = {}

    def bind(self, symbol: sympy.Symbol, value: Any, where: str) -> None:
        """Binds ``symbol`` to ``value`` (a traced size), checking a second binding."""
        old = self.values.setdefault(symbol, value)
        if old is not value and _is_int(old) and _is_int(value) and old != value:
            raise JaxFunctionError(
                f"{where} has size {value}, but another input with the same dynamic "
                f"dimension ({symbol}) has size {old}; these sizes must be equal, as they "
                "were when the model was exported."
            )

    def resolve(self, size: Any) -> Any:
        """``size`` (an int or a SymInt of the graph) in the current trace."""
        if isinstance(size, torch.SymInt | torch.SymBool | torch.SymFloat):
            return self.evaluate(size.node.expr)
        return size

    @property
    def symbolic(self) -> bool:
        """Whether some bound size is symbolic (a ``jax.export`` dimension variable)."""
        return any(jax.export.is_symbolic_dim(v) for v in self.values.values())

    def evaluate(self, expr: Any) -> Any:
        """A sympy expression in the bound symbols, as a Python value.

        Concrete bindings (``jax.jit``) substitute and simplify; symbolic ones
        (``jax.export`` dimension variables) are combined by arithmetic instead.
        """
        expr = sympy.sympify(expr)
        free = expr.free_symbols
        missing = [s for s in free if s not in self.values]
        if missing:
            raise JaxFunctionError(
                f"size {expr} depends on {sorted(map(str, missing))}, which no input "
                "shape determines; please report this dynajax bug."
            )
        if all(_is_int(self.values[s]) for s in free):
            value = expr.xreplace({s: sympy.Integer(int(self.values[s])) for s in free})
            if value.is_Boolean:
                return bool(value)
            return int(value) if value.is_integer else float(value)
        return _arithmetic(expr, self.values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _arithmetic(expr: Any, values: Mapping[sympy.Symbol, Any]) -> Any:
    """Sums, products and integer divisions of bound sizes, by Python arithmetic."""
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return values[expr]
    parts = [_arithmetic(a, values) for a in expr.args]
    if isinstance(expr, sympy.Add):
        return sum(parts[1:], parts[0])
    if isinstance(expr, sympy.Mul):
        return math.prod(parts[1:], start=parts[0])
    name = type(expr).__name__
    if name == "FloorDiv":
        return parts[0] // parts[1]
    if name in ("Mod", "PythonMod"):
        return parts[0] % parts[1]
    if isinstance(expr, sympy.Pow) and isinstance(expr.exp, sympy.Integer) and expr.exp > 0:
        return parts[0] ** int(expr.exp)
    raise JaxFunctionError(
        f"cannot compute the size {expr} from symbolic input sizes; call the function "
        "on concrete shapes (jax.jit), or report this case."
    )


class ExportInterpreter(JaxInterpreter):
    """Runs every node of an exported ATen graph on JAX values.

    Args:
        gm: the graph, annotated by ``CapabilityChecker``.
        key: the JAX PRNG key random rules draw from (None when none draws).
        sizes: the size symbols bound from the traced input shapes.
        constants: the arrays of the graph's ``get_attr`` nodes (``graph_constants``:
            tensors a traced function closes over, which ``make_fx`` keeps as
            attributes).
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        key: jax.Array | None,
        sizes: SizeBindings,
        constants: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(gm, key)
        self.sizes = sizes
        self.constants = constants or {}
        # Called with each node and its value; what it returns is the node's value
        # (``driver.run_graph`` selects outputs where eager's checks failed).
        self.after_node: Callable[[torch.fx.Node, Any], Any] | None = None

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.constants[target]

    def run_node(self, n: torch.fx.Node) -> Any:
        """The node's value; a rule failing on symbolic sizes (under ``jax.export``)
        raises ``JaxFunctionError`` naming the op and its source line."""
        try:
            value = self._run_node(n)
        except DynajaxError:
            raise
        except Exception as e:
            if not self.sizes.symbolic:
                raise
            raise _symbolic_size_error(n, e) from e
        return value if self.after_node is None else self.after_node(n, value)

    def _run_node(self, n: torch.fx.Node) -> Any:
        verdict = n.meta.get(META_KEY)
        if n.op != "call_function" or not isinstance(verdict, Unsupported):
            return super().run_node(n)
        self._node = n
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.target is operator.getitem:  # an output of a callback or host-scalar node
            return args[0][args[1]]
        if verdict.reason is Reason.HOST_SCALAR:
            return self.host_scalar(n, args, kwargs)
        if verdict.reason is Reason.EAGER_REFUSES:
            # Eager's kernel refuses these dtypes whatever the values (an empty tensor
            # too, where a host callback would never run): eager's error, now.
            refusal = eager_refusal(n.target, n.args, n.kwargs, n.meta.get("val"))
            if refusal is not None:
                raise _eager_exception(refusal)
        structure = n.meta.get("val")
        avals = [
            jax.ShapeDtypeStruct(
                tuple(self.sizes.resolve(s) for s in t.shape),
                jax.dtypes.canonicalize_dtype(TORCH_TO_JAX[t.dtype]),
            )
            for t in flat_outputs(structure)
        ]
        arg_nodes, _ = pytree.tree_flatten((list(n.args), dict(n.kwargs)))

        def dtypes(positions: list[int]) -> list[torch.dtype | None]:
            # The fake tensor of the node argument at each position of a JAX operand.
            vals = [arg_nodes[i].meta.get("val") if i < len(arg_nodes) else None for i in positions]
            return [v.dtype if isinstance(v, torch.Tensor) else None for v in vals]

        assert callable(n.target)  # a call_function node
        kernel = bool(n.meta.get(KERNEL_KEY))  # PyTorch's kernel inside XLA (driver._in_kernel)
        result, _ = call_on_host(
            n.target, verdict.target, args, kwargs, structure, avals, dtypes, kernel
        )
        return result

    def host_scalar(self, n: torch.fx.Node, args: Any, kwargs: Any) -> Any:
        """A size, a Python scalar or an assertion, computed while tracing."""
        target = n.target
        if target is aten.sym_size.int:
            return args[0].shape[args[1]]
        if target is aten.sym_numel.default:
            return math.prod(args[0].shape)
        if target in (aten.sym_stride.int, aten.sym_storage_offset.default):
            # eager's strides, from the fake tensor's expression in the traced sizes
            return self.sizes.resolve(n.meta["val"])
        if target is aten._assert_scalar.default:
            condition = args[0]
            if isinstance(condition, bool) and not condition:
                message = args[1] if len(args) > 1 else kwargs.get("assert_msg", "")
                raise JaxFunctionError(
                    f"the traced shapes break a condition of the exported graph: {message}. "
                    "Export the model with dynamic_shapes that allow these sizes."
                )
            return None
        if target in _ASSERTIONS:
            return None
        if target in (aten._assert_async.msg, aten._assert_async.default):
            # A check on tensor values (one_hot's "Class values must be non-negative."):
            # recorded like the rules' value checks, raised with eager's error by a
            # direct call or fn.checked (lowering/checks.py).
            message = args[1] if len(args) > 1 else "Expected Tensor with single nonzero value"
            text = str(message).replace("{", "{{").replace("}", "}}")
            value_checks.fail_if(jnp.logical_not(args[0]), RuntimeError, text)
            return None
        if target in _SYM_FUNCTIONS:
            return _SYM_FUNCTIONS[target](*args, **kwargs)
        if callable(target) and not any(isinstance(a, jax.Array) for a in args):
            return target(*args, **kwargs)  # operator.*, math.* on Python scalars
        raise JaxFunctionError(
            f"node '{n.name}' ({_verdict_text(n)}) computes a host scalar from a tensor; a JAX "
            "function cannot read tensor values while tracing."
        )


def _eager_exception(text: str) -> Exception:
    """``"NotImplementedError: message"`` (``eager_refusal``'s form) as that exception."""
    name, _, message = text.partition(": ")
    kind = getattr(builtins, name, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        return RuntimeError(text)
    return kind(message)


def graph_constants(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """Each tensor attribute a ``get_attr`` node of ``gm`` reads, as an array."""
    return {
        n.target: jnp.asarray(to_jax(getattr(gm, n.target)))
        for n in gm.graph.nodes
        if n.op == "get_attr"
    }


def _symbolic_size_error(n: torch.fx.Node, e: Exception) -> JaxFunctionError:
    """The error of a node that failed while the traced sizes were symbolic: rules are
    checked on concrete shapes, so the likely cause is a rule that needs a concrete size
    (one it compares, or converts with ``int``)."""
    verdict = n.meta.get(META_KEY)
    op = verdict.target if verdict is not None else str(n.target)
    where = source_line(n)
    first = str(e).splitlines()[0] if str(e) else ""
    return JaxFunctionError(
        f"{op} (node '{n.name}'){f' [{where}]' if where else ''} failed on symbolic "
        f"sizes (jax.export shape polymorphism): {type(e).__name__}: {first}\n"
        "Its JAX rule needs a concrete value of a size that varies here. Keep that "
        "dimension static (leave it out of dynamic_shapes), or bound it "
        "(torch.export.Dim(..., min=..., max=...)) where the rule only needs to compare "
        "it; or report the op, so that its rule learns symbolic sizes."
    )


def _verdict_text(n: torch.fx.Node) -> str:
    verdict = n.meta.get(META_KEY)
    return verdict.describe() if isinstance(verdict, Unsupported) else str(n.target)
