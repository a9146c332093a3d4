"""The whole training step as one ATen graph: forward, loss, backward, optional gradient
clipping and the user's own ``torch.optim`` update.

How it is captured, in two traces:

1. ``make_fx`` runs the step on fake tensors: the loss and ``torch.autograd.grad``
   with the module's parameters and buffers replaced by the traced ones (as
   ``torch.func.functional_call`` replaces them, but around the backward too, where
   ``torch.utils.checkpoint`` runs the forward again), so the backward is torch's own
   derivative formulas and the user's ``autograd.Function`` backwards, as aot_autograd
   records them; then ``clip_grad_norm_``, then the optimizer's own ``step()`` with its param groups
   pointed at the traced parameters and its state at traced state tensors. The
   optimizer runs as it does under ``torch.compile``: ``torch.compiler.is_compiling()``
   is true while it is traced, so its step counts stay tensors, and where it has the
   option it runs its ``capturable`` form (no ``.item()``). Each group's learning rate
   is a traced 0-d float64 tensor, an input of the program, so a scheduler changing it
   never retraces; scalar arguments that become tensors that way (``add_(g,
   alpha=-lr)``, ``addcdiv_(..., value=-clr)``) are rewritten as the products they
   stand for (``_TensorScalars``), as Dynamo does for the same calls.
2. ``functionalize`` and ``make_fx`` again, with dynajax's decomposition table: the
   in-place updates (parameters, buffers such as BatchNorm's running statistics,
   optimizer moments) become the new values the graph returns
   (``StepGraph.functional()``, run only where the step's program is not found in the
   persistent cache: the first trace's graph is what keys it, ``training/step.py``).

The graph's inputs are ``params + buffers + state + frozen + lrs + batch`` and its
outputs ``loss, params, buffers, written frozen, state`` (the state's entries after the
step, which the first step creates), each list in the order ``StepGraph`` records.
``frozen`` are the model's parameters the optimizer does not hold (frozen layers, the
other half of a GAN): inputs the step reads, so that an edit of them, or another step's
training of them, is what the next step sees; the few an op writes in place (an
embedding's ``max_norm``) are returned too. ``batch`` is the flat list of the batch's
tensor leaves (``BatchLayout``); its other leaves are constants of the trace.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import os
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.proxy_tensor import PythonKeyTracer, get_proxy_mode, get_proxy_slot
from torch.nn.utils.stateless import _reparametrize_module
from torch.optim.optimizer import (
    _default_to_fused_or_foreach,
    _get_value,
    _global_optimizer_post_hooks,
    _global_optimizer_pre_hooks,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from dynajax.aot.tracing import compiling, functionalized, joint_graph
from dynajax.errors import TrainStepError
from dynajax.program.replay import ReplayedRandom
from dynajax.runtime.held import Held

# Optimizers whose non-capturable step branches in Python on a state value (RAdam's
# rectification, ASGD's averaging): traced in their capturable form, which is the same
# arithmetic with the branch as a select.
_CAPTURABLE = (torch.optim.RAdam, torch.optim.ASGD)

# State keys: (index of the parameter in the step's parameter list, key in its state).
StateKey = tuple[int, str]


@dataclasses.dataclass
class StepGraph:
    """One training step as traced (the first trace: ``joint``, its in-place updates in
    place), and what its inputs and outputs are; ``functional()`` is its functional
    graph (the second trace)."""

    joint: torch.fx.GraphModule
    n_params: int
    n_buffers: int
    state_in: list[StateKey]  # the state tensors the step reads
    state_out: list[StateKey]  # the state tensors the step returns
    # The frozen parameters the step writes in place (an embedding's max_norm renorm),
    # by position: returned after the buffers, before the state.
    frozen_out: list[int] = dataclasses.field(default_factory=list)
    # The example tensors of the trace (what the second trace runs on).
    examples: list[torch.Tensor] = dataclasses.field(default_factory=list, repr=False)

    what: tuple[str, str] = ("", "")  # (the optimizer's class, the loss's name), for errors
    # What loss_fn returned beside the loss (``(loss, aux)``): its pytree structure, or
    # None where it returned the loss alone; its tensors are the graph's last outputs.
    aux: pytree.TreeSpec | None = None

    @property
    def state_at(self) -> int:
        """Where the optimizer's state starts among the graph's outputs: after the
        loss, the parameters, the buffers and the frozen parameters it writes."""
        return 1 + self.n_params + self.n_buffers + len(self.frozen_out)

    @property
    def aux_at(self) -> int:
        """Where ``aux``'s tensors start among the graph's outputs: after the state."""
        return self.state_at + len(self.state_out)

    def functional(self) -> torch.fx.GraphModule:
        """The step as one functional ATen graph, decomposed: the in-place updates of
        the parameters, buffers and optimizer state are the values it returns."""
        with _untraceable(*self.what):
            return functionalized(self.joint, self.examples)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """A batch (any pytree of tensors: tuples, lists, dicts, transformers'
    ``BatchEncoding``) as its tensor leaves and the rest: the tree's structure and its
    other leaves (ints, bools, None, strings), which are constants of the program, as
    ``jax.jit``'s static arguments are: another value compiles another program.

    Attributes:
        spec: the pytree structure of the batch tuple (``torch.utils._pytree``).
        tensors: for each leaf, whether it is a tensor.
        statics: the non-tensor leaves, in order.
    """

    spec: pytree.TreeSpec
    tensors: tuple[bool, ...]
    statics: tuple[Any, ...]

    @classmethod
    def of(cls, batch: Sequence[Any]) -> tuple[BatchLayout, list[torch.Tensor]]:
        """The layout of ``batch`` (the step's positional arguments) and its tensors."""
        leaves, spec = pytree.tree_flatten(tuple(batch))
        is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)
        statics = tuple(x for x, t in zip(leaves, is_tensor, strict=True) if not t)
        return cls(spec, is_tensor, statics), [x for x in leaves if isinstance(x, torch.Tensor)]

    def key(self) -> tuple[Any, ...]:
        """What identifies the layout in a program cache (the statics by value)."""
        return (str(self.spec), self.tensors, tuple(_static_key(v) for v in self.statics))

    def rebuild(self, tensors: Sequence[Any]) -> tuple[Any, ...]:
        """The batch tuple with ``tensors`` as its tensor leaves."""
        given, statics = iter(tensors), iter(self.statics)
        leaves = [next(given) if t else next(statics) for t in self.tensors]
        return tuple(pytree.tree_unflatten(leaves, self.spec))


