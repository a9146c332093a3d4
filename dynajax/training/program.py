"""The programs of a ``train_step``: one per batch signature and settings, each looked
up in the persistent cache, or traced, lowered by the whole-graph driver, compiled and
stored (``StepPrograms``).

A program is keyed in memory by the batch's layout and shapes, the optimizer state's
entries, the hyperparameters a step bakes in, the settings ``Watch`` reports and the
step's members' names, shapes and dtypes. In the persistent cache it is keyed by the
step's first trace (everything the user's Python computed): with one of torch's own
optimizers, the trace up to the update with the optimizer's configuration
(``describe_optimizer``), so that the trace stops at the update where the program is
found; else the whole step's trace.

What a program is made for is a ``StepArrays``: the step's arrays and what they are,
which the ``TrainStep`` holding the state hands over (``training/step.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn

from dynajax import ffi
from dynajax.capability import Reason, cost
from dynajax.config import Options
from dynajax.errors import TrainStepError
from dynajax.lowering import precision
from dynajax.lowering.checks import Check
from dynajax.lowering.dtypes import JAX_TO_TORCH
from dynajax.lowering.interpreter import output_vals
from dynajax.program import NEVER, Policy, lower, on_cuda
from dynajax.runtime.cache import CompileStats, ExecutableCache
from dynajax.runtime.heap import release_freed_heap
from dynajax.runtime.held import Held
from dynajax.runtime.programs import describe_call, describe_graph
from dynajax.training.boundary import FlatBoundary, flat_avals
from dynajax.training.graph import (
    AtUpdate,
    BatchLayout,
    InitialStateUnread,
    StateKey,
    StepGraph,
    aux_text,
    describe_optimizer,
    trace_step,
)
from dynajax.training.state import StateLayout


@dataclasses.dataclass
class StepProgram:
    """A step's executable and what it takes and returns. The trace it was built from
    (its graphs, and the example tensors and first batch they ran on) is not kept."""

    state_in: list[StateKey]  # the optimizer state it reads, in order
    state_out: list[StateKey]  # the optimizer state it returns, in order
    frozen_out: list[int]  # the frozen parameters it writes, by position
    run: Callable[..., Any]  # jitted (state, frozen, lrs, seed, batch) -> (loss, state, err)
    random: bool  # whether it draws random numbers (then each step draws a seed)
    checks: list[Check]  # eager's value checks the program computes (its trace fills it)
    boundary: FlatBoundary | None = None  # the state arrays that cross it flat (one CPU)
    aux: pytree.TreeSpec | None = None  # the structure of loss_fn's aux (None: none)
    kernels: list[str] = dataclasses.field(default_factory=list)  # PyTorch's, faster
    # The signature of the state it returns (``holding.state_signature``), at its first run.
    state_out_signature: tuple[Any, ...] | None = None


@dataclasses.dataclass
class StepArrays:
    """What a step's program is made for: the state's arrays as the step holds them now,
    and what they are.

    Attributes:
        params, buffers, frozen: the trained parameters', buffers' and frozen
            parameters' arrays.
        state: the optimizer's state arrays, by (parameter position, entry name).
        layout: where they live (``StateLayout``).
        param_names, buffer_names, frozen_names: their names in the module.
        trained: the trained parameters' tensors in the module (their
            ``requires_grad`` now).
        state_signature: the optimizer state's entries, dtypes and shapes (a program
            is made for one).
        device: the module's device (the trace's example tensors are made there).
        quiet: the module's hooks off while the step's trace runs it.
        first_step: no step ran yet (the compile's event says "first step").
        initial: the positions of the parameters whose state is the optimizer's
            initial state, made before the step (``training/initial.py``).
    """

    params: list[jax.Array]
    buffers: list[jax.Array]
    frozen: list[jax.Array]
    state: dict[StateKey, jax.Array]
    layout: StateLayout
    param_names: list[str]
    buffer_names: list[str]
    frozen_names: list[str]
    trained: list[torch.Tensor]
    state_signature: tuple[Any, ...]
    device: torch.device
    quiet: Callable[[], contextlib.AbstractContextManager[None]]
    first_step: bool
    initial: frozenset[int] = frozenset()


class StepPrograms:
    """The programs of one ``TrainStep``, by batch signature and settings.

    Attributes:
        cache: the persistent cache (``DYNAJAX_CACHE_DIR``, ``DYNAJAX_CACHE_MAX_BYTES``).
        compile_stats: XLA's compiles and cache loads of these programs.
        traces: the programs traced (new batch signatures, settings, make-ups).
        retraces: why each program after the first was traced.
        why: a change of settings seen (``Watch``), noted in ``retraces`` at the next
            trace.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., Any],
        *,
        clip_grad_norm: float | None,
        accumulate: int,
        strict: bool,
        fallback_ops: tuple[str, ...],
        checks: bool,
    ) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.clip_grad_norm, self.accumulate = clip_grad_norm, accumulate
        self.strict, self.fallback_ops, self.checks = strict, fallback_ops, checks
        self._policy = (fallback_ops, strict, checks)  # (what lowering a step reads)
        self._programs: dict[Any, StepProgram] = {}
        # Per batch signature and settings, the trace up to the optimizer's update as
        # the cache keys it (``_compile``).
        self._gradients: dict[Any, tuple[str | None, list[int], list[bool], bool, str]] = {}
        options = Options.resolve({})
        self.cache = ExecutableCache.from_option(options.cache_dir, options.cache_max_bytes)
        self.compile_stats = CompileStats()
        self.traces = 0
        self.retraces: list[str] = []
        self.why: str | None = None

    def get(
        self,
        state_signature: tuple[Any, ...],
        arrays: Callable[[], StepArrays],
        layout: BatchLayout,
        batch: Sequence[torch.Tensor],
        xs: Sequence[jax.Array],
        lrs: list[float],
        settings: tuple[Any, ...],
        structure: tuple[Any, ...],
    ) -> StepProgram:
        """The program for this batch (its ``layout``, tensors and arrays ``xs``), the
        learning rates ``lrs``, the settings that key programs (``Watch``) and the
        step's make-up (``structure``): made, from ``arrays()``, where there is none yet."""
        key = (
            layout.key(),
            tuple((tuple(x.shape), x.dtype) for x in batch),
            state_signature,
            _hyperparameters(self.optimizer),
            settings,
            structure,
        )
        program = self._programs.get(key)
        if program is None:
            if self._programs and self.why is not None:
                self.retraces.append(self.why)
            self.why = None
            # The optimizer's state only grows as it trains (Adam's moments appear at
            # its first step): a program for the same batch and settings over less
            # state runs again only after the state is reset, which loads it from the
            # persistent cache. Its executable is let go before the new one is built,
            # not beside it (an executable of GPT-2 small's step: 156 MiB resident).
            state = set(key[2])
            for old in [k for k in self._programs if k[:2] == key[:2] and k[3:] == key[3:]]:
                if set(old[2]) < state:
                    del self._programs[old]
            gradients_key = key[:2] + key[3:]  # (the same but for the optimizer's state)
            program = self._compile(arrays(), layout, batch, xs, lrs, gradients_key)
            self._programs[key] = program
            # What the trace, the passes and XLA's compiler freed goes back to the
            # system (else it stays resident beside the step's state).
            release_freed_heap()
        return program

    def __len__(self) -> int:
        return len(self._programs)

    def values(self) -> list[StepProgram]:
        """The programs held, oldest first."""
        return list(self._programs.values())

    def report_lines(self) -> list[str]:
        """The programs traced, loaded and compiled, what keys them in the persistent
        cache, and why each after the first was traced (``retraces``)."""
        lines = [f"  programs traced: {self.traces}"]
        stats = self.compile_stats
        if stats.events:
            lines.append(f"  of which loaded from the persistent cache: {stats.cache_hits}")
            lines.append(f"  XLA: {stats.line()}")
        lines.append(f"  persistent cache: {self.keyed_by()}")
        if self._programs and self.values()[-1].kernels:  # (the newest program's)
            lines.append(_kernels_line(self.values()[-1].kernels))
        if self.retraces:
            lines.append(
                "  retraced for a change of the module, optimizer or loss (step.retraces):"
            )
            counts = collections.Counter(self.retraces)
            lines += [f"    {why}" + (f" x{n}" if n > 1 else "") for why, n in counts.items()]
        return lines

    def keyed_by(self) -> str:
        """What keys the programs in the persistent cache, in words."""
        if self.cache.directory is None:
            return "off (DYNAJAX_CACHE_DIR is empty)"
        if jax.process_count() > 1:
            return "not used (a multi-process step: each process compiles its programs)"
        name = type(self.optimizer).__name__
        if describe_optimizer(self.optimizer) is not None:
            return f"programs keyed by the trace up to {name}'s update and its configuration"
        return (
            f"programs keyed by the whole step's trace ({name}'s step is not torch's own: "
            "a subclass, a patched step or a step hook)"
        )

    def _trace(
        self,
        arrays: StepArrays,
        layout: BatchLayout,
        batch: Sequence[torch.Tensor],
        lrs: list[float],
        at_update: AtUpdate | None = None,
    ) -> StepGraph | None:
        """The step's first trace on examples of its state (``trace_step``; None where
        ``at_update`` stopped it)."""
        device = arrays.device
        params = _examples(arrays.params, device)
        for p, original in zip(params, arrays.trained, strict=True):
            p.requires_grad_(original.requires_grad)
        state = arrays.state
        with arrays.quiet():
            return trace_step(
                self.model,
                self.optimizer,
                self.loss_fn,
                param_names=arrays.param_names,
                buffer_names=arrays.buffer_names,
                params=params,
                buffers=_examples(arrays.buffers, device),
                state=dict(zip(state, _examples(list(state.values()), device), strict=True)),
                frozen_names=arrays.frozen_names,
                frozen=_examples(arrays.frozen, device),
                lrs=lrs,
                batch=list(batch),
                layout=layout,
                clip_grad_norm=self.clip_grad_norm,
                accumulate=self.accumulate,
                at_update=at_update,
                initial=arrays.initial,
            )

    def _compile(
        self,
        arrays: StepArrays,
        layout: BatchLayout,
        batch: Sequence[torch.Tensor],
        xs: Sequence[jax.Array],
        lrs: list[float],
        gradients_key: Any,
    ) -> StepProgram:
        """The step's program for this batch: loaded from the persistent cache where it
        is there, else traced, functionalized, lowered, compiled and stored.

        What keys it is the step's first trace (everything the user's Python computed).
        With one of torch's own optimizers, that is the trace up to the update, with the
        optimizer's configuration (``describe_optimizer``): the trace looks the program
        up when it reaches the update and stops there if it is found. Its digest is
        kept per batch signature and settings (``gradients_key``), so a program over
        other state (the state a first step created) is looked up untraced."""
        self.traces += 1
        # One process's executables only: those of a multi-process step (each process
        # holding some of the mesh's devices) are neither stored nor loaded.
        single = jax.process_count() == 1
        cache = self.cache if single else ExecutableCache(None)
        state_in = list(arrays.state)
        taken = [arrays.params, arrays.buffers, [arrays.state[k] for k in state_in]]
        flat = _flat_boundary(arrays.layout)
        args = (
            tuple(flat_avals(taken) if flat else taken),
            arrays.frozen,
            [np.float64(lr) for lr in lrs],
            np.int64(0),
            list(xs),
        )
        shapes = ", ".join(str(list(np.shape(x))) for x in xs)
        name = f"train_step({shapes})"
        event = ("train_step", shapes, "first step" if arrays.first_step else "new program")
        optimizer = describe_optimizer(self.optimizer) if cache.directory is not None else None
        description: str | None = None
        found: tuple[Any, Any] | str | None = None  # the cache's answer (a miss: why)

        def look_up(
            digest: str | None, frozen_out: list[int], graded: list[bool], cuda: bool, aux: str
        ) -> bool:
            """Looks for the program keyed by the trace up to the update (its digest)
            and the optimizer's configuration; True where it is found."""
            nonlocal description, found
            self._gradients[gradients_key] = (digest, frozen_out, graded, cuda, aux)
            if digest is None:
                return False
            description = _describe(
                arrays,
                self._policy,
                f"up to the update {digest}\n{optimizer}\ngraded={graded!r}\naux={aux}",
                (state_in, frozen_out),
                args,
                _out_shardings(arrays.layout, frozen_out),
                cuda,
            )
            found = cache.load_traced(description, self.compile_stats, name=name, event=event)
            return not isinstance(found, str)

        def at_update(
            so_far: torch.fx.GraphModule, graded: list[bool], written: list[int], aux: str
        ) -> bool:
            text = describe_graph(so_far, "train_step")
            # (kept as its digest: the text of a large model's graph is MBs)
            digest = text and hashlib.sha256(text.encode()).hexdigest()
            return look_up(digest, written, graded, on_cuda(so_far), aux)

        graph: StepGraph | None = None
        if optimizer is not None and gradients_key in self._gradients:
            # The trace up to the update is this batch signature's, as traced before.
            graded = self._gradients[gradients_key][2]
            if not all(graded[i] for i in arrays.initial):
                raise InitialStateUnread([i for i in arrays.initial if not graded[i]])
            look_up(*self._gradients[gradients_key])
        if found is None or isinstance(found, str):
            # Not found: traced whole, looked up at the update where it was not yet.
            keyed = optimizer is not None and gradients_key not in self._gradients
            graph = self._trace(arrays, layout, batch, lrs, at_update if keyed else None)
        if graph is not None and description is None and cache.directory is not None:
            text = describe_graph(graph.joint, "train_step")
            if text is not None:
                text += f"\naux={aux_text(graph.aux)}"
                state_shapes = _output_shapes(graph.joint)[graph.state_at : graph.aux_at]
                description = _describe(
                    arrays,
                    self._policy,
                    text,
                    (state_in, graph.state_out, graph.frozen_out),
                    args,
                    _out_shardings(arrays.layout, graph.frozen_out, graph.state_out, state_shapes),
                    on_cuda(graph.joint),
                )
        checks: list[Check] = []
        traced: dict[str, Any] = {}

        def lower_step() -> jax.stages.Lowered:
            assert graph is not None
            return _lower_step(graph, arrays, flat, args, checks, traced, self._policy)

        if found is not None and not isinstance(found, str):
            run, stored = found  # found before the trace reached the update
        else:
            run, stored = cache.compile_traced(
                description,
                lower_step,
                self.compile_stats,
                name=name,
                extra=lambda: (
                    list(checks),
                    traced["random"],
                    traced["state_out"],
                    traced["state_shapes"],
                    traced["frozen_out"],
                    traced["aux"],
                    traced["kernels"],
                ),
                event=event,
                missed=found,
            )
        if stored is not None:  # loaded without tracing: what its trace recorded
            checks[:], random, state_out, state_shapes, frozen_out, aux, kernels = stored
            traced.update(
                random=random,
                state_out=state_out,
                state_shapes=state_shapes,
                frozen_out=frozen_out,
                aux=aux,
                kernels=kernels,
            )
        return StepProgram(
            state_in,
            traced["state_out"],
            traced["frozen_out"],
            run,
            traced["random"],
            checks,
            _boundary(arrays, state_in, traced["state_shapes"]) if flat else None,
            pytree.treespec_loads(traced["aux"]) if traced["aux"] else None,
            kernels=traced["kernels"],
        )


