"""Turns an ATen FX graph (one JAX partition) into a pure JAX function.

A ``torch.fx.Interpreter`` that, instead of running torch ops, calls each node's rule
from the lowering table on JAX values. It runs once per trace under ``jax.jit``; the
compiled executable never sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Iterator
from typing import Any

import jax
import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from dynajax import ffi
from dynajax.lowering import checks, nan_constants, transposes
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.lowering.registry import KERNEL_KEY, LAYOUT_KEY, get_rule

aten = torch.ops.aten


def jax_literal(value: Any) -> Any:
    """Translates torch literals in a node's arguments to their JAX equivalents."""
    if isinstance(value, torch.dtype):
        return TORCH_TO_JAX[value]
    if isinstance(value, tuple):
        return tuple(jax_literal(v) for v in value)
    if isinstance(value, list):  # also FX's immutable_list, which JAX cannot flatten
        return [jax_literal(v) for v in value]
    return value


class JaxInterpreter(torch.fx.Interpreter):
    """Runs an ATen graph on JAX values through the lowering table.

    Random rules receive a fresh subkey of ``key`` (split once per random node). Nodes
    that can carry a NaN known at compile time run their rules guarded
    (``nan_constants``). Transposes are noted as they run, so that products read them
    in place (``transposes``).
    """

    def __init__(self, gm: torch.fx.GraphModule, key: jax.Array | None = None) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self._key = key
        self._random_index = 0
        self._node: torch.fx.Node | None = None
        self._nan_carrying = nan_constants.carrying_nan_constants(gm.graph)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with transposes.tracing():  # one trace's transposed values, for the products
            return super().run(*args, **kwargs)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is operator.getitem:
            return args[0][args[1]]
        if self._node is not None and self._node.meta.get(KERNEL_KEY):
            args = [
                _crossing_view(a, v, self.env) for a, v in zip(self._node.args, args, strict=True)
            ]
            return torch_kernel(self._node, args, kwargs)
        rule = get_rule(target)
        if rule is None:  # the capability pass let no such node in
            raise AssertionError(f"{target} reached JAX without a rule")
        args, kwargs = jax_literal(args), {k: jax_literal(v) for k, v in kwargs.items()}
        if rule.needs_key:
            if self._key is None:
                raise AssertionError(f"{target} needs a PRNG key; the partition was given none")
            kwargs["key"] = jax.random.fold_in(self._key, self._random_index)
            self._random_index += 1
        if rule.needs_layout:  # decided by the capability pass (capability/layout.py)
            assert self._node is not None  # set by run_node
            kwargs["layout"] = self._node.meta[LAYOUT_KEY]
        if self._node in self._nan_carrying:
            return nan_constants.guarded(rule.fn, args, kwargs)
        out = rule.fn(*args, **kwargs)
        transposes.note(target, args, out, rule.fn)  # products read transposes in place
        return out

    @contextlib.contextmanager
    def _set_current_node(self, node: torch.fx.Node) -> Iterator[None]:
        """Nothing: ``torch.fx.Interpreter`` would make ``node.meta`` torch.fx's
        *process-wide* current node meta (``fx.traceback.set_current_meta``) whenever
        another thread's trace has turned node-meta preservation on. A partition traces
        at its first call, outside Dynamo's compile lock, so that other trace is
        aot_autograd's joint trace running in another thread, whose backward hooks then
        found their counters gone ("Expected current_level > 0") or recorded this
        graph's meta on its nodes. Lowering reads nodes through ``run_node``, never
        through that global."""
        yield

    def run_node(self, n: torch.fx.Node) -> Any:
        self._node = n
        checks.set_node(n.target, n.meta.get("original_aten"))  # for value checks' messages
        return super().run_node(n)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        raise AssertionError("get_attr nodes never enter a JAX partition")