def _static_key(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return (type(value).__name__, repr(value))
    return (type(value).__name__, value)


class _LossModule(nn.Module):
    """``loss_fn(model, *batch)`` as a module, whose parameters and buffers the trace
    replaces."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, *batch)


class _TensorScalars(TorchFunctionMode):
    """A tensor where a kernel takes a Python number (``alpha=``, ``value=``) would be
    read with ``.item()``, which a trace cannot do: such calls become the products they
    stand for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if _in_place(func) and _is_scalar(args[0]) and args[0].dtype != torch.float64:
            # A 0-d state tensor (NAdam's mu_product) updated by a value eager holds as
            # a Python double (``mu_product *= mu``): eager casts the number to the
            # tensor's dtype first (a wrapped number), where the float64 tensor would
            # promote the product to float64 and round it once.
            args = (args[0], *[_to(a, args[0].dtype) for a in args[1:]])
        if func in (torch.Tensor.add_, torch.Tensor.sub_) and isinstance(
            kwargs.get("alpha"), torch.Tensor
        ):
            alpha = kwargs.pop("alpha")
            self_, other = args
            return func(self_, other * alpha, **kwargs)
        if func in (torch.Tensor.addcdiv_, torch.Tensor.addcmul_) and isinstance(
            kwargs.get("value"), torch.Tensor
        ):
            value = kwargs.pop("value")
            self_, a, b = args
            product = a / b if func is torch.Tensor.addcdiv_ else a * b
            return self_.add_(product * value)
        if func is torch.full_like and isinstance(args[1], torch.Tensor):
            # Rprop's first step sizes: full_like(grad, lr) with lr a traced tensor.
            x, value = args
            return torch.zeros_like(x, **kwargs).add_(value.to(kwargs.get("dtype", x.dtype)))
        if func is torch.Tensor.__setitem__ and _is_mask(args[0], args[1]):
            # x[mask] = v (Rprop's sign table): a select, where indexing by a mask
            # would make the shapes data-dependent.
            self_, mask, value = args
            return self_.copy_(torch.where(mask, value, self_))
        return func(*args, **kwargs)


def _install_double_reads() -> Callable[[], None]:
    """Replaces ``torch.optim``'s ``_get_value`` in each optimizer module that calls it
    by ``_read_as_double``, and the functional updates of ``_CAPTURABLE`` by
    ``_in_double``'s; returns the undo."""
    original = _get_value
    undo: list[Callable[[], None]] = []

    def replace(module: Any, name: str, new: Any) -> None:
        old = getattr(module, name)
        setattr(module, name, new)
        undo.append(lambda: setattr(module, name, old))

    for module in list(sys.modules.values()):
        # (torch's optimizers, and a user's that imported torch's helper)
        if getattr(module, "_get_value", None) is original:
            replace(module, "_get_value", _read_as_double)
    for module, name, lists, rounded in _SCALAR_STATE:
        replace(module, name, _in_double(getattr(module, name), lists, rounded))

    def undo_all() -> None:
        for u in reversed(undo):
            u()

    return undo_all


# (torch's own, by another name: ``_install_double_reads`` replaces every module's
# ``_get_value``, this one's too)
_EAGER_GET_VALUE = _get_value


def _read_as_double(x: Any) -> Any:
    """``torch.optim``'s ``_get_value`` where the step is traced: a floating 0-d state
    tensor (a step count, NAdam's ``mu_product``) in float64. Eager reads it with
    ``.item()``, a Python double, and computes its bias corrections, step sizes and
    decays from it in double precision; the tensor in its own dtype (float32, what
    ``_get_value`` returns under ``torch.compile``) would compute them in float32
    (``1 - 0.999 ** step`` keeps four digits). Elsewhere, ``_get_value``."""
    if isinstance(x, torch.Tensor) and get_proxy_mode() is not None:
        return x.to(torch.float64) if x.is_floating_point() else x
    return _EAGER_GET_VALUE(x)


# The capturable forms (``_CAPTURABLE``) compute with their 0-d state tensors (step
# counts, ASGD's eta and mu) as tensors, where eager's reads them as Python doubles:
# (module, functional update, its arguments that list such tensors).
# The values eager writes into ASGD's ``mu`` and ``eta`` are ``torch.as_tensor`` of a
# double: in the default dtype, whatever the state's dtype (float64 after
# ``optimizer.load_state_dict`` cast it to a float64 parameter's): (..., the lists
# whose new values are so rounded).
_SCALAR_STATE = (
    (sys.modules[torch.optim.RAdam.__module__], "radam", ("state_steps",), ()),
    (
        sys.modules[torch.optim.ASGD.__module__],
        "asgd",
        ("state_steps", "mus", "etas"),
        ("mus", "etas"),
    ),
)


def _in_double(
    update: Callable[..., Any], lists: Sequence[str], rounded: Sequence[str]
) -> Callable[..., Any]:
    """``update`` (an optimizer's functional form) run, where the step is traced, on
    float64 copies of the 0-d state tensors its arguments ``lists`` hold, each written
    back into its tensor after it (rounded to the tensor's dtype, as eager's
    ``copy_`` of a double rounds it; those of ``rounded`` first to the default dtype,
    as eager's ``torch.as_tensor`` of a double makes it)."""
    signature = inspect.signature(update)

    @functools.wraps(update)
    def in_double(*args: Any, **kwargs: Any) -> Any:
        if get_proxy_mode() is None:
            return update(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        originals = {name: bound.arguments[name] for name in lists}
        copies = {name: [t.to(torch.float64) for t in ts] for name, ts in originals.items()}
        bound.arguments.update(copies)
        out = update(*bound.args, **bound.kwargs)
        default = torch.get_default_dtype()
        for name in lists:
            for original, copy in zip(originals[name], copies[name], strict=True):
                original.copy_(copy.to(default) if name in rounded else copy)
        params = bound.arguments.get("params") or [None]
        if update.__name__ == "asgd" and id(params[0]) in _FOREACH_ETAS.get():
            _asgd_foreach_etas(bound.arguments, originals["state_steps"], originals["etas"])
        return out

    return in_double


# While an optimizer's step is traced: the parameters of ASGD's groups that eager
# updates with its foreach form.
_FOREACH_ETAS: contextvars.ContextVar[frozenset[int] | set[int]] = contextvars.ContextVar(
    "dynajax_foreach_etas", default=frozenset()
)


def _asgd_foreach(arguments: dict[str, Any]) -> bool:
    """Whether eager's ``asgd`` runs its foreach form for these arguments (or param
    group): its ``foreach``, or where None, torch's default for the parameters."""
    foreach = arguments.get("foreach")
    if foreach is None:
        differentiable = arguments.get("differentiable", False)
        _, foreach = _default_to_fused_or_foreach(arguments["params"], differentiable, False)
    return bool(foreach)


def _asgd_foreach_etas(
    arguments: dict[str, Any], steps: Sequence[torch.Tensor], etas: Sequence[torch.Tensor]
) -> None:
    """Each new eta as ASGD's foreach form computes it: from the step tensor in its
    own dtype, ``lr / ((1 + lambd * lr * step) ** alpha)`` with ``lr`` a Python float
    (a wrapped number: cast to the step's dtype), not from a double."""
    lr, lambd, alpha = arguments["lr"], arguments["lambd"], arguments["alpha"]
    for step, eta in zip(steps, etas, strict=True):
        scale = lambd * lr  # (a double, as eager's product of two floats)
        scale = scale.to(step.dtype) if isinstance(scale, torch.Tensor) else scale
        rate = lr.to(step.dtype) if isinstance(lr, torch.Tensor) else lr
        base = 1 + scale * step
        # (the power correctly rounded, as eager's kernel gives it: XLA's float32 power
        # is exp(alpha * log(base)), ulps away)
        power = (base.to(torch.float64) ** alpha).to(step.dtype)
        eta.copy_(power.reciprocal() * rate)


# Held while any trace runs an optimizer's step (the patch is process-wide, as the
# compiling flag is).
_double_reads = Held(_install_double_reads)


def _in_place(func: Any) -> bool:
    """Whether ``func`` is a Tensor method that writes its tensor (``mul_``, ``__imul__``)."""
    name = getattr(func, "__name__", "")
    writes = (name.endswith("_") and not name.startswith("_")) or name.startswith("__i")
    return writes and getattr(torch.Tensor, name, None) is func


def _is_scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point()


def _to(x: Any, dtype: torch.dtype) -> Any:
    """``x`` in ``dtype`` where it is a 0-d float64 tensor (a number eager holds as a
    Python double), else ``x``."""
    return x.to(dtype) if _is_scalar(x) and x.dtype == torch.float64 else x


def _is_mask(x: Any, key: Any) -> bool:
    return (
        isinstance(key, torch.Tensor)
        and key.dtype == torch.bool
        and isinstance(x, torch.Tensor)
        and key.shape == x.shape
    )


@contextlib.contextmanager
def optimizer_on(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    state: dict[StateKey, torch.Tensor],
    lrs: Sequence[torch.Tensor | float],
) -> Iterator[collections.defaultdict[torch.Tensor, Any]]:
    """The optimizer, for the length of the block, with its param groups' parameters
    replaced by ``params`` (in the order of ``optimizer.param_groups``), their state by
    ``state``, each group's ``lr`` by ``lrs`` and the options that pick a kernel set for
    a traced step; everything restored after. Yields the optimizer's state dict."""
    saved_groups = [dict(group) for group in optimizer.param_groups]
    saved_state = optimizer.state
    new_state: collections.defaultdict[torch.Tensor, Any] = collections.defaultdict(dict)
    for (i, key), value in state.items():
        new_state[params[i]][key] = value
    foreach_etas: set[int] = set()  # ASGD's parameters whose eager form is foreach
    token = _FOREACH_ETAS.set(foreach_etas)
    try:
        optimizer.state = new_state
        position = 0
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            count = len(group["params"])
            group["params"] = list(params[position : position + count])
            position += count
            group["lr"] = lr
            if "capturable" in group:
                # The form eager runs (capturable=False: step sizes as products, where
                # the capturable form divides by lr, NaN at lr 0), but for optimizers
                # whose eager form branches on a state value.
                group["capturable"] = isinstance(optimizer, _CAPTURABLE)
            if "foreach" in group:
                # torch's single-tensor form: its foreach form gives the same numbers,
                # but for ASGD's new eta (``_asgd_foreach_etas``), noted per parameter.
                if isinstance(optimizer, torch.optim.ASGD) and _asgd_foreach(group):
                    foreach_etas.update(id(p) for p in group["params"])
                group["foreach"] = False
            if "fused" in group:
                group["fused"] = None
        with _double_reads():
            yield new_state
    finally:
        _FOREACH_ETAS.reset(token)
        optimizer.state = saved_state
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
            group.clear()
            group.update(saved)


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str | None:
    """The optimizer's update as text that determines its trace, for one of torch's own
    optimizers (``torch.optim``'s class itself, its ``step`` torch's code, or that
    wrapped by an LR scheduler, no step hooks): its class, each param group's size and
    hyperparameters but ``lr`` (a traced input) and the default dtype (its step
    counters'); the code is torch's and dynajax's, which the cache's versions key.
    Given the gradients it reads (``trace_step(..., at_update=...)``) and the state it
    holds (names, shapes and dtypes), that is its whole trace. None for any other
    optimizer, whose update is Python of the user's: only its trace can key it."""
    cls = type(optimizer)
    own_step = vars(optimizer).get("step")
    if (
        cls not in _TORCH_OPTIMIZERS
        or (own_step is not None and not _scheduler_wrapped(own_step, cls))
        or "_optimizer_step_code" in vars(optimizer)
        or optimizer._optimizer_step_pre_hooks
        or any(
            not getattr(hook, "_dynajax_view", False)  # (the view's own: it changes nothing)
            for hook in optimizer._optimizer_step_post_hooks.values()
        )
        or _global_optimizer_pre_hooks
        or _global_optimizer_post_hooks
        or not _torch_code(cls.step)
    ):
        return None
    groups = [
        (len(g["params"]), sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "lr")))
        for g in optimizer.param_groups
    ]
    return (
        f"optimizer {cls.__module__}.{cls.__qualname__} groups={groups!r} "
        f"default_dtype={torch.get_default_dtype()}"
    )


