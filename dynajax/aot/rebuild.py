"""aot_autograd's training wrapper: recorded when a training graph is traced, rebuilt
from the cache in a later process.

For a training graph aot_autograd returns more than two graphs: an autograd.Function
whose forward runs the compiled forward graph and saves what the backward needs,
inside runtime wrappers built from its analysis of the program (``ViewAndMutationMeta``:
inputs mutated in place and written back, outputs that alias inputs regenerated,
inputs to detach) and dispatch wrappers (duplicated inputs, synthetic bases). Inductor's
AOT-autograd cache keeps these structures with its compiled graphs and rebuilds the
function with aot_autograd's own code (``GenericAOTAutogradResult.wrap_post_compile``),
so that a hit runs the very wrappers a trace builds. dynajax does the same with its own
graphs and its own authenticated cache:

* **Recording.** While aot_autograd traces a training graph for dynajax, the call in
  which it would hand its pieces to its own cache (``graph_compile._cache_autograd_info``:
  the metadata after ``make_runtime_safe``, the dispatch wrappers, the number of forward
  outputs saved for the backward, the inputs to detach, the backward graph) is
  recorded. dynajax wraps that function once, process-wide; the wrapper calls it
  unchanged and records its arguments only inside dynajax's own compiles (a context
  variable), so other backends never see a difference. The forward graph is serialized
  by dynajax's forward compiler before its passes change it, the backward graph as
  aot_autograd hands it over (it compiles lazily, at the first backward call).
* **Rebuilding.** A hit loads both ATen graphs (``GraphPickler``, fake-tensor metadata
  under Dynamo's fake mode) and the structures, compiles each graph with dynajax (its
  partitions' executables load by their programs), and lets aot_autograd's
  ``wrap_post_compile`` build the autograd.Function and its wrappers around them.

What a torch release lacks (the recording point, the result class, a field of
either) makes a training graph "not cached" with that reason; it never fails a
compile. Not recorded: graphs whose backward saves symbolic sizes (dynamic shapes, not
keyed anyway), tensor-subclass inputs, compiled autograd's backward state, and Dynamo
graphs holding their parameters as attributes (``num_params_buffers``; with
``inline_inbuilt_nn_modules``, torch's default, parameters are graph inputs).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

import dynajax.aot.cache as aot_cache

log = logging.getLogger("dynajax.cache")


@dataclasses.dataclass
class TrainingRecord:
    """What a hit needs besides Dynamo's graph: both ATen graphs (GraphPickler bytes) and
    aot_autograd's structures (pickled: metadata, dispatch wrappers, cacheable config,
    saved-output count, inputs to detach)."""

    forward: bytes
    backward: bytes
    structures: bytes


class Recorder:
    """Collects one training graph's pieces while aot_autograd traces it."""

    def __init__(self) -> None:
        self.training = False  # a training graph's forward was compiled
        self.forward: bytes | None = None
        self.record: TrainingRecord | None = None
        self.refusal = ""

    def refuse(self, why: str) -> None:
        if not self.refusal:
            self.refusal = why

    def _take(self, arguments: dict[str, Any]) -> None:
        from torch.fx.experimental._backward_state import BackwardState

        config = arguments["aot_config"]
        if arguments["maybe_subclass_meta"] is not None:
            raise aot_cache.Uncacheable("tensor subclasses")
        if arguments["num_symints_saved_for_bw"]:
            raise aot_cache.Uncacheable("the backward saves symbolic sizes")
        if any(isinstance(x, BackwardState) for x in arguments["flat_args"]):
            raise aot_cache.Uncacheable("compiled autograd's backward state")
        if getattr(config, "num_params_buffers", 0):
            raise aot_cache.Uncacheable("Dynamo's graph holds parameters as attributes")
        to_cacheable = getattr(config, "to_cacheable", None)
        cacheable = to_cacheable() if to_cacheable is not None else config
        backward = aot_cache.serialize_aten_graph(arguments["bw_module"])
        if self.forward is None:
            raise aot_cache.Uncacheable(self.refusal or "the forward graph was not serialized")
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            structures = pickle.dumps(
                (
                    arguments["fw_metadata"],
                    arguments["wrappers"],
                    cacheable,
                    arguments["num_fw_outs_saved_for_bw"],
                    list(arguments["_indices_of_inps_to_detach"]),
                )
            )
        self.record = TrainingRecord(self.forward, backward, structures)