def _describe(
    arrays: StepArrays,
    policy: tuple[tuple[str, ...], bool, bool],
    text: str,
    layout: tuple[Any, ...],
    args: Any,
    out_shardings: Any,
    cuda: bool,
) -> str:
    """The step's program as the persistent cache keys it: ``text`` (what its trace
    computed), the layout of its state, its policy and its call."""
    fallback_ops, strict, check = policy
    settings = (
        f"train_step {(len(arrays.params), len(arrays.buffers), *layout)!r} "
        f"fallback_ops={sorted(fallback_ops)!r} strict={strict} "
        f"deterministic={torch.are_deterministic_algorithms_enabled()} "
        f"costs={cost.times_key() if _measured_here(arrays) else None!r}"
    )
    leaves = jax.tree.leaves(args)
    # (a sharding's repr names its mesh's shape, not which devices, in which order)
    devices = [_device_ids(getattr(a, "sharding", None)) for a in leaves]
    devices += [_device_ids(s) for s in jax.tree.leaves(out_shardings)]
    return describe_call(
        f"{text}\n{settings}\ndevices={devices!r}",
        [
            jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=getattr(a, "sharding", None))
            for a in leaves
        ],
        {},
        precision=precision.describe(cuda),
        needs_seed=True,
        checks=check,
        out_sharding=out_shardings,
    )