_TORCH_OPTIMIZERS = frozenset(
    cls
    for cls in vars(torch.optim).values()
    if isinstance(cls, type)
    and issubclass(cls, torch.optim.Optimizer)
    and cls is not torch.optim.Optimizer
)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _scheduler_wrapped(step: Any, cls: type[torch.optim.Optimizer]) -> bool:
    """Whether ``step`` (an optimizer's own ``step`` attribute) is the wrapper a torch LR
    scheduler puts around the class's ``step`` (it notes that the step was called)."""
    return (
        getattr(step, "_wrapped_by_lr_sched", False)
        and getattr(step, "__wrapped__", None) is cls.step
        and _torch_code(step)
    )


def _torch_code(fn: Any) -> bool:
    """Whether ``fn`` and every function it wraps (``functools.wraps``) are torch's."""
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is None or not code.co_filename.startswith(_TORCH_DIR):
            return False
        fn = getattr(fn, "__wrapped__", None)
    return True


def trace_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    *,
    param_names: Sequence[str],
    buffer_names: Sequence[str],
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    state: dict[StateKey, torch.Tensor],
    frozen_names: Sequence[str] = (),
    frozen: Sequence[torch.Tensor] = (),
    lrs: Sequence[float],
    batch: Sequence[torch.Tensor],
    layout: BatchLayout | None = None,
    clip_grad_norm: float | None,
    accumulate: int = 1,
    at_update: AtUpdate | None = None,
    initial: Collection[int] = (),
) -> StepGraph | None:
    """The step's ``StepGraph``, traced on (fakes of) these example values.

    ``params`` are the optimizer's parameters, in the order of its param groups, named
    ``param_names`` in ``model`` (the gradient of those that require one);
    ``buffers`` the model's buffers; ``frozen`` the model's other parameters; ``batch``
    the batch's tensors, which ``layout`` puts back into the batch ``loss_fn`` takes
    (by default they are the batch); ``accumulate``: the number of micro-batches (each
    batch tensor split along its first dim).

    ``at_update``, where given, is called once the trace reaches the optimizer's update
    (of one of torch's own optimizers, the rest of the trace is what its configuration
    says, ``describe_optimizer``) with the graph traced so far (returning the loss, the
    gradients the update reads, the buffers and the frozen parameters written), which
    parameters have a gradient, and which frozen parameters were written; where it
    returns True the trace stops there and ``trace_step`` returns None.

    ``initial``: the positions of the parameters whose ``state`` is the optimizer's
    initial state, made before its first step (``training/initial.py``); where one of
    them gets no gradient, ``InitialStateUnread`` is raised."""
    wrapper = _LossModule(model, loss_fn)
    state_in = list(state)
    n_params, n_buffers, n_state = len(params), len(buffers), len(state_in)
    n_frozen = len(frozen)
    wanted = [p.requires_grad for p in params]  # the others get no gradient, as in eager
    state_out: list[StateKey] = []
    frozen_out: list[int] = []
    aux_spec: list[pytree.TreeSpec | None] = [None]

    def step(*flat: torch.Tensor) -> tuple[Any, ...]:
        ps = list(flat[:n_params])
        bufs = list(flat[n_params : n_params + n_buffers])
        at = n_params + n_buffers
        st = dict(zip(state_in, flat[at : at + n_state], strict=True))
        at += n_state
        fixed = list(flat[at : at + n_frozen])
        versions = [f._version for f in fixed]
        at += n_frozen
        group_lrs = list(flat[at : at + len(lrs)])
        xs = flat[at + len(lrs) :]
        values = {f"model.{n}": p for n, p in zip(param_names, ps, strict=True)}
        values.update({f"model.{n}": p for n, p in zip(frozen_names, fixed, strict=True)})
        values.update({f"model.{n}": b for n, b in zip(buffer_names, bufs, strict=True)})
        # Micro-batches as an eager loop accumulates them: (loss_i / k).backward() each,
        # the gradients summed in order, the step's loss the sum of the scaled losses.
        micro = [tuple(xs)]
        if accumulate > 1:
            micro = [tuple(x.chunk(accumulate)[i] for x in xs) for i in range(accumulate)]
        loss: torch.Tensor | None = None
        auxes: list[list[torch.Tensor]] = []  # each micro-batch's
        grads: list[torch.Tensor | None] = [None] * n_params
        differentiated = [p for p, w in zip(ps, wanted, strict=True) if w]
        replayed = ReplayedRandom()  # one for every micro-batch: each draws its own
        try:
            for part in micro:
                with (
                    torch.enable_grad(),
                    _NoFloat16Autocast(),
                    _reparametrize_module(wrapper, values, tie_weights=True),
                    replayed,
                ):
                    args = layout.rebuild(part) if layout is not None else part
                    part_loss, aux = _loss_and_aux(wrapper(*args))
                    if aux is not None:
                        leaves, aux_spec[0] = pytree.tree_flatten(aux)
                        auxes.append([t.detach() for t in leaves])
                    if accumulate > 1:
                        part_loss = part_loss / accumulate
                    found = iter(
                        torch.autograd.grad(part_loss, differentiated, allow_unused=True)
                        if differentiated
                        else ()
                    )
                    part_grads = [next(found) if w else None for w in wanted]
                loss = part_loss if loss is None else loss + part_loss.detach()
                grads = [
                    g if acc is None else (acc if g is None else acc + g)
                    for acc, g in zip(grads, part_grads, strict=True)
                ]
        finally:
            replayed.restore()
        assert loss is not None
        # aux as loss_fn returned it; with micro-batches each one's, stacked (dim 0)
        aux_out = (
            auxes[0] if len(auxes) == 1 else [torch.stack(ts) for ts in zip(*auxes, strict=True)]
        )
        with torch.no_grad():
            for p, g in zip(ps, grads, strict=True):
                p.grad = _as_accumulated(g, p)
            if clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(ps, clip_grad_norm, foreach=False)
            unread = [i for i in initial if ps[i].grad is None]
            if unread:
                raise InitialStateUnread(unread)
            if at_update is not None:
                read = [p.grad for p in ps]
                written = [i for i, f in enumerate(fixed) if f._version != versions[i]]
                so_far = _traced_so_far(
                    [
                        loss,
                        *aux_out,
                        *[g for g in read if g is not None],
                        *bufs,
                        *[fixed[i] for i in written],
                    ]
                )
                # (outside the trace's modes: what it does with tensors, a constant's
                # digest, is not part of the step)
                with _disable_current_modes():
                    stop = at_update(
                        so_far, [g is not None for g in read], written, aux_text(aux_spec[0])
                    )
                if stop:
                    raise _Stopped
            with optimizer_on(optimizer, ps, st, group_lrs) as new_state, _TensorScalars():
                optimizer.step()
            for p in ps:
                p.grad = None
            out = []
            for i, p in enumerate(ps):
                for key, value in new_state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        raise TrainStepError(
                            f"{type(optimizer).__name__} keeps a {type(value).__name__} "
                            f"in its state ('{key}'), which a compiled step cannot carry; "
                            "only tensors can."
                        )
                    state_out.append((i, key))
                    out.append(value)
        # A frozen parameter written in place (F.embedding's max_norm renormalizes the
        # rows it reads): returned, so that the next step reads it as eager would.
        frozen_out[:] = [i for i, f in enumerate(fixed) if f._version != versions[i]]
        return (loss.detach(), *ps, *bufs, *[fixed[i] for i in frozen_out], *out, *aux_out)

    examples = [
        *[p.detach().requires_grad_(p.requires_grad) for p in params],
        *[b.detach() for b in buffers],
        *[state[k].detach() for k in state_in],
        *[p.detach() for p in frozen],
        *[torch.tensor(lr, dtype=torch.float64) for lr in lrs],
        *[x.detach() for x in batch],
    ]
    what = (type(optimizer).__name__, repr(getattr(loss_fn, "__name__", loss_fn)))
    try:
        with compiling(), _untraceable(*what):
            joint = joint_graph(step, examples)
    except _Stopped:
        return None
    return StepGraph(
        joint, n_params, n_buffers, state_in, state_out, frozen_out, examples, what, aux_spec[0]
    )