def torch_kernel(node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
    """The node by PyTorch's own kernel, a custom call inside the program (``ffi``),
    its results nested as the node's; the capability stage chose it (``KERNEL_KEY``)."""
    assert isinstance(node.target, torch._ops.OpOverload)  # (ffi.kernel_refusal)
    structure = node.meta["val"]
    flat = ffi.flat_outputs(structure)
    avals = [jax.ShapeDtypeStruct(tuple(t.shape), TORCH_TO_JAX[t.dtype]) for t in flat]
    outs = ffi.call_kernel(node.target, args, kwargs, avals, [t.dtype for t in flat])
    return ffi.rebuild_outputs(structure, iter(outs))


def _crossing_view(arg: Any, value: Any, env: dict[torch.fx.Node, Any]) -> Any:
    """A kernel's argument ``value``: where its node is a view (``t``, ``transpose``,
    ``permute``, ``unbind``, ``slice``...: free in PyTorch, copies in XLA) of a dense
    traced array, that array and the view as eager has it over the same storage (the
    node's fake tensor's sizes, strides and offset), which the kernel takes
    (``ffi.Strided``); ``value`` otherwise."""
    fake = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(fake, torch.Tensor):
        return value
    base = arg
    while True:
        target = base.target
        if target is operator.getitem and isinstance(base.args[0], torch.fx.Node):
            base = base.args[0]  # (an output of unbind, split: views too)
            continue
        source = base.args[0] if base.args else None
        if (
            isinstance(target, torch._ops.OpOverload)
            and target.is_view
            and target is not aten.view.dtype
            and isinstance(source, torch.fx.Node)
        ):
            base = source
            continue
        break
    whole = base.meta.get("val")
    if (
        base is arg
        or base not in env
        or not isinstance(whole, torch.Tensor)
        or whole.dtype != fake.dtype
        or not whole.is_contiguous()
        or whole.storage_offset() != 0
        or tuple(getattr(env[base], "shape", ())) != tuple(whole.shape)
        or StorageWeakRef(fake.untyped_storage()) != StorageWeakRef(whole.untyped_storage())
    ):
        return value
    layout = (*fake.shape, *fake.stride(), fake.storage_offset())
    if not all(isinstance(v, int) for v in layout):
        return value
    offset = int(fake.storage_offset())
    return ffi.Strided(env[base], tuple(fake.shape), tuple(fake.stride()), offset)


def input_vals(gm: torch.fx.GraphModule) -> list[Any]:
    """The ``meta["val"]`` of each input of ``gm`` (its fake tensor or SymInt)."""
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def output_vals(gm: torch.fx.GraphModule) -> list[Any]:
    """The ``meta["val"]`` of each output of ``gm`` (a non-node output as itself)."""
    for node in reversed(gm.graph.nodes):
        if node.op == "output":
            out = node.args[0]
            outs = out if isinstance(out, list | tuple) else [out]
            return [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in outs]
    return []


def random_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of the graph whose rules draw random numbers (each takes a key)."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            rule = get_rule(node.target)
            if rule is not None and rule.needs_key:
                found.append(node)
    return found


def to_jax_function(
    gm: torch.fx.GraphModule, *, value_checks: bool = False
) -> Callable[..., tuple[jax.Array, ...]]:
    """A pure function ``fn([seed,] *arrays) -> tuple of arrays`` computing ``gm``.

    Graphs with random ops take a leading integer seed, from which every random node
    gets its own key.

    With ``value_checks``, the function is a ``checks.CheckedFunction``: each trace
    records the rules' value checks (``lowering/checks.py``) in its ``table`` and, when
    there are any, returns one more output last, the int64 vector ``[code, *payload]``
    of the first failing check (code 0: none failed).
    """
    run: Callable[..., tuple[jax.Array, ...]]
    if random_nodes(gm):

        def fn_with_seed(seed: jax.Array, *arrays: jax.Array) -> tuple[jax.Array, ...]:
            return tuple(JaxInterpreter(gm, jax.random.key(seed)).run(*arrays))

        run = fn_with_seed
    else:

        def fn(*arrays: jax.Array) -> tuple[jax.Array, ...]:
            return tuple(JaxInterpreter(gm).run(*arrays))

        run = fn
    if not value_checks:
        return run
    table = checks.CheckTable()

    def checked(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        if checks.is_suspended():
            return run(*arrays)
        with checks.collecting() as found:
            outs = run(*arrays)
        table.record(found.checks)
        return (*outs, found.result()) if found.checks else outs

    return checks.CheckedFunction(checked, table)


@dataclasses.dataclass(frozen=True)
class LoweredPartition:
    """One JAX partition, lowered: everything placement and the runtime read of it,
    answered here once (``lower_partition``), so that neither asks the lowering again.

    ``fn`` is ``fn([seed,] *arrays) -> tuple of arrays``; it takes the leading int64
    seed where ``needs_key``. With value checks on, its traces record them in ``checks``
    and, where there are any, return the ``[code, *payload]`` vector last.
    """

    name: str  # jax_<n>, the stitched graph's submodule
    graph: torch.fx.GraphModule  # the ATen graph it computes (kept for reports)
    fn: Callable[..., tuple[jax.Array, ...]]
    input_vals: tuple[Any, ...]  # each input's meta["val"]: fake tensor or SymInt
    output_vals: tuple[Any, ...]  # each output's meta["val"] (a non-node output itself)
    checks: checks.CheckTable | None  # the value checks its traces record (None: off)
    needs_key: bool  # it has random ops: ``fn`` takes the seed


def lower_partition(
    name: str, gm: torch.fx.GraphModule, *, value_checks: bool = True
) -> LoweredPartition:
    """The partition ``gm`` (a ``jax_<n>`` of the stitched graph) lowered to JAX."""
    fn = to_jax_function(gm, value_checks=value_checks)
    return LoweredPartition(
        name,
        gm,
        fn,
        tuple(input_vals(gm)),
        tuple(output_vals(gm)),
        fn.table if isinstance(fn, checks.CheckedFunction) else None,
        bool(random_nodes(gm)),
    )
