"""Why it compiled again: Dynamo's recompiles and the partitions' new executables.

Two kinds of compile follow a function's first, and the report lists both under
``recompiles`` (``GraphReport.lines``):

* Dynamo compiles a frame again when a guard of each of its compiled graphs fails (a
  new dtype, a size it specialized on, a global, another backend). Dynamo records each
  failure in ``torch._dynamo.utils.guard_failures`` (code -> ``"0/0: tensor 'x' dtype
  mismatch. expected Float, actual Double"``, the failed entry's compile id first) as it
  decides to recompile, before it calls the backend. ``dynamo_compile`` finds, while
  the backend compiles, the failures that led to this compile (``DynamoCompile``); every
  graph of that Dynamo graph (forward, backward) carries them.
* A partition compiles another executable for a new shape or bucket, or one its LRU
  dropped (``runtime/executables.py``), and a persistent-cache entry may be refused
  (stale, corrupt): each is a ``CompileEvent`` of the graph's ``CompileStats``.

Everything here runs at compile time; a call of a compiled graph records nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from typing import Any

from dynajax.runtime.cache import CompileEvent, CompileStats

log = logging.getLogger("dynajax.backend")

# Dynamo's own advice after a backend mismatch, which a new dynajax.Backend (a changed
# option) makes on purpose: the report says what changed instead.
_BACKEND_MATCH = "BACKEND_MATCH failure"
_ADVICE = " If this is unexpected"
# A global torch setting (grad mode, deterministic algorithms, the default dtype...).
_GLOBAL_STATE = "GLOBAL_STATE changed"


@dataclasses.dataclass(frozen=True)
class DynamoCompile:
    """Dynamo's compile that produced a graph.

    Attributes:
        compile_id: Dynamo's id, ``<frame>/<compile of that frame>`` (``0/1``: frame 0's
            second compile, a recompile).
        failures: the guard failures that made Dynamo compile the frame again, as Dynamo
            recorded them (``0/0: tensor 'x' dtype mismatch. expected Float, actual
            Double``: the guard of compile ``0/0`` that failed); empty for a first compile.
        backends: for a failure of the backend-match guard, what changed against that
            compile's backend, by its compile id (``min_block_size 1 -> 3``).
        graph_break: where the graph ended at a graph break, Dynamo's reason and the
            user's line (``Attempted to wrap RNN, GRU, or LSTM at model.py:12``): what
            follows ran in Python until the next graph; "" where it ended at a return.
    """

    compile_id: str
    failures: tuple[str, ...] = ()
    backends: dict[str, str] = dataclasses.field(default_factory=dict)
    graph_break: str = ""

    @property
    def recompile(self) -> bool:
        return not self.compile_id.endswith("/0")

    def reasons(self) -> list[str]:
        """The failures, one line each, grouped by text: ``0/0, 0/2: BACKEND_MATCH ...``."""
        by_text: dict[str, list[str]] = collections.defaultdict(list)
        for failure in self.failures:
            first = failure.splitlines()[0] if failure else ""
            entry, sep, text = first.partition(": ")
            if not sep:
                entry, text = "", first
            if text.startswith(_GLOBAL_STATE):  # Dynamo names the setting, no more
                text = f"{text.strip()} (differs from the call Dynamo compiled for)"
            if text.startswith(_BACKEND_MATCH):
                change = self.backends.get(entry)
                text = (
                    f"{_BACKEND_MATCH}: another backend ({change})"
                    if change
                    else text.split(_ADVICE)[0]
                )
            by_text[text].append(entry)
        out = []
        for text, entries in by_text.items():
            ids = ", ".join(sorted((e for e in entries if e), key=_numbers))
            out.append(f"{ids}: {text}" if ids else text)
        return out


def _numbers(compile_id: str) -> list[int]:
    """``0/10`` -> [0, 10]: compile ids in their order."""
    return [int(n) for n in re.findall(r"\d+", compile_id)]


def dynamo_compile(options: Any, gm: Any = None) -> DynamoCompile | None:
    """The Dynamo compile in progress, with the guard failures that caused it (None
    outside one). ``options``: the compiling backend's, to say what changed against a
    cached graph's backend; ``gm``: Dynamo's graph, whose ``compile_subgraph_reason``
    says whether it ended at a graph break. Call from the backend, which Dynamo calls
    in its compile."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    if cid is None or cid.frame_id is None or cid.frame_compile_id is None:
        return None
    compile_id = str(cid)
    graph_break = _graph_break(gm)
    if cid.frame_compile_id == 0:
        return DynamoCompile(compile_id, graph_break=graph_break)
    try:
        code, failures = _failures_of(compile_id)
        backends = _backend_changes(code, failures, options) if code is not None else {}
    except Exception as e:  # noqa: BLE001 - Dynamo's internals: a report never fails a compile
        log.debug("cannot read Dynamo's guard failures for %s: %s", compile_id, e)
        return DynamoCompile(compile_id, graph_break=graph_break)
    return DynamoCompile(compile_id, tuple(failures), backends, graph_break)