class InitialStateUnread(BaseException):  # noqa: N818 - a signal: TrainStep traces again
    """Parameters given the optimizer's initial state before the first step
    (``training/initial.py``) get no gradient in the step: eager gives them no state.
    ``positions``: theirs. (Not an ``Exception``: no handler on its way out of the
    trace takes it for an error of the trace.)"""

    def __init__(self, positions: Sequence[int]) -> None:
        super().__init__(f"no gradient for the parameters at {list(positions)}")
        self.positions = frozenset(positions)


class _Stopped(BaseException):
    """Ends a trace that ``at_update`` stopped (not an ``Exception``: no handler on the
    way out takes it for an error of the trace)."""


# Called where the trace reaches the optimizer's update: (the graph so far, which
# parameters have a gradient, which frozen parameters were written, the structure of
# loss_fn's aux as text) -> stop there.
AtUpdate = Callable[[torch.fx.GraphModule, list[bool], list[int], str], bool]


def aux_text(spec: pytree.TreeSpec | None) -> str:
    """``aux``'s structure as text (a program's key: its dict keys are outputs' names)."""
    return "" if spec is None else pytree.treespec_dumps(spec)


def _traced_so_far(outputs: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """Inside a ``make_fx`` trace: a copy of the graph recorded so far, returning the
    nodes that computed ``outputs`` (the trace goes on unchanged)."""
    mode = get_proxy_mode()
    assert mode is not None, "only inside make_fx's trace"
    tracer = mode.tracer
    assert isinstance(tracer, PythonKeyTracer)
    graph = torch.fx.Graph()
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.graph_copy(tracer.graph, copied)
    graph.output(tuple(copied[get_proxy_slot(t, tracer).proxy.node] for t in outputs))
    return torch.fx.GraphModule(tracer.root, graph)


@contextlib.contextmanager
def _untraceable(optimizer: str, loss_fn: str) -> Iterator[None]:
    """Raises an error of the trace as a ``TrainStepError`` that says what to do
    (``optimizer``: its class's name, ``loss_fn``: the loss function's)."""
    try:
        yield
    except TrainStepError:
        raise
    except Exception as e:
        hint = ""
        if "use_reentrant=True" in str(e):
            hint = (
                "\ntrain_step differentiates with torch.autograd.grad: checkpoint with "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (transformers: "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False}), which is its default)."
            )
        if "data-dependent" in str(e):
            hint = (
                "\nThe model or loss_fn branches on a tensor's value (.item(), `if "
                "tensor:`, a Python number from a tensor); one program serves every "
                "batch, so compute both sides with torch.where, or move the branch "
                "out of the step."
            )
        error = TrainStepError(
            f"the training step could not be traced ({optimizer}, loss_fn {loss_fn}): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{hint}"
        )
        # The user sees this error alone (torch's trace of the failure is long and
        # names torch's frames); the original stays on ``error.traced``.
        error.traced = e  # type: ignore[attr-defined]
        raise error from None


class _NoFloat16Autocast(TorchFunctionMode):
    """Refuses float16 autocast in the loss: eager trains it with a
    ``torch.amp.GradScaler`` (the loss scaled, steps with inf gradients skipped), which
    the step does not run, and unscaled float16 gradients underflow."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device) and (
                torch.get_autocast_dtype(device) == torch.float16
            ):
                raise TrainStepError(
                    f"loss_fn runs under float16 autocast on {device}: eager trains that "
                    "with torch.amp.GradScaler (a scaled loss, steps with inf gradients "
                    "skipped), which train_step does not run. Use bfloat16 autocast, which "
                    f"needs no scaler: torch.autocast('{device}', dtype=torch.bfloat16)."
                )
        return func(*args, **(kwargs or {}))


def _as_accumulated(g: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor | None:
    """``g`` as autograd's AccumulateGrad stores it in ``p.grad``: itself where its
    layout obeys ``p``'s (non-overlapping and dense, ``p``'s strides), else a copy in
    ``p``'s strides. A sum's gradient is an expanded view of one number: kept as is,
    an in-place clip (``grad.mul_``) would write through it (the training fuzzer, seed
    3 run 142: RMSprop with clip_grad_norm moved the parameter the wrong way)."""
    if g is None:
        return None
    if _dense(g) and g.stride() == p.stride():
        return g
    if _dense(p):
        return torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)
    return g.clone(memory_format=torch.contiguous_format)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory once, without gaps (``is_non_overlapping_and_dense``):
    its strides, smallest first, are the products of the sizes below them."""
    expected = 1
    for stride, size in sorted(
        (st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _loss_and_aux(out: Any) -> tuple[torch.Tensor, Any]:
    """What loss_fn returned, as (the loss, aux or None): the loss alone, or ``(loss,
    aux)`` with aux any pytree of tensors (as ``jax.value_and_grad(has_aux=True)``)."""
    aux = None
    if isinstance(out, tuple) and len(out) == 2:
        out, aux = out
        leaves = pytree.tree_leaves(aux)
        wrong = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
        if wrong:
            raise TrainStepError(
                f"loss_fn returned (loss, aux) with aux holding a {wrong[0]}: aux must be "
                "a pytree of tensors (a Python number is a constant of the program: "
                "return it as a tensor, or compute it outside the step)."
            )
    _check_loss(out)
    return out, aux


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = (
            f"a {tuple(loss.shape)} {loss.dtype} tensor"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise TrainStepError(
            f"loss_fn must return the loss as a floating tensor of one element, got {what} "
            "(reduce it, e.g. with .mean(), as loss.backward() would need), or (loss, aux)."
        )
