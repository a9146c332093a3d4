"""Host callbacks: ops without a JAX rule, run by eager PyTorch inside a JAX function.

A node of an exported graph that no JAX rule can take (no rule, or the rule refuses its
arguments) still has to give eager's answer inside ``jax.jit``, ``jax.vmap`` and
``jax.grad``. It becomes a ``jax.pure_callback`` that calls the op itself on torch
tensors viewing the callback's NumPy buffers (no copy on CPU):

    forward:   pure_callback(op on torch tensors)           shapes from node.meta["val"]
    backward:  pure_callback(torch.autograd.grad of the op)  (a jax.custom_vjp)

* Shapes and dtypes of the results come from the node's fake tensor, its symbolic sizes
  resolved against the shapes of the arrays being traced (``resolve``).
* ``vmap_method="sequential"``: under ``jax.vmap`` the op runs once per batch element,
  which is always right (the op never sees a batch dimension it was not written for).
* Where the op takes and returns floating-point tensors, it is a ``jax.custom_vjp``
  whose backward recomputes the op on the host with autograd on and returns
  ``torch.autograd.grad`` of it; the residuals are the op's inputs (nothing of torch's
  graph survives between the two callbacks). Integer and boolean inputs get no
  cotangent; outputs that do not depend on an input give it zeros. Forward mode through
  it (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``: the Hessian's forward mode runs
  over the forward's values too) raises ``JaxFunctionError`` naming the op: torch's
  autograd on the host gives VJPs only, and JAX has no forward mode for a custom VJP.

Each call crosses from XLA to Python and back, so a callback costs microseconds to
tens of microseconds per call more than a rule would (``benchmarks/interop.py``), and a
program with callbacks cannot be serialized by ``jax.export``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as pytree

from dynajax import ffi
from dynajax.capability import Reason, Unsupported
from dynajax.errors import DynajaxError, JaxFunctionError
from dynajax.ffi import flat_outputs, rebuild_outputs
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.runtime.conversion import quiet_readonly_warning, to_jax

_BF16 = np.dtype(TORCH_TO_JAX[torch.bfloat16])

# The last exception an op raised in eager PyTorch inside a host callback: XLA reports
# it as a JaxRuntimeError, and a direct call of a JAX function re-raises the original
# (eager's exception type and message), as eager would.
_RAISED: list[BaseException] = []

# Forward mode's tracer (a public module of JAX's; None if a release drops it): with
# direct linearization (JAX's default) reverse mode traces with other tracers, so a value
# that is one is being differentiated in forward mode.
_JVP_TRACER = getattr(getattr(jax.interpreters, "ad", None), "JVPTracer", None)


def in_forward_mode(value: Any) -> bool:
    """Whether ``value`` is being differentiated in forward mode (``jax.jvp``,
    ``jax.jacfwd``, under ``jax.jit`` and ``jax.vmap`` too); False when unknown."""
    return (
        _JVP_TRACER is not None
        and isinstance(value, _JVP_TRACER)
        and bool(getattr(jax.config, "jax_use_direct_linearize", True))
    )


@contextlib.contextmanager
def eager_errors() -> Iterator[None]:
    """Runs a program whose host callbacks may raise (every caller of one: a
    ``jax_function``'s call, a ``train_step``): an exception an op raised in eager
    PyTorch leaves the block as eager gives it, its own type and message, not as XLA's
    ``JaxRuntimeError`` wrapping it. (Under an eager transformation, ``jax.vjp`` without
    ``jit``, the op runs inside the block too; under ``jit``, callbacks run after
    tracing, at the program's run.)"""
    _RAISED.clear()
    try:
        yield
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        # (XLA's error is a ValueError where a jitted function's C++ fast path ran it)
        if _RAISED:
            raise _RAISED[-1] from e
        eager = ffi.eager_error(e)  # raised by PyTorch's kernel inside XLA
        if eager is None:
            raise
        raise eager from e


@dataclasses.dataclass(frozen=True)
class CallbackOp:
    """One node of a JAX function that runs in eager PyTorch through a host callback.

    Attributes:
        op: the operator, e.g. ``aten.fake_quantize_per_tensor_affine_cachemask.default``.
        node: the FX node's name in the exported graph.
        reason: why no JAX rule takes it (``Reason.NO_LOWERING``, ``CHECK_REFUSED``...).
        detail: the specifics of the reason (a rule's refusal message).
        source_line: ``file:line (code)`` of the model code that produced the node.
        differentiable: whether gradients flow through it (it takes and returns
            floating-point tensors; its backward is a second callback running
            ``torch.autograd.grad``).
        kernel: its forward runs PyTorch's kernel inside the XLA program (``ffi``: a
            custom call, no Python), not a Python host callback.
    """

    op: str
    node: str
    reason: Reason
    detail: str = ""
    source_line: str = ""
    differentiable: bool = False
    kernel: bool = False

    @classmethod
    def from_verdict(
        cls, verdict: Unsupported, differentiable: bool, kernel: bool = False
    ) -> CallbackOp:
        return cls(
            verdict.target,
            verdict.node,
            verdict.reason,
            verdict.detail,
            verdict.source_line,
            differentiable,
            kernel,
        )

    def describe(self) -> str:
        """``aten.x.default (node 'x'): NO_LOWERING, differentiable [file:line (code)]``."""
        detail = f": {self.detail}" if self.detail else ""
        grad = ", differentiable" if self.differentiable else ", no gradient"
        how = ", PyTorch's kernel inside XLA" if self.kernel else ", a Python host callback"
        where = f" [{self.source_line}]" if self.source_line else ""
        return f"{self.op} (node '{self.node}'): {self.reason.name}{detail}{grad}{how}{where}"


def is_jax_value(value: Any) -> bool:
    """A JAX array or tracer (or a NumPy array standing for one)."""
    return isinstance(value, jax.Array | np.ndarray)


def _inexact(dtype: Any) -> bool:
    return bool(np.issubdtype(np.dtype(dtype), np.inexact))


def from_numpy(array: Any) -> torch.Tensor:
    """A torch tensor viewing the callback's NumPy buffer (no copy)."""
    array = np.asarray(array)
    if array.dtype == _BF16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _to_numpy(t: Any, aval: jax.ShapeDtypeStruct, op: str) -> np.ndarray:
    """An op's output as the NumPy array the callback returns, checked against what the
    fake tensor promised (JAX would otherwise fail with a less helpful message)."""
    if not isinstance(t, torch.Tensor):
        raise DynajaxError(
            f"{op} returned {type(t).__name__} in eager PyTorch where its fake tensor "
            "promised a tensor; please report this dynajax bug."
        )
    t = t.detach()
    if tuple(t.shape) != tuple(aval.shape):
        raise DynajaxError(
            f"{op} returned shape {tuple(t.shape)} in eager PyTorch where its fake tensor "
            f"promised {tuple(aval.shape)}: its output shape depends on the data, which a "
            "JAX function cannot have."
        )
    if t.device.type != "cpu":
        t = t.cpu()
    if TORCH_TO_JAX.get(t.dtype) != np.dtype(aval.dtype):
        t = t.to(_torch_dtype(aval.dtype))
    out = to_jax(t.contiguous())
    return np.asarray(out)


def _torch_dtype(dtype: Any) -> torch.dtype:
    for torch_dtype, np_dtype in TORCH_TO_JAX.items():
        if np_dtype == np.dtype(dtype):
            return torch_dtype
    raise DynajaxError(f"no torch dtype for {dtype}")


@dataclasses.dataclass
class HostCall:
    """One call of an op on the host: which leaves of its arguments are JAX values.

    Attributes:
        target: the op (an ``OpOverload`` or any callable of the graph).
        name: the op's name, for error messages.
        leaves: the flattened ``(args, kwargs)``; JAX values at ``positions``.
        spec: their torch pytree spec.
        positions: where the JAX values (the callback's operands) are among ``leaves``.
        structure: the node's fake output (its nesting and Nones).
        avals: the shape and dtype of each output tensor, in ``flat_outputs`` order.
        operand_avals: the shape and dtype of each JAX operand.
        operand_dtypes: the torch dtype the op takes for each operand (None: as it
            comes); with JAX's 64-bit mode off, an int64 index arrives as int32.
    """

    target: Callable[..., Any]
    name: str
    leaves: list[Any]
    spec: pytree.TreeSpec
    positions: list[int]
    structure: Any
    avals: list[jax.ShapeDtypeStruct]
    operand_avals: list[jax.ShapeDtypeStruct]
    operand_dtypes: list[torch.dtype | None]

    def tensors(self, arrays: Sequence[Any]) -> list[torch.Tensor]:
        """The callback's operands as torch tensors of the dtypes the op takes."""
        out = []
        for a, dtype in zip(arrays, self.operand_dtypes, strict=True):
            t = from_numpy(a)
            out.append(t if dtype is None or t.dtype == dtype else t.to(dtype))
        return out

    def arguments(self, values: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
        """The op's ``(args, kwargs)`` with ``values`` in its operands' places."""
        filled = list(self.leaves)
        for i, t in zip(self.positions, values, strict=True):
            filled[i] = t
        args, kwargs = pytree.tree_unflatten(filled, self.spec)
        return args, kwargs

    def run(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The op on ``tensors`` (its JAX operands, as torch tensors): its flat outputs."""
        args, kwargs = self.arguments(tensors)
        return flat_outputs(self.target(*args, **kwargs))

    def in_kernel(self, *arrays: Any) -> tuple[Any, ...]:
        """The op by PyTorch's kernel inside the program (``ffi``), on its JAX operands."""
        assert isinstance(self.target, torch._ops.OpOverload)
        args, kwargs = self.arguments(arrays)
        wanted = dict(zip(map(id, arrays), self.operand_dtypes, strict=True))
        return ffi.call_kernel(
            self.target,
            args,
            kwargs,
            self.avals,
            [t.dtype for t in flat_outputs(self.structure)],
            lambda operands: [wanted.get(id(x)) for x in operands],
        )

    def forward(self, *arrays: Any) -> tuple[np.ndarray, ...]:
        """The host side of the forward callback."""
        try:
            with torch.no_grad():
                outs = self.run(self.tensors(arrays))
        except Exception as e:
            _RAISED[:] = [e]
            raise
        return tuple(_to_numpy(o, a, self.name) for o, a in zip(outs, self.avals, strict=True))

    def backward(
        self, inputs: list[int], outputs: list[int], *arrays: Any
    ) -> tuple[np.ndarray, ...]:
        """The host side of the backward callback: ``arrays`` are the operands, then the
        cotangents of the floating-point outputs ``outputs``; returns the gradients of
        the floating-point operands ``inputs``."""
        n = len(self.positions)
        tensors = self.tensors(arrays[:n])
        cotangents = [from_numpy(c) for c in arrays[n:]]
        wrt = []
        for i in inputs:
            tensors[i] = tensors[i].detach().clone().requires_grad_(True)
            wrt.append(tensors[i])
        with torch.enable_grad():
            outs = self.run(tensors)
        pairs = [
            (outs[j], ct)
            for j, ct in zip(outputs, cotangents, strict=True)
            if isinstance(outs[j], torch.Tensor) and outs[j].requires_grad
        ]
        grads: Sequence[torch.Tensor | None] = [None] * len(wrt)
        if pairs:
            try:
                grads = torch.autograd.grad(
                    [o for o, _ in pairs],
                    wrt,
                    grad_outputs=[c.to(o.dtype) for o, c in pairs],
                    allow_unused=True,
                )
            except RuntimeError as e:
                raise DynajaxError(
                    f"the gradient of {self.name}, which runs in eager PyTorch through a "
                    f"host callback, failed in torch.autograd: {e}. Stop gradients before "
                    "it (jax.lax.stop_gradient) or write a JAX rule for the op."
                ) from e
        result = []
        for i, t, g in zip(inputs, wrt, grads, strict=True):
            g = torch.zeros_like(t) if g is None else g
            result.append(_to_numpy(g, self.operand_avals[i], self.name))
        return tuple(result)


def call_on_host(
    target: Callable[..., Any],
    name: str,
    args: Any,
    kwargs: dict[str, Any],
    structure: Any,
    avals: list[jax.ShapeDtypeStruct],
    dtypes: Callable[[list[int]], list[torch.dtype | None]] | None = None,
    kernel: bool = False,
) -> tuple[Any, bool]:
    """Calls ``target(*args, **kwargs)`` in eager PyTorch from inside a JAX trace.

    Args:
        target: the op.
        name: its name, for error messages.
        args, kwargs: its arguments: JAX values where the op takes tensors, Python
            values (literals, sizes) elsewhere.
        structure: the node's fake output, giving the nesting of the result.
        avals: shape and dtype of each output tensor (``flat_outputs`` order), sizes
            already resolved against the traced shapes.
        dtypes: given the positions of the JAX values among the flattened
            ``(list(args), kwargs)``, the torch dtype the op takes at each (None: as
            it comes).
        kernel: the forward runs PyTorch's kernel inside the program (``ffi``, which
            the driver found can run this call) instead of a Python host callback.

    Returns:
        The op's result as JAX values, nested as ``structure``; and whether gradients
        flow through it (a ``jax.custom_vjp`` with a PyTorch-autograd backward).
    """
    quiet_readonly_warning()  # the callback's buffers are read-only NumPy arrays
    leaves, spec = pytree.tree_flatten((list(args), dict(kwargs)))
    positions = [i for i, leaf in enumerate(leaves) if is_jax_value(leaf)]
    operands = [leaves[i] for i in positions]
    operand_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands]
    operand_dtypes: list[torch.dtype | None] = [None] * len(positions)
    if dtypes is not None:
        operand_dtypes = dtypes(positions)
    call = HostCall(
        target, name, leaves, spec, positions, structure, avals, operand_avals, operand_dtypes
    )
    result_avals = tuple(avals)
    # (Symbolic sizes, under jax.export, have no buffers to view: a host callback.)
    kernel = kernel and all(isinstance(d, int) for a in avals for d in a.shape)

    def forward(*xs: Any) -> tuple[Any, ...]:
        if kernel:
            return call.in_kernel(*xs)
        return tuple(jax.pure_callback(call.forward, result_avals, *xs, vmap_method="sequential"))

    diff_in = [i for i, x in enumerate(operands) if _inexact(x.dtype)]
    diff_out = [j for j, a in enumerate(avals) if _inexact(a.dtype)]
    differentiable = bool(diff_in and diff_out)
    if not differentiable:
        outs = forward(*operands)
        return rebuild_outputs(structure, iter(outs)), False

    grad_avals = tuple(operand_avals[i] for i in diff_in)

    def host_backward(*arrays: Any) -> tuple[np.ndarray, ...]:
        return call.backward(diff_in, diff_out, *arrays)

    @jax.custom_vjp
    def op(*xs: Any) -> tuple[Any, ...]:
        return forward(*xs)

    def op_fwd(*xs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return forward(*xs), xs

    def op_bwd(xs: tuple[Any, ...], cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
        cts = [cotangents[j] for j in diff_out]
        grads = jax.pure_callback(host_backward, grad_avals, *xs, *cts, vmap_method="sequential")
        full: list[Any] = [None] * len(xs)
        for i, g in zip(diff_in, grads, strict=True):
            full[i] = g
        return tuple(full)

    op.defvjp(op_fwd, op_bwd)
    if any(in_forward_mode(x) for x in operands):
        raise JaxFunctionError(
            f"forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian) through {name}, which "
            "runs in eager PyTorch through a host callback (it has no JAX rule, or is in "
            "fallback_ops), is not supported: its derivative is torch.autograd.grad on the "
            "host, a VJP (jax.custom_vjp), and JAX has no forward mode for it. Use reverse "
            "mode (jax.grad, jax.vjp, jax.jacrev; jax.jacrev(jax.jacrev(f)) for a Hessian)."
        )
    outs = op(*operands)
    return rebuild_outputs(structure, iter(outs)), True