_RECORDING: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "dynajax_aot_recording", default=None
)
_INSTALL_LOCK = threading.Lock()
# The arguments the recording point must have (torch 2.13's names).
_EXPECTED = (
    "aot_config",
    "flat_args",
    "wrappers",
    "maybe_subclass_meta",
    "fw_metadata",
    "num_fw_outs_saved_for_bw",
    "_indices_of_inps_to_detach",
    "num_symints_saved_for_bw",
    "bw_module",
)


@functools.cache
def _recording_point() -> str | None:
    """Wraps aot_autograd's recording point once; None if done, else why it cannot be."""
    try:
        from torch._functorch._aot_autograd import graph_compile
    except ImportError:
        return "this torch has no aot_autograd graph_compile module"
    with _INSTALL_LOCK:
        original = getattr(graph_compile, "_cache_autograd_info", None)
        if original is None:
            return "this torch's aot_autograd has no _cache_autograd_info"
        if getattr(original, "_dynajax_recording", False):
            return None
        signature = inspect.signature(original)
        missing = [p for p in _EXPECTED if p not in signature.parameters]
        if missing:
            return f"this torch's _cache_autograd_info lacks {', '.join(missing)}"

        @functools.wraps(original)
        def recording(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            recorder = _RECORDING.get()
            if recorder is not None:
                try:
                    recorder._take(signature.bind(*args, **kwargs).arguments)
                except aot_cache.Uncacheable as e:
                    recorder.refuse(str(e))
                except Exception as e:  # noqa: BLE001 - recording never fails a compile
                    recorder.refuse(f"aot_autograd's structures: {type(e).__name__}: {e}")
                    log.info("cannot record aot_autograd's training structures: %s", e)
            return out

        recording._dynajax_recording = True  # type: ignore[attr-defined]
        graph_compile._cache_autograd_info = recording
    return None


@contextlib.contextmanager
def recording(recorder: Recorder | None) -> Iterator[None]:
    """Records into ``recorder`` the training graph aot_autograd traces inside the block
    (nothing where it is None)."""
    if recorder is None:
        yield
        return
    why = _recording_point()
    if why is not None:
        recorder.refuse(why)
        yield
        return
    token = _RECORDING.set(recorder)
    try:
        yield
    finally:
        _RECORDING.reset(token)


# -- rebuilding ---------------------------------------------------------------------------


@functools.cache
def _torch_classes() -> tuple[type, type, type] | None:
    """aot_autograd's result class, its loadable output and its backward, or None."""
    import importlib

    where = None
    # (older releases keep them beside the cache)
    for name in ("aot_autograd_result", "autograd_cache"):
        try:
            where = importlib.import_module(f"torch._functorch._aot_autograd.{name}")
        except ImportError:
            continue
        if hasattr(where, "InductorOutput"):
            break
    if where is None:
        return None
    result = getattr(where, "GenericAOTAutogradResult", None) or getattr(
        where, "GenericAOTAutogradCacheEntry", None
    )
    output = getattr(where, "InductorOutput", None)
    backward = getattr(where, "GenericCompiledBackward", None)
    if result is None or output is None or backward is None:
        return None
    if not hasattr(result, "wrap_post_compile"):
        return None
    return result, output, backward


@functools.cache
def _loadables() -> tuple[type, type, type] | None:
    """(result class, forward loadable, backward loadable): aot_autograd's classes with
    dynajax's compiled graphs in them."""
    classes = _torch_classes()
    if classes is None:
        return None
    result, output, backward = classes

    class CompiledByDynajax(output):  # type: ignore[misc, valid-type]
        """A graph that dynajax compiles when aot_autograd's rebuild loads it."""

        def __init__(self, compile: Callable[[], Callable[..., Any]]) -> None:
            self._compile = compile

        def pre_save(self) -> None:  # never saved through torch's cache
            pass

        def load(self, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            return self._compile()

        def post_compile(self, result: Any, fx_config: Any) -> Any:
            return result

    class BackwardByDynajax(backward, CompiledByDynajax):  # type: ignore[misc, valid-type]
        def __init__(self, compile: Callable[[], Callable[..., Any]]) -> None:
            CompiledByDynajax.__init__(self, compile)
            names = {f.name for f in dataclasses.fields(backward)}
            for name, value in (
                ("backward_state_indices", []),
                ("num_symints_saved_for_bw_", 0),
            ):
                if name not in names:
                    raise TypeError(f"{backward.__name__} has no field {name}")
                setattr(self, name, value)

    return result, CompiledByDynajax, BackwardByDynajax


class _LazyBackwardModule:
    """The backward graph as compiled autograd would read it (``deserialize``), loaded
    only if it does."""

    def __init__(self, load: Callable[[], torch.fx.GraphModule]) -> None:
        self.deserialize = load


def runtime_metadata(record: TrainingRecord) -> Any:
    """aot_autograd's ``ViewAndMutationMeta`` of the recorded training graph."""
    return pickle.loads(record.structures)[0]


def rebuild(
    record: TrainingRecord,
    example_inputs: Sequence[Any],
    load_graph: Callable[[bytes], torch.fx.GraphModule],
    compile_graph: Callable[[torch.fx.GraphModule, str], Callable[..., Any]],
) -> Callable[..., Any]:
    """aot_autograd's callable for the recorded training graph, in the convention Dynamo
    calls (``f(*inputs)``), built by aot_autograd's own ``wrap_post_compile`` around the
    two graphs ``compile_graph(graph, kind)`` compiles.

    Raises whatever prevents it (a torch without these classes, a field of another
    release): the caller traces instead."""
    loadables = _loadables()
    if loadables is None:
        raise TypeError("this torch has no AOT-autograd result class to rebuild from")
    result_class, forward_class, backward_class = loadables
    meta, wrappers, config, saved, detach = pickle.loads(record.structures)
    forward = load_graph(record.forward)
    backward = load_graph(record.backward)
    values = {
        "compiled_fw": forward_class(lambda: compile_graph(forward, "forward")),
        "compiled_bw": backward_class(lambda: compile_graph(backward, "backward")),
        "aot_joint_graph_str": None,
        "aot_forward_graph_str": None,
        "aot_backward_graph_str": None,
        "min_cut_info_str": None,
        "runtime_metadata": meta,
        "dispatch_wrappers": wrappers,
        "maybe_subclass_meta": None,
        "num_fw_outs_saved_for_bw": saved,
        "indices_of_inps_to_detach": detach,
        "forward_time_taken_ns": 0,
        "backward_time_taken_ns": 0,
        "sanitized_aot_config": config,
        "guards_expr": None,
        "serialized_bw_module": _LazyBackwardModule(lambda: load_graph(record.backward)),
    }
    fields = dataclasses.fields(result_class)
    missing = [
        f.name
        for f in fields
        if f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise TypeError(f"{result_class.__name__} needs {', '.join(missing)}")
    result = result_class(**{f.name: values[f.name] for f in fields if f.name in values})
    boxed = result.wrap_post_compile(list(example_inputs), config, {})

    # What aot_module_simplified returns around it (no parameters to prepend: recorded
    # graphs have none as attributes), and what Dynamo's aot_autograd backend does to it.
    @functools.wraps(boxed)
    def forward_call(*runtime_args: Any) -> Any:
        return boxed(list(runtime_args))

    return torch._dynamo.disable(forward_call, reason="do not trace AOT-compiled graph")