def _lower_step(
    step: StepGraph,
    arrays: StepArrays,
    flat: bool,
    args: Any,
    checks: list[Check],
    traced: dict[str, Any],
    policy: tuple[tuple[str, ...], bool, bool],
) -> jax.stages.Lowered:
    """The step's program lowered for ``args``: its functional graph through the
    whole-graph driver under train_step's ``Policy`` (``policy``: the step's
    ``fallback_ops``, ``strict`` and ``checks``), jitted with its state donated. Fills
    ``checks`` (as its trace records them) and ``traced`` (what the cache stores beside
    the executable)."""
    fallback_ops, strict, check = policy
    # (the first trace's outputs: the same values as the functional graph's)
    state_shapes = _output_shapes(step.joint)[step.state_at : step.aux_at]
    boundary = _boundary(arrays, step.state_in, state_shapes) if flat else None
    program = lower(
        step.functional(),
        Policy(
            TrainStepError,
            "these ops of the training step cannot be part of one XLA program "
            "(or eager PyTorch raises on them):",
            impossible=NEVER | {Reason.EAGER_REFUSES},
            fallback_ops=fallback_ops,
            strict=strict,
            keep_recomputation=True,
            # On a mesh the barrier's predicate (an element of a sharded value) would
            # be a collective per parameter: one device only.
            donated=_donated(step) if arrays.layout.placement.mesh is None else (),
            flatten=(
                tuple(boundary.flat_outputs([1, 1 + step.n_params, step.state_at]))
                if boundary
                else ()
            ),
            measure_costs=_measured_here(arrays),
        ),
    )
    # PyTorch's kernels chosen as faster (convolutions, attention): on the shapes the
    # trace checked they do not fail.
    chosen = [c for c in program.callbacks if c.kernel and c.reason is Reason.PERF]
    traced.update(
        random=program.random,
        state_out=step.state_out,
        state_shapes=state_shapes,
        frozen_out=step.frozen_out,
        aux=aux_text(step.aux),
        kernels=sorted(c.op for c in chosen),
    )
    fn = _step_function(program, step, checks, check, boundary)
    out_shardings = _out_shardings(arrays.layout, step.frozen_out, step.state_out, state_shapes)
    # Donated, the state's buffers are gone once the program starts; a host callback
    # (eager PyTorch) can still raise then, so a step with callbacks other than the
    # chosen kernels keeps them. The outputs keep the state's layout (on a mesh,
    # FSDP's shards stay shards).
    donate = (0,) if len(chosen) == len(program.callbacks) else ()
    return jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings).lower(*args)