def _graph_break(gm: Any) -> str:
    """``reason at file:line`` where Dynamo's graph ``gm`` ended at a graph break."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return ""
    text = str(reason.reason).strip().splitlines()
    first = text[0] if text else "a graph break"
    if first == "step_unsupported":  # Dynamo's name for a break it could not resume
        first = "code Dynamo does not trace (dynajax.explain says which)"
    stack = list(getattr(reason, "user_stack", None) or [])
    where = f" at {stack[-1].filename}:{stack[-1].lineno}" if stack else ""
    return first + where


def _failures_of(compile_id: str) -> tuple[Any, list[str]]:
    """The frame's code and the guard failures Dynamo recorded last for it: one per
    compiled entry of the frame, each prefixed by that entry's compile id, appended
    together just before this compile (an entry's id repeats in an earlier batch)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import guard_failures

    frame = compile_id.rsplit("/", 1)[0] + "/"
    for code, recorded in list(guard_failures.items()):
        if not recorded or not str(recorded[-1]).startswith(frame):
            continue
        # The frame's compiled entries now, whose guards were checked: none (they were
        # dropped) and Dynamo checked no guard, so the failures recorded are older.
        entries = {str(e.compile_id) for e in _debug_get_cache_entry_list(code)}
        if not entries:
            return code, []
        batch: list[str] = []
        seen: set[str] = set()
        for failure in reversed(recorded):
            entry = str(failure).partition(": ")[0]
            if entry in seen or entry not in entries:
                break
            seen.add(entry)
            batch.append(str(failure))
        return code, batch[::-1]
    return None, []


def _backend_changes(code: Any, failures: list[str], options: Any) -> dict[str, str]:
    """For each backend-match failure, what differs between the backend of the failed
    entry and this one: the dynajax options that changed, or that it is another
    ``dynajax.Backend`` with the same options, or another backend altogether."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    wanted = {f.partition(": ")[0] for f in failures if _BACKEND_MATCH in f}
    if not wanted:
        return {}
    out = {}
    for entry in _debug_get_cache_entry_list(code):
        cid = str(entry.compile_id)
        if cid in wanted:
            out[cid] = _compare(_options_of(entry.backend), options)
    return out


def _options_of(backend: Any) -> Any:
    """The dynajax options of a cached entry's backend (None: not dynajax)."""
    from dynajax.config import Options

    fn = getattr(backend, "compiler_fn", backend)  # torch.compile's _TorchCompileWrapper
    found = getattr(fn, "options", None)
    if isinstance(found, Options):
        return found
    if getattr(backend, "compiler_name", None) == "dynajax":  # backend="dynajax"
        try:
            return Options.resolve(dict(backend.kwargs.get("options") or {}))
        except Exception:  # noqa: BLE001 - options that no longer resolve
            return None
    return None


def _compare(old: Any, new: Any) -> str:
    if old is None or new is None:
        return "the cached graph's was not dynajax"
    changed = [
        f"{f.name} {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}"
        for f in dataclasses.fields(old)
        if _differs(getattr(old, f.name), getattr(new, f.name))
    ]
    if not changed:
        return "a new dynajax.Backend with the same options: reuse the first to compile once"
    return "options changed: " + ", ".join(changed)


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except Exception:  # noqa: BLE001 - a mesh or a rule object without a plain ==
        return a is not b


def lines(
    dynamo: DynamoCompile | None, stats: CompileStats | None, indent: str = "  "
) -> list[str]:
    """The ``recompiles`` block of a graph's report: Dynamo's guard failures (for a graph
    of a recompile), then each executable after a partition's first, and each refused
    cache entry, grouped by partition and reason with a count. Empty when none."""
    out = []
    if dynamo is not None and dynamo.recompile:
        reasons = dynamo.reasons() or ["no guard failure recorded"]
        out.append(f"{indent}  Dynamo compiled the frame again (compile {dynamo.compile_id}):")
        out.extend(f"{indent}    {r}" for r in reasons)
    if stats is not None:
        groups: dict[tuple[str, str, str], list[CompileEvent]] = {}
        for e in stats.recompiles():
            groups.setdefault((e.partition, e.reason, e.refused), []).append(e)
        for (partition, reason, refused), events in groups.items():
            out.append(f"{indent}  {_event_line(partition, reason, refused, events)}")
    return [f"{indent}recompiles:", *out] if out else []


def _event_line(partition: str, reason: str, refused: str, events: list[CompileEvent]) -> str:
    shapes = [e.inputs for e in events[:3]]
    more = f" (+{len(events) - 3} more)" if len(events) > 3 else ""
    count = f" x{len(events)}" if len(events) > 1 else ""
    loaded = sum(e.loaded for e in events)
    how = (
        "loaded"
        if loaded == len(events)
        else "compiled"
        if not loaded
        else f"{len(events) - loaded} compiled, {loaded} loaded"
    )
    why = reason if not refused else f"{reason}; cache entry refused: {refused}"
    inputs = "; ".join(shapes) + more
    return f"{partition} {why}{count}: {inputs} ({how} in {_took(events)})"


def _took(events: list[CompileEvent]) -> str:
    seconds = sum(e.seconds for e in events)
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.0f} ms" if seconds >= 1e-3 else "<1 ms"
