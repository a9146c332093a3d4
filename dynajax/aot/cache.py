"""aot_autograd's result, cached across processes: its inference graphs, and its training
graphs with the structures that rebuild their autograd wrapper (``rebuild.py``).

A warm process finds each partition's executable by its program (``runtime/cache.py``), so
what its first call still repeats is Dynamo's trace and aot_autograd's: functionalizing
and decomposing Dynamo's graph into the ATen graphs that dynajax partitions (and, for
training, the joint trace and the min-cut partition). This module keeps those graphs,
the way inductor's AOT-autograd cache keeps its own, in the same authenticated
directory as the executables:

    key   = sha256(kind "aot", format, the description below)
    entry = <dir>/<key>.aot: authenticated as executables are, body (versions(),
            pickle((kind, body))), kind "inference": (GraphPickler bytes of the ATen
            inference graph, the positions of the inputs its first outputs write
            back); kind "training": rebuild.TrainingRecord (both graphs, and
            aot_autograd's metadata and wrappers)

    description = entry format | Python version | the modes that change what
                  aot_autograd traces (grad mode, inference mode, default dtype,
                  deterministic algorithms, functorch's config) | every node of
                  Dynamo's graph: op, name, target by qualified name, arguments, and
                  the source line it came from (the ATen nodes keep it for the report)
                  | every example input: type, dtype, shape, stride, offset, device,
                  requires_grad, leaf, which inputs share a storage | the values of
                  tensor constants

What is known only by name must be code the versions cover: a graph whose targets lie
outside torch, ``operator``, ``builtins`` and ``math`` (a function the user allowed in
the graph) is not cached, nor one with tensor subclasses, dynamic shapes (symbolic
sizes are guards aot_autograd adds to Dynamo's shape environment), or an ATen graph
with ops other than ATen's (a custom op's fake kernel is the user's code). Versions of
torch, jax, dynajax and a digest of dynajax's sources are compared when an entry loads
(``stale entry (torch changed)``).

Inference graphs are stored where aot_autograd's runtime wrapper would do nothing but
write inputs back (``compile._runtime_wrapper_plan``): for them dynajax already calls the
compiled graph without that wrapper, so a loaded graph runs exactly as a traced one.
Training graphs are stored with what rebuild.py records while aot_autograd traces
them, and a hit rebuilds aot_autograd's autograd.Function with its own code.

On a hit each ATen graph (with its fake-tensor metadata, under Dynamo's fake mode) goes
through dynajax's passes, verdicts and partitions as a traced one does, and its
partitions' executables load by their programs: nothing is traced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import operator
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from dynajax.store import BlobStore

log = logging.getLogger("dynajax.cache")

# Modules whose functions a cached Dynamo graph may call by name: their code is that of
# the torch (or Python) version the entry is checked against.
_KNOWN_MODULES = frozenset({"torch", "operator", "_operator", "builtins", "math"})
_LITERALS = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout)
_CONSTANT_BYTES = 1 << 22  # tensor constants up to 4 MiB are hashed into the key
_ENTRY_FORMAT = 2  # 2: (kind, body) payloads, training graphs among them


class Uncacheable(Exception):
    """The graph cannot be keyed; the message says why (a miss reason)."""


class Lookup:
    """One Dynamo graph's entry: its key (None where it cannot have one), and what
    became of it (``status``: shown in the reports of the graphs that ``follow`` it)."""

    def __init__(self, cache: BlobStore | None, key: str | None, status: str) -> None:
        self.cache = cache
        self.key = key
        self.miss = ""
        self.reports: list[Any] = []
        self._status = status

    def _missed(self, why: str) -> None:
        self.miss = why
        self.status = f"traced (cache miss: {why})"

    def load(self) -> Stored | None:
        """The stored entry (an inference graph and its write-back plan, or a training
        graph's record), or None (a miss, whose reason becomes ``status``)."""
        if self.key is None or self.cache is None:
            return None
        payload, why = self.cache.load_value("aot", self.key)
        if payload is None:
            self._missed(why)
            return None
        try:
            kind, body = pickle.loads(payload)
            if kind == "inference":
                data, plan = body
                stored = Stored(kind, graph=load_aten_graph(data), plan=list(plan))
            elif kind == "training":
                stored = Stored(kind, record=body)
            else:
                raise ValueError(f"an entry of kind {kind!r}")
        except Exception as e:  # noqa: BLE001 - an authentic entry this torch cannot read
            self._missed(f"unloadable entry, {type(e).__name__}")
            log.info("cannot load aot_autograd's graph %s: %s", self.key[:16], e)
            return None
        self.status = "loaded from the cache (not traced)"
        log.debug("aot cache hit: %s", self.key[:16])
        return stored

    def unloadable(self, error: Exception) -> None:
        """A loaded entry that could not be used (its graphs rebuilt): traced instead."""
        self._missed(f"unloadable entry, {type(error).__name__}")
        log.info("cannot rebuild aot_autograd's result %s: %s", (self.key or "")[:16], error)

    def serialize(self, graph: torch.fx.GraphModule) -> bytes | None:
        """The ATen graph as stored, or None where it cannot be (``status`` says why).
        Called before dynajax's passes change the graph."""
        if self.key is None:
            return None
        try:
            return serialize_aten_graph(graph)
        except Uncacheable as e:
            self.not_stored(str(e))
            return None

    def store(self, kind: str, body: Any) -> None:
        """Stores an inference graph (``body``: its bytes and write-back plan) or a
        training graph's record (``rebuild.TrainingRecord``)."""
        assert self.key is not None and self.cache is not None
        payload = pickle.dumps((kind, body))
        if self.cache.store_value("aot", self.key, payload, f"aot_autograd's {kind} graph"):
            self.status = f"traced and stored in the cache (cache miss: {self.miss})"

    def not_stored(self, why: str) -> None:
        if self.key is not None:
            self.status = f"traced (not cached: {why})"

    @property
    def status(self) -> str:
        return self._status

    @status.setter
    def status(self, text: str) -> None:
        # The reports of graphs compiled before the entry was stored follow it.
        self._status = text
        for report in self.reports:
            report.aot = text

    def follow(self, report: Any) -> None:
        """``report.aot`` shows this entry's status from now on."""
        report.aot = self._status
        self.reports.append(report)


@dataclasses.dataclass
class Stored:
    """A loaded entry: ``inference`` (``graph``, ``plan``) or ``training`` (``record``)."""

    kind: str
    graph: torch.fx.GraphModule | None = None
    plan: list[int] = dataclasses.field(default_factory=list)
    record: Any = None


def serialize_aten_graph(graph: torch.fx.GraphModule) -> bytes:
    """An ATen graph as GraphPickler bytes (fake-tensor metadata kept). Raises
    Uncacheable for a graph with ops other than ATen's (a custom op's fake kernel is the
    user's code) or one the pickler refuses."""
    foreign = sorted(
        {
            str(n.target)
            for n in graph.graph.nodes
            if n.op == "call_function"
            and not (
                n.target is operator.getitem
                or (
                    isinstance(n.target, torch._ops.OpOverload)
                    and n.target.namespace in ("aten", "prims")
                )
            )
        }
    )
    if foreign:
        raise Uncacheable(f"the ATen graph calls {', '.join(foreign[:3])}")
    try:
        return _graph_pickler().dumps(graph, _pickle_options())
    except Exception as e:  # noqa: BLE001 - whatever the pickler refuses: not cached
        raise Uncacheable(f"the ATen graph cannot be serialized: {type(e).__name__}: {e}") from e


def load_aten_graph(data: bytes) -> torch.fx.GraphModule:
    """A graph ``serialize_aten_graph`` stored, its fake tensors in Dynamo's fake mode."""
    graph = _graph_pickler().loads(data, _fake_mode())
    if not isinstance(graph, torch.fx.GraphModule):
        raise TypeError(f"a stored graph loaded as {type(graph).__name__}")
    return graph


def lookup(
    cache: BlobStore | None, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
) -> Lookup:
    """The entry of Dynamo's graph ``gm`` called with ``example_inputs`` (without a
    cache: no key, status ``traced``)."""
    if cache is None or cache.directory is None:
        return Lookup(cache, None, "traced")
    if _graph_pickler() is None:
        return Lookup(cache, None, "traced (not cached: this torch lacks torch.fx's GraphPickler)")
    try:
        description = describe(gm, example_inputs)
    except Uncacheable as e:
        return Lookup(cache, None, f"traced (not cached: {e})")
    return Lookup(cache, cache.value_key("aot", description), "traced")


def describe(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """Everything that decides aot_autograd's ATen graph for this call, as text.

    Raises Uncacheable where the graph or its inputs hold something the text could
    not cover."""
    lines = [
        f"entry format {_ENTRY_FORMAT}",
        f"python{sys.version_info[0]}.{sys.version_info[1]}",
        _modes(),
    ]
    lines.extend(_describe_graph(gm, "", set()))
    storages: dict[Any, int] = {}
    for i, x in enumerate(example_inputs):
        lines.append(f"input {i}: {_describe_input(x, storages)}")
    for node in gm.graph.nodes:
        # Symbolic sizes and scalars (dynamic shapes, .item() under
        # capture_scalar_outputs) live in Dynamo's shape environment, with guards
        # aot_autograd adds to it: a graph stored from another environment would not
        # carry them.
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool) or (
            isinstance(value, torch.Tensor) and _symbolic(value)
        ):
            raise Uncacheable("dynamic shapes")
    return "\n".join(lines)


def _modes() -> str:
    config = torch._functorch.config.get_config_copy()
    return "|".join(
        [
            f"grad={torch.is_grad_enabled()}",
            f"inference={torch.is_inference_mode_enabled()}",
            f"dtype={torch.get_default_dtype()}",
            f"deterministic={torch.are_deterministic_algorithms_enabled()}",
            f"autocast={torch._C._is_any_autocast_enabled()}",
            "functorch=" + repr(sorted((k, repr(v)) for k, v in config.items())),
        ]
    )


def _describe_graph(gm: torch.fx.GraphModule, prefix: str, seen: set[int]) -> list[str]:
    if id(gm) in seen:
        return [f"{prefix}(graph seen above)"]
    seen.add(id(gm))
    lines = []
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            value = _attribute(gm, node.target)
            if isinstance(value, torch.fx.GraphModule):
                lines.append(f"{prefix}{node.op} {node.name} = graph {node.target}:")
                lines.extend(_describe_graph(value, prefix + "  ", seen))
                continue
            if node.op == "get_attr" and isinstance(value, torch.Tensor):
                lines.append(f"{prefix}get_attr {node.name} = {_describe_constant(value)}")
                continue
            raise Uncacheable(f"{node.op} {node.target} is a {type(value).__name__}")
        target = node.target if isinstance(node.target, str) else _target(node.target)
        args = _describe_arg(node.args)
        kwargs = _describe_arg(node.kwargs)
        lines.append(f"{prefix}{node.op} {node.name} = {target}{args} {kwargs}")
        # The ATen nodes inherit it, and the report shows it: a moved line is a miss.
        if node.meta.get("stack_trace"):
            lines.append(f"{prefix}  at {node.meta['stack_trace'].strip()}")
    return lines


def _attribute(gm: torch.nn.Module, path: str) -> Any:
    value: Any = gm
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _target(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return f"op:{target}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop:{target.name()}"
    owner = getattr(target, "__objclass__", None)  # a method of a C type (Tensor.add)
    module = getattr(target, "__module__", None) or getattr(owner, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if not name or module.split(".")[0] not in _KNOWN_MODULES:
        raise Uncacheable(f"the graph calls {module}.{name}, which is not torch's or Python's")
    return f"{module}.{name}"


def _describe_arg(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, list | tuple):
        inner = ",".join(_describe_arg(v) for v in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        inner = ",".join(f"{k!r}:{_describe_arg(v)}" for k, v in value.items())
        return f"{{{inner}}}"
    if isinstance(value, slice):
        return f"slice({_describe_arg((value.start, value.stop, value.step))})"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if value is None or value is Ellipsis or isinstance(value, _LITERALS):
        return repr(value)
    if isinstance(value, torch.memory_format):
        return str(value)
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise Uncacheable("dynamic shapes")
    raise Uncacheable(f"an argument of type {type(value).__name__}")


def _describe_constant(t: torch.Tensor) -> str:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu":
        raise Uncacheable(f"a tensor constant of type {type(t).__name__} on {t.device}")
    size = t.numel() * t.element_size()
    if size > _CONSTANT_BYTES:
        raise Uncacheable(f"a tensor constant of {size} bytes")
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    digest = hashlib.sha256(data).hexdigest()
    return f"constant {t.dtype}{list(t.shape)} {tuple(t.stride())} {digest[:32]}"


def _symbolic(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride()))


def _describe_input(x: Any, storages: dict[Any, int]) -> str:
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise Uncacheable(f"an input of tensor subclass {type(x).__name__}")
        if _symbolic(x):
            raise Uncacheable("dynamic shapes")
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = storages.setdefault(StorageWeakRef(x.untyped_storage()), len(storages))
        return (
            f"{type(x).__name__} {x.dtype}{list(x.shape)} stride={tuple(x.stride())} "
            f"offset={x.storage_offset()} {x.device} requires_grad={x.requires_grad} "
            f"leaf={x.is_leaf} storage={storage} inference={x.is_inference()}"
        )
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise Uncacheable("dynamic shapes")
    return _describe_arg(x)


def _fake_mode() -> Any:
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.fake_mode is not None:
        return context.fake_mode
    return torch._subclasses.FakeTensorMode()


def _graph_pickler() -> Any:
    try:
        from torch.fx._graph_pickler import GraphPickler
    except ImportError:  # (torch releases before it)
        return None
    return GraphPickler


def _pickle_options() -> Any:
    from torch.fx._graph_pickler import Options

    # Provenance (from_node) is most of a graph's bytes and nothing here reads it; the
    # module stacks hold objects that do not pickle (torch's own filter drops them).
    drop = {"from_node", "source_fn_stack", "nn_module_stack", "fwd_source_fn_stack"}
    return Options(
        ops_filter=lambda name: name.startswith(("torch.ops.aten.", "torch.ops.prims.")),
        node_metadata_key_filter=lambda key: key not in drop,
    )
