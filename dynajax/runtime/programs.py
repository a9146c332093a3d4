"""What a partition's program depends on, described before it is traced.

The persistent cache (``cache.py``) can key an executable by its lowered StableHLO, but
getting that text means tracing the partition through the rule table and lowering it,
which a warm process then repeats for nothing: on the benchmark models it is most of
what dynajax itself spends on a warm first call (0.08-0.16 s of it). A partition's
program is a function of things known before tracing, so the cache keys it by them:

* the partition's ATen graph: its generated code (targets, literal arguments, wiring)
  and, per node, what rules read besides the arguments: the fake tensor's shape,
  strides, storage offset and dtype, the layout the capability pass recorded
  (``LAYOUT_KEY``) and the op the user called (``original_aten``, which picks a value
  check's message);
* the call: the abstract inputs (shapes, dtypes, shardings), the sizes bound as
  static ints, whether a seed comes first, whether value checks are on, the output
  sharding;
* the global settings rules and tracing read: the float32 matmul precision, torch's
  default dtype, whether oneDNN is on (half-precision convolutions follow eager's
  kernel), eager's CPU capability and thread count (half-precision softmax follows
  where eager's kernel vectorizes, ``lowering/eager_cpu.py``), and the JAX settings
  that change what a trace computes (the PRNG implementation and its partitionable
  mode, promotion rules);
* what compiles it (``cache.py`` adds these to the key): the device, the host CPU's
  features, ``XLA_FLAGS`` and the compiler options; and, checked when an entry is
  loaded, the versions of jax, jaxlib, torch and dynajax and a digest of dynajax's own
  sources (the rules are code: an edited rule must not reuse a program it no longer
  makes), so that an entry from another version is a miss with that reason.

A graph that runs a rule the user registered (``dynajax.register_rule``: arbitrary
Python, which no digest of dynajax's sources covers) is not described: the cache then
keys its executables by their StableHLO as before.

A whole-graph program (``train_step``'s) is keyed the same way by the graph it is
made from before its passes run (``describe_graph``): the first trace of the step,
whose nodes are everything the user's Python computed (the forward, torch's backward
formulas, the optimizer's update), whose tensor constants are hashed by value, and
whose later stages (functionalization, decompositions, passes, verdicts, lowering) are
dynajax's and torch's code, which the versions cover. A graph that calls anything but
torch's own ops (a custom op, a JAX function, a higher-order op), or any graph
while a user rule is registered (it may lower an op that a decomposition makes), is
not described.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from collections.abc import Sequence
from typing import Any

import jax
import torch
import torch.fx

from dynajax.lowering import eager_cpu
from dynajax.lowering.registry import LAYOUT_KEY, get_rule, user_rule_ops

log = logging.getLogger("dynajax.cache")

# JAX settings that change what tracing a rule computes (random bits, promotion).
_JAX_SETTINGS = (
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
)


def describe_partition(graph: torch.fx.GraphModule, name: str = "") -> str | None:
    """The partition's ATen graph as text, everything its lowering reads included; None
    (with the reason logged) when a user's rule lowers one of its nodes."""
    parts = [graph.code]
    for node in graph.graph.nodes:
        if node.op == "call_function":
            rule = get_rule(node.target)
            if rule is not None and getattr(rule, "user", False):
                log.debug(
                    "%s: keyed by its StableHLO, not before tracing: %s has a user rule",
                    name,
                    node.target,
                )
                return None
        parts.append(
            f"{node.name}|{_describe(node.meta.get('val'))}|{node.meta.get(LAYOUT_KEY)!r}"
            f"|{node.meta.get('original_aten')}"
        )
    return "\n".join(parts)


# The namespaces of ops that are torch's own code (the profiler's: the markers
# ``optimizer.step()`` records, which the functional graph drops).
_TORCH_OPS = frozenset({"aten", "prims", "profiler"})


def describe_graph(graph: torch.fx.GraphModule, name: str = "") -> str | None:
    """A whole-graph program's source graph as text (``describe_partition``'s, with the
    values of its tensor constants); None (the reason logged) where it cannot be
    described: a user rule is registered, or a node is not an ATen or prims op."""
    users = user_rule_ops()
    if users:
        log.debug("%s: not described: a user rule is registered (%s)", name, users[0])
        return None
    constants = []
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        target = node.target
        if node.op == "get_attr":
            value = getattr(graph, str(target), None)
            if not isinstance(value, torch.Tensor) or isinstance(
                value, torch._subclasses.FakeTensor
            ):
                log.debug("%s: not described: %s is not a tensor constant", name, target)
                return None
            constants.append(f"{target}={_digest(value)}")
            continue
        if node.op != "call_function" or not (
            target is operator.getitem
            or (isinstance(target, torch._ops.OpOverload) and target.namespace in _TORCH_OPS)
        ):
            log.debug("%s: not described: it calls %s", name, target)
            return None
    text = describe_partition(graph, name)
    return None if text is None else "\n".join([text, *constants])


def _digest(t: torch.Tensor) -> str:
    """A tensor constant's value and layout, as a digest."""
    t = t.detach()
    data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    h = hashlib.sha256(data)
    h.update(f"{t.dtype}{tuple(t.shape)}{t.stride()}{t.device.type}".encode())
    return h.hexdigest()


def describe_call(
    partition: str,
    avals: Sequence[jax.ShapeDtypeStruct],
    statics: dict[int, Any],
    *,
    precision: str,
    needs_seed: bool,
    checks: bool,
    out_sharding: Any,
    keep_unused: bool = False,
) -> str:
    """One executable of the partition ``partition`` (``describe_partition``'s text):
    its abstract inputs and static sizes, and the settings its trace reads."""
    h = hashlib.sha256(partition.encode())
    settings = f"precision={precision} seed={needs_seed} checks={checks} out={out_sharding!r}"
    for part in (
        repr([(tuple(a.shape), str(a.dtype), repr(a.sharding)) for a in avals]),
        repr(sorted(statics.items())),
        settings + (" keep_unused" if keep_unused else ""),
        f"default_dtype={torch.get_default_dtype()}",
        f"mkldnn={torch.backends.mkldnn.is_available()},{torch.backends.mkldnn.enabled}",
        eager_cpu.settings(),
        repr([(s, getattr(jax.config, s, None)) for s in _JAX_SETTINGS]),
    ):
        h.update(b"\x00")
        h.update(part.encode())
    return h.hexdigest()


def _describe(value: Any) -> str:
    """A node's ``meta["val"]``: what of it a rule can read."""
    if isinstance(value, torch.Tensor):
        return (
            f"T({_sizes(value.shape)},{_sizes(value.stride())},{value.storage_offset()},"
            f"{value.dtype},{value.device.type})"
        )
    if isinstance(value, list | tuple):
        return "[" + ",".join(_describe(v) for v in value) + "]"
    if isinstance(value, torch.SymInt | torch.SymBool | torch.SymFloat | int | float | bool):
        return str(value)
    return type(value).__name__


def _sizes(sizes: Sequence[Any]) -> str:
    return "(" + ",".join(str(s) for s in sizes) + ")"