def _kernels_line(kernels: list[str]) -> str:
    """The report's line of a program's ops that run PyTorch's kernel, counted."""
    ops = ", ".join(f"{op} x{n}" for op, n in collections.Counter(kernels).items())
    return f"  PyTorch's kernels inside the program, faster than XLA's: {ops}"


def _measured_here(arrays: StepArrays) -> bool:
    """Whether the step's choices between PyTorch's kernel and XLA's (``cost.py``: the
    convolutions) are measured on this machine: on one CPU device, where the kernel
    runs inside the program (``ffi``). (In a GPU's or a mesh's program, XLA's.)"""
    placement = arrays.layout.placement
    return placement.mesh is None and placement.platform == "cpu" and ffi.available()


def _boundary(
    arrays: StepArrays, state_in: Sequence[StateKey], state_shapes: Sequence[tuple[int, ...]]
) -> FlatBoundary | None:
    """Which of the step's arrays cross its program flat (None: none do)."""
    own = [[a.shape for a in arrays.params], [a.shape for a in arrays.buffers]]
    ins = [tuple(arrays.state[k].shape) for k in state_in]
    boundary = FlatBoundary([*own, ins], [*own, state_shapes])
    return boundary if boundary else None


def _out_shardings(
    layout: StateLayout,
    frozen_out: Sequence[int],
    state_out: Sequence[StateKey] | None = None,
    state_shapes: Sequence[tuple[int, ...]] | None = None,
) -> tuple[Any, ...]:
    """The layouts of the step's outputs: (loss, parameters, buffers, optimizer state,
    checks, written frozen parameters). Without ``state_out``, the state's as its
    rule (``StateLayout.state``) for the cache's key, where the state the step
    returns is not known before its trace."""
    state: Any = "each entry as its parameter where of its shape, else replicated"
    if state_out is not None and state_shapes is not None:
        state = [layout.state(k, s) for k, s in zip(state_out, state_shapes, strict=True)]
    return (
        layout.replicated,
        layout.params,
        layout.buffers,
        state,
        layout.replicated,
        [layout.frozen[i] for i in frozen_out],
    )


