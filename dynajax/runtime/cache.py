"""Persistent cache of compiled XLA executables, shared across processes.

Its entries lie in the blob store (``dynajax/store.py``: one directory, each entry
authenticated with a per-user secret key, written atomically, the whole bounded by
``cache_max_bytes``), named by two kinds of key:

    program key = sha256(format, platform, device kind, platform version, host CPU
                         features and count, XLA_FLAGS, compiler options, the program described
                         before tracing: ``programs.describe_call``)
    body        = pickle((executable bytes, in_tree, out_tree, versions, checks))

    lowered key = sha256(format, versions of jax/jaxlib/torch/dynajax, platform, device
                         kind, platform version, host CPU features, XLA_FLAGS,
                         lowered StableHLO)
    body        = pickle((executable bytes, in_tree, out_tree))   (serialize_executable's)

    entry = <dir>/<key>.bin:  MAGIC | HMAC-SHA256(secret, MAGIC | key | body) | body

A partition's executables are keyed by their program (``compile_traced``), so a hit
skips tracing the partition through the rule table and lowering it as well as XLA's
compile; the entry keeps the value checks that trace recorded (``lowering/checks.py``),
which the caller's check table takes back. ``versions`` (jax, jaxlib, torch, dynajax
and a digest of dynajax's sources) are compared when the entry is loaded: an entry of
another version is a miss with the reason ``stale entry (<what> changed)``, compiled
and overwritten. Graphs that ``programs.describe_partition`` cannot describe (a user's
rule), and direct callers of ``compile``, are keyed by the lowered text instead.

For the lowered key: the StableHLO text is what the executable is compiled from, so it covers
everything that changes it: the partition's graph and the lowering rules applied to it,
input shapes and dtypes, static sizes, x64 mode, and every option that changes what a
partition contains (``min_block_size``, ``fallback_ops``) or its shapes
(``pad_to_buckets``). The rest of the key covers what compiles the text: versions,
device, host CPU features (an executable compiled for one CPU may use instructions
another lacks) and ``XLA_FLAGS``.

An entry's MAC is checked before its body is unpickled or its executable handed to XLA
(``store.py``: authenticity, size, concurrency).

A cache never breaks a run. A missing entry compiles and stores; a corrupt,
unauthenticated or unloadable entry warns, compiles and overwrites it; an unreadable or
unwritable directory, or an unusable key, warns once and compiles. Hits and misses, with
the reason of each miss, are logged on ``dynajax.cache`` and counted in a
``CompileStats`` (shown in the Report), which also keeps a ``CompileEvent`` per
executable compiled or loaded: its partition, inputs, why it was needed (``first
call``, a new shape, ...), the seconds it took and a refused entry's reason. They are
recorded on the compile path only; a call that finds its executable records nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import torch
from jax.experimental import serialize_executable

from dynajax import ffi, store
from dynajax.lowering import attention
from dynajax.runtime import jax_internals

log = logging.getLogger("dynajax.cache")

# Counters of a CompileStats shared by partitions that compile in several threads.
_STATS_LOCK = threading.Lock()

# XLA options for every executable. By default XLA may keep a bfloat16/float16 value in
# float32 between two fused ops ("excess precision"), where PyTorch rounds each op's
# result: bfloat16 ``0.1 / x`` (reciprocal, then mul) differed from eager in 20% of
# the elements. PyTorch's answer is the contract, so every op rounds.
COMPILER_OPTIONS: dict[str, Any] = {"xla_allow_excess_precision": False}


# The reason of the one miss that refuses no entry: there was none.
NOT_CACHED = "not cached yet"


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """One executable of a partition, compiled by XLA or loaded from the persistent cache.

    Attributes:
        partition: the partition's name (``jax_0``).
        inputs: its inputs' types as the executable takes them (padded to a bucket
            where it pads), and the sizes bound into it: ``f32[8,3], i64[8], 8``.
        reason: why it was needed: ``first call`` (the partition's first executable),
            or, under dynamic shapes, ``new shape``, ``new bucket`` or ``evicted
            earlier`` (max_executables), each with its detail.
        seconds: what getting it took: trace, lowering and XLA's compile, or the load.
        loaded: loaded from the persistent cache (not compiled).
        cache: an enabled persistent cache's miss reason (``not cached yet``, ``stale
            entry (torch changed)``); empty when loaded or when the cache is off.
    """

    partition: str
    inputs: str
    reason: str
    seconds: float
    loaded: bool = False
    cache: str = ""

    @property
    def refused(self) -> str:
        """The reason an existing cache entry was refused (stale, corrupt, ...), or ''."""
        return "" if self.cache in ("", NOT_CACHED) else self.cache


@dataclasses.dataclass
class CompileStats:
    """What compiling a graph's partitions took, counted as it happens.

    Attributes:
        xla_compiles: executables XLA compiled in this process.
        cache_hits: executables loaded from the persistent cache instead.
        cache_misses: misses of an enabled persistent cache, by reason.
        evictions: executables dropped by the per-partition bound (max_executables).
        cache_evictions: entries this process removed from the cache directory to keep
            it within ``cache_max_bytes`` (least recently used first).
        buckets: partitions that pad dynamic dimensions to buckets.
        exact: partitions compiled per exact size although bucketing was asked for,
            with the reason (``jax_0: s0: reduce_sum over the padded dimension``).
        events: every executable compiled or loaded, in order (``CompileEvent``): one
            per XLA compile and per cache hit.
    """

    xla_compiles: int = 0
    cache_hits: int = 0
    cache_misses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    evictions: int = 0
    cache_evictions: int = 0
    buckets: list[str] = dataclasses.field(default_factory=list)
    exact: list[str] = dataclasses.field(default_factory=list)
    events: list[CompileEvent] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: CompileStats) -> CompileStats:
        self.xla_compiles += other.xla_compiles
        self.cache_hits += other.cache_hits
        self.cache_misses.update(other.cache_misses)
        self.evictions += other.evictions
        self.cache_evictions += other.cache_evictions
        self.buckets.extend(other.buckets)
        self.exact.extend(other.exact)
        self.events.extend(other.events)
        return self

    @property
    def seconds(self) -> float:
        """Seconds spent getting executables: compiling (trace, lower, compile) and loading."""
        return sum(e.seconds for e in self.events)

    def recompiles(self) -> list[CompileEvent]:
        """The events after each partition's first, and any whose cache entry was refused."""
        seen: set[str] = set()
        out = []
        for e in self.events:
            if e.partition in seen or e.refused:
                out.append(e)
            seen.add(e.partition)
        return out

    def line(self) -> str:
        """``3 XLA compile(s), 2 cache hit(s), 3 miss(es) (not cached yet x3)``."""
        misses = sum(self.cache_misses.values())
        why = ", ".join(f"{r} x{n}" for r, n in sorted(self.cache_misses.items()))
        text = (
            f"{self.xla_compiles} XLA compile(s), {self.cache_hits} cache hit(s), "
            f"{misses} miss(es)" + (f" ({why})" if why else "")
        )
        if self.evictions:
            text += f", {self.evictions} eviction(s)"
        if self.cache_evictions:
            text += f", {self.cache_evictions} cache entr(ies) evicted"
        return text