def _flat_boundary(layout: StateLayout) -> bool:
    """Whether the step's arrays of 3 or more dimensions cross its program flat
    (``training/boundary.py``): on one CPU device, where XLA's CPU compiler emits
    their elementwise updates unvectorized in their own shapes."""
    if layout.placement.mesh is not None:
        return False
    return all(getattr(d, "platform", "") == "cpu" for d in layout.replicated.device_set)


def _step_function(
    program: Any,
    graph: StepGraph,
    checks: list[Check],
    check: bool,
    boundary: FlatBoundary | None = None,
) -> Callable[..., Any]:
    """The JAX function of one step: ``(state, frozen, lrs, seed, xs) -> (loss, params,
    buffers, optimizer state, err, written frozen)``, where eager's value checks
    (``check``) fail, the state it took; ``checks`` is filled by its trace."""
    random = program.random
    n, b = graph.n_params, graph.n_buffers
    after = graph.state_at
    # Where eager raises, the step changes nothing: each output that carries an input
    # (the parameters, buffers, optimizer state and frozen parameters it writes) is
    # that input's value (selected where the program computes it, ``run_graph``).
    frozen_at, frozen_in = 1 + n + b, n + b + len(graph.state_in)
    carried = {out: i for i, out in _donated(graph)}
    carried.update((frozen_at + j, frozen_in + i) for j, i in enumerate(graph.frozen_out))

    def step(state, frozen, lrs, seed, xs):  # type: ignore[no-untyped-def]
        params, buffers, opt_state = boundary.inside(state) if boundary else state
        key = jax.random.key(seed) if random else None
        arrays = [*params, *buffers, *opt_state, *frozen, *lrs, *xs]
        out, err, found = program.run(arrays, key=key, check=check, unless_failed=carried)
        checks[:] = found
        loss = out[0]
        new_params, new_buffers = out[1 : 1 + n], out[1 + n : 1 + n + b]
        new_frozen = out[1 + n + b : after]
        new_state = out[after : graph.aux_at]
        leaving = [list(new_params), list(new_buffers), list(new_state)]
        if boundary:
            leaving = boundary.leaving(leaving)
        return (loss, list(out[graph.aux_at :])), *leaving, err, list(new_frozen)

    return step


def _donated(graph: StepGraph) -> tuple[tuple[int, int], ...]:
    """The step graph's (input, output) pairs whose buffers its program donates: each
    parameter, buffer and optimizer state tensor to its new value."""
    n, b = graph.n_params, graph.n_buffers
    after = graph.state_at
    pairs = [(i, 1 + i) for i in range(n + b)]
    pairs += [
        (n + b + graph.state_in.index(k), after + j)
        for j, k in enumerate(graph.state_out)
        if k in graph.state_in
    ]
    return tuple(pairs)


def _device_ids(sharding: Any) -> tuple[int, ...] | None:
    """The ids of a sharding's devices, in its mesh's order (None: not a sharding, as
    ``_out_shardings``'s rule for the state)."""
    if not hasattr(sharding, "device_set"):
        return None
    devices = getattr(getattr(sharding, "mesh", None), "devices", None)
    if devices is not None:
        return tuple(d.id for d in np.ravel(devices))
    return tuple(sorted(d.id for d in sharding.device_set))


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """What of the param groups a step bakes in (all but ``params`` and ``lr``): a
    change retraces."""
    return tuple(
        tuple(sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "lr")))
        for g in optimizer.param_groups
    )


def _output_shapes(gm: torch.fx.GraphModule) -> list[tuple[int, ...]]:
    """The shapes of the graph's outputs, from their fake values."""
    return [tuple(v.shape) for v in output_vals(gm)]


def _examples(arrays: Sequence[jax.Array], device: torch.device) -> list[torch.Tensor]:
    """Tensors of the arrays' shapes and dtypes on the module's device, for the trace,
    which reads no values (untouched memory, never written)."""
    with _unfilled():
        return [
            torch.empty(a.shape, dtype=JAX_TO_TORCH[np.dtype(a.dtype)], device=device)
            for a in arrays
        ]


def _leave_unfilled() -> Callable[[], None]:
    import torch.utils.deterministic as deterministic

    fill = getattr(deterministic, "fill_uninitialized_memory", False)
    setattr(deterministic, "fill_uninitialized_memory", False)  # noqa: B010 (a property)
    return lambda: setattr(deterministic, "fill_uninitialized_memory", fill)  # noqa: B010


# ``torch.empty`` leaves memory untouched during a trace even under
# ``torch.use_deterministic_algorithms(True)``, which fills it (NaN) by default: the
# trace's example tensors are never read, and filled, a model's worth of pages would be
# resident for nothing.
_unfilled = Held(_leave_unfilled)