@functools.cache
def _cpu() -> str:
    """The host CPU and the features an XLA:CPU executable may have been specialized for,
    and the CPUs this process may use (the attention rule splits its heads by their
    count: ``lowering/attention.py``)."""
    cpu = f"{platform.processor() or platform.machine()}|{attention.cpus()} cpus"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
        cpu += "|" + hashlib.sha256(flags.encode()).hexdigest()[:16]
    except OSError:
        pass
    return cpu


@functools.cache
def _environment() -> str:
    """Everything besides the program that decides what XLA compiles it to."""
    from dynajax._version import __version__

    return "|".join(
        [
            f"fmt{store.FORMAT}",
            f"jax{jax.__version__}",
            f"jaxlib{jaxlib.__version__}",
            f"torch{torch.__version__}",
            f"dynajax{__version__}",
            f"cpu{_cpu()}",
        ]
    )


def _device_key(platform_name: str) -> str:
    dev = jax.devices(platform_name)[0]
    return f"{platform_name}|{dev.device_kind}|{dev.client.platform_version}"


class ExecutableCache(store.BlobStore):
    """A directory of serialized, authenticated executables; a ``None`` directory means
    "off".

    One per ``Backend``; thread-safe, and safe to share with other processes.
    ``compile`` is the only entry point of the compile path; ``prune`` enforces the bound.
    The values of ``store.BlobStore`` (aot_autograd's graphs, verdicts) share its
    directory.

    Args:
        directory: the cache directory (created 0700 at the first store), or None.
        max_bytes: the bound on the entries' total size; None or 0: unbounded.
        key_file: the secret key's file (default ``store.default_key_file()``), created
            at the first use if missing.
    """

    def key(self, lowered: jax.stages.Lowered, platform_name: str) -> str:
        """The entry's name: a digest of the program and of what compiles it."""
        h = hashlib.sha256()
        for part in (
            _environment(),
            _device_key(platform_name),
            os.environ.get("XLA_FLAGS", ""),
            repr(sorted(COMPILER_OPTIONS.items())),
            lowered.as_text(),
            # jit prunes unused arguments from the StableHLO, so the text alone would
            # give f(int32[3]) and f(float32[3]) -> ones(3) the same key, and the loaded
            # executable would then refuse the other call's argument types.
            repr(lowered.args_info),
        ):
            h.update(part.encode())
            h.update(b"\x00")
        return h.hexdigest()

    def compile(
        self,
        lowered: jax.stages.Lowered,
        stats: CompileStats,
        *,
        name: str = "",
        platform_name: str | None = None,
        event: tuple[str, str, str] | None = None,
    ) -> jax.stages.Compiled:
        """The executable of ``lowered``: loaded from the cache, or compiled and stored.

        ``event``: (partition, inputs, reason) of the ``CompileEvent`` recorded in
        ``stats`` (default: ``name``, no inputs, ``first call``)."""
        start = time.perf_counter()
        compiled, why = self._compile_lowered(lowered, stats, name, platform_name)
        _record(stats, event or (name, "", "first call"), start, why)
        return compiled

    def _compile_lowered(
        self,
        lowered: jax.stages.Lowered,
        stats: CompileStats,
        name: str,
        platform_name: str | None,
    ) -> tuple[jax.stages.Compiled, str | None]:
        """``compile``'s executable, and the cache's miss reason (None: loaded; '': the
        cache is off)."""
        if self.directory is None:
            return self._compile(lowered, stats), ""
        platform_name = platform_name or jax.default_backend()
        key = self.key(lowered, platform_name)
        path = self.directory / f"{key}.bin"
        secret = self._get_secret()
        if secret is None:
            why = "no cache key"
            compiled = None
        else:
            compiled, _, why = self._load(path, key, secret, platform_name)
        if compiled is not None:
            with _STATS_LOCK:
                stats.cache_hits += 1
            log.debug("cache hit: %s (%s)", name, key[:16])
            return compiled, None
        with _STATS_LOCK:
            stats.cache_misses[why] += 1
        log.debug("cache miss: %s (%s): %s", name, key[:16], why)
        compiled = self._compile(lowered, stats)
        if secret is not None and self._store(path, key, secret, compiled, name):
            evicted = self.prune()
            if evicted:
                with _STATS_LOCK:
                    stats.cache_evictions += evicted
        return compiled, why

    def program_key(self, program: str, platform_name: str) -> str:
        """The entry's name for a program described before tracing
        (``programs.describe_call``), and for what compiles it."""
        h = hashlib.sha256()
        for part in (
            f"program|fmt{store.FORMAT}",
            _cpu(),
            _device_key(platform_name),
            os.environ.get("XLA_FLAGS", ""),
            repr(sorted(COMPILER_OPTIONS.items())),
            program,
        ):
            h.update(part.encode())
            h.update(b"\x00")
        return h.hexdigest()

    def load_traced(
        self,
        program: str,
        stats: CompileStats,
        *,
        name: str = "",
        platform_name: str | None = None,
        event: tuple[str, str, str] | None = None,
    ) -> tuple[jax.stages.Compiled, Any] | str:
        """A program's executable and what was stored with it, where the cache has it
        (a hit, counted in ``stats``); else the reason of the miss, for
        ``compile_traced(..., missed=)``, which counts it. Arguments as
        ``compile_traced``'s."""
        start = time.perf_counter()
        if self.directory is None:
            return "no cache directory"
        platform_name = platform_name or jax.default_backend()
        key = self.program_key(program, platform_name)
        secret = self._get_secret()
        if secret is None:
            return "no cache key"
        path = self.directory / f"{key}.bin"
        compiled, value, why = self._load(path, key, secret, platform_name, program=True)
        if compiled is None:
            return why
        with _STATS_LOCK:
            stats.cache_hits += 1
        log.debug("cache hit: %s (%s, not traced)", name, key[:16])
        _record(stats, event or (name, "", "first call"), start, None)
        return compiled, value

    def compile_traced(
        self,
        program: str | None,
        lower: Callable[[], jax.stages.Lowered],
        stats: CompileStats,
        *,
        name: str = "",
        platform_name: str | None = None,
        extra: Callable[[], Any] = lambda: None,
        event: tuple[str, str, str] | None = None,
        missed: str | None = None,
    ) -> tuple[jax.stages.Compiled, Any]:
        """The executable of a program, loaded without tracing it when cached.

        Args:
            program: the program as ``programs.describe_call`` describes it, or None
                (not describable: ``lower()`` is called and the entry keyed by its text).
            lower: traces and lowers the program (only called on a miss).
            stats: where compiles, hits and misses count.
            name: the partition and its shapes, for logs.
            platform_name: the platform the executable runs on.
            extra: what the trace recorded that a caller needs without tracing (the
                value checks), stored with the executable; called after ``lower``.
            event: (partition, inputs, reason) of the ``CompileEvent`` recorded in
                ``stats``, timed from here (the trace and lowering included).
            missed: the reason ``load_traced`` gave for not finding it, where the caller
                looked already (it is then compiled and stored without looking again).

        Returns:
            The executable, and ``extra()`` as stored (None when ``program`` is None).
        """
        start = time.perf_counter()
        event = event or (name, "", "first call")
        if program is None or self.directory is None:
            exe, miss = self._compile_lowered(lower(), stats, name, platform_name)
            _record(stats, event, start, miss)
            return exe, None
        platform_name = platform_name or jax.default_backend()
        why = missed
        if why is None:
            found = self.load_traced(
                program, stats, name=name, platform_name=platform_name, event=event
            )
            if not isinstance(found, str):
                return found
            why = found
        key = self.program_key(program, platform_name)
        with _STATS_LOCK:
            stats.cache_misses[why] += 1
        log.debug("cache miss: %s (%s): %s", name, key[:16], why)
        compiled = self._compile(lower(), stats)
        _record(stats, event, start, why)  # (before storing it: compiled, not written)
        value = extra()
        secret = self._get_secret()
        path = self.directory / f"{key}.bin"
        if secret is not None and self._store(
            path, key, secret, compiled, name, trailer=(store.versions(), value)
        ):
            evicted = self.prune()
            if evicted:
                with _STATS_LOCK:
                    stats.cache_evictions += evicted
        return compiled, value

    @staticmethod
    def _compile(lowered: jax.stages.Lowered, stats: CompileStats) -> jax.stages.Compiled:
        with _STATS_LOCK:
            stats.xla_compiles += 1
        return lowered.compile(compiler_options=dict(COMPILER_OPTIONS))

    # -- entries --------------------------------------------------------------------------

    def _load(
        self, path: Path, key: str, secret: bytes, platform_name: str, *, program: bool = False
    ) -> tuple[jax.stages.Compiled | None, Any, str]:
        """The entry's executable (and, for a program entry, what was stored with it),
        or None and the reason of the miss."""
        body, why = self._read_authentic(path, key, secret)
        if body is None:
            return None, None, why
        value = None
        try:
            # (authenticated: only now is the body unpickled)
            payload, in_tree, out_tree, *trailer = pickle.loads(body)
            # The devices it runs on, last (entries written before they were kept lack
            # them: JAX then loads the executable onto every device of the platform).
            devices = trailer.pop() if len(trailer) in (1, 3) else None
            if program:
                written, value = trailer
                stale = store.stale(written)
                if stale:
                    log.info("cache entry %s is stale (%s changed); compiling", path.name, stale)
                    return None, None, f"stale entry ({stale} changed)"
            if platform_name == "cpu" and b"lapack_" in payload:
                # jaxlib's LAPACK kernels run uninitialized (a crash) in a process that
                # lowered no linear algebra: initialize them, or compile instead.
                initialize = jax_internals.lapack_initializer()
                if initialize is None:
                    return None, None, "an executable calling LAPACK (not loadable here)"
                initialize()
            if platform_name == "cpu" and ffi.TARGET.encode() in payload and not ffi.available():
                # It calls PyTorch's kernels (dynajax/ffi): the handler must be registered.
                return None, None, "an executable calling PyTorch's kernels (not loadable here)"
            compiled = serialize_executable.deserialize_and_load(
                payload,
                in_tree,
                out_tree,
                backend=platform_name,
                execution_devices=_devices_by_id(devices, platform_name),
            )
        except Exception as e:  # noqa: BLE001 - an authentic entry that cannot be loaded
            # (e.g. written by a jaxlib that serializes differently) is stale, not
            # fatal: compile and overwrite it.
            self._warn(
                "unloadable",
                f"cannot load cache entry {path.name} ({type(e).__name__}); compiling",
            )
            return None, None, "unloadable entry"
        store.touch(path)
        return compiled, value, ""

    def _store(
        self,
        path: Path,
        key: str,
        secret: bytes,
        compiled: jax.stages.Compiled,
        name: str,
        trailer: tuple[Any, ...] = (),
    ) -> bool:
        """Writes the executable's entry atomically; True if it was written.
        ``trailer``: what a program entry keeps after the executable (its versions, the
        recorded checks)."""
        if self._unwritable:
            return False
        try:
            executable: Any = compiled.runtime_executable()
            devices = [d.id for d in executable.local_devices()]
            body = pickle.dumps((*serialize_executable.serialize(compiled), *trailer, devices))
        except (
            ValueError,
            NotImplementedError,
            TypeError,
            AttributeError,
            pickle.PicklingError,
        ) as e:
            # e.g. executables with host callbacks or closed-over constants
            log.info("not caching %s: the executable cannot be serialized (%s)", name, e)
            return False
        return self._write_authentic(path, key, secret, body, f"the executable of {name}")


def _record(
    stats: CompileStats, event: tuple[str, str, str], start: float, miss: str | None
) -> None:
    """Adds the ``CompileEvent`` of an executable got since ``start``: loaded (``miss``
    None), or compiled after the cache's miss ``miss`` ('' with the cache off)."""
    partition, inputs, reason = event
    done = CompileEvent(
        partition,
        inputs,
        reason,
        time.perf_counter() - start,
        loaded=miss is None,
        cache=miss or "",
    )
    with _STATS_LOCK:
        stats.events.append(done)


def stats_of(items: Any) -> CompileStats:
    """The sum of the ``CompileStats`` in ``items``."""
    total = CompileStats()
    for s in items:
        total += s
    return total


def _devices_by_id(ids: list[int] | None, platform_name: str) -> list[Any] | None:
    """The platform's devices of these ids, in order: an executable compiled for one
    device of eight loads onto that one (without them, JAX's loader gives it every
    device, and its call expects a shard per device). None where unknown or absent."""
    if ids is None:
        return None
    by_id = {d.id: d for d in jax.devices(platform_name)}
    if not all(i in by_id for i in ids):
        return None
    return [by_id[i] for i in ids]
