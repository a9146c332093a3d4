"""Persistent cache of compiled XLA executables, shared across processes.

Two kinds of key name an entry:

    program key = sha256(format, platform, device kind, platform version, host CPU
                         features and count, XLA_FLAGS, compiler options, the program described
                         before tracing: ``programs.describe_call``)
    body        = pickle((executable bytes, in_tree, out_tree, versions, checks))

    lowered key = sha256(format, versions of jax/jaxlib/torch/dynajax, platform, device
                         kind, platform version, host CPU features, XLA_FLAGS,
                         lowered StableHLO)
    body        = pickle((executable bytes, in_tree, out_tree))   (serialize_executable's)

    entry = <dir>/<key>.bin:  MAGIC | HMAC-SHA256(secret, MAGIC | key | body) | body

    value key = sha256(kind, format, description)      (``value_key``; kind "aot":
                                                         aot_autograd's ATen graph,
                                                         ``runtime/aot_cache.py``;
                                                         "verdicts": abstract
                                                         evaluations of rules,
                                                         ``capability/memo.py``)
    entry     = <dir>/<key>.<kind>, authenticated the same way; body pickle((versions,
                payload bytes))

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

Authenticity. Loading an entry runs code from it twice over: the body is a pickle
(``jax.experimental.serialize_executable``'s own payload is one too), and the executable
is machine code that the next call runs. No file format fixes the second, so every entry
is authenticated instead: an HMAC-SHA256 with a per-user secret key that lives outside
the cache directory (``$XDG_CONFIG_HOME/dynajax/cache.key``, else
``~/.config/dynajax/cache.key``; 32 random bytes, created once, mode 0600 in a 0700
directory). The MAC covers the entry's key, so a valid entry cannot be replayed under
another program's name either. It is checked before anything is unpickled or handed to
XLA; an entry that fails it (damaged, written with another key, planted) is ignored with
a warning, compiled and overwritten. A key file that others could read or replace
(wrong owner, group/world permissions) turns the cache off with a warning.

Size. The entries are bounded by ``max_bytes`` (option ``cache_max_bytes``, 1 GiB by
default; None or 0: no bound). Every hit sets the entry's mtime to now, so mtime is the
time of last use; after each store the least recently used entries are removed until
the total is within the bound. An entry larger than the bound is not stored.

Concurrency. Several threads and processes may share one directory. An entry is written
to a temporary file in the same directory (``.tmp-<host>-<pid>-<random>.part``) and
renamed over ``<key>.bin`` (``os.replace``, atomic), so a reader sees no entry or a whole
one; a process killed while writing leaves only a temporary file, which nothing loads
and a later store removes (once it is a minute old and its writer's process on this host
is gone, or once it is an hour old).
Evictions racing with each other or with a reader are harmless: a removed file is a
later miss, a file removed twice is ignored, and an open file stays readable. After
every store, the directory is within the bound once the last writer's scan is done.

A cache never breaks a run. A missing entry compiles and stores; a corrupt,
unauthenticated or unloadable entry warns, compiles and overwrites it; an unreadable or
unwritable directory, or an unusable key, warns once and compiles. Hits and misses, with
the reason of each miss, are logged on ``dynajax.cache`` and counted in a
``CompileStats`` (shown in the Report).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import hmac
import logging
import os
import pickle
import platform
import re
import secrets
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import jax
import jaxlib
import torch
from jax.experimental import serialize_executable

from dynajax.lowering import attention

log = logging.getLogger("dynajax.cache")

_FORMAT = 4  # bump when the on-disk layout changes
_MAGIC = b"DYNAJAX-XLA\x04"
_MAC = 32  # bytes of an HMAC-SHA256
_KEY_BYTES = 32

DEFAULT_MAX_BYTES = 1 << 30
"""The default bound of a cache directory (``cache_max_bytes``): 1 GiB."""

# Only these are ever loaded or evicted: executables (.bin) and values (.aot:
# aot_autograd's graphs, .verdicts: abstract evaluations of rules).
_VALUE_KINDS = ("aot", "verdicts")
_ENTRY = re.compile(r"[0-9a-f]{64}\.(bin|aot|verdicts)")
_TEMP = re.compile(r"\.tmp-([0-9a-f]{8})-([0-9]+)-[A-Za-z0-9_]+\.part")
# A temporary file whose writer's process is gone (same host) is removed after this
# long; one from another host, or whose writer cannot be checked, after the second.
_TEMP_DEAD_S = 60.0
_TEMP_ABANDONED_S = 3600.0
_HOST = hashlib.sha256(platform.node().encode()).hexdigest()[:8]

# Counters of a CompileStats shared by partitions that compile in several threads.
_STATS_LOCK = threading.Lock()


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dynajax/xla``, else ``~/.cache/dynajax/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dynajax" / "xla"


def default_key_file() -> Path:
    """``$XDG_CONFIG_HOME/dynajax/cache.key``, else ``~/.config/dynajax/cache.key``.

    Outside the cache directory on purpose: whoever can write the cache (a shared or
    planted directory) must not be able to read or replace the key that signs it.
    """
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dynajax" / "cache.key"


# XLA options for every executable. By default XLA may keep a bfloat16/float16 value in
# float32 between two fused ops ("excess precision"), where PyTorch rounds each op's
# result: bfloat16 ``0.1 / x`` (reciprocal, then mul) differed from eager in 20% of
# the elements. PyTorch's answer is the contract, so every op rounds.
COMPILER_OPTIONS: dict[str, Any] = {"xla_allow_excess_precision": False}


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
    """

    xla_compiles: int = 0
    cache_hits: int = 0
    cache_misses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    evictions: int = 0
    cache_evictions: int = 0
    buckets: list[str] = dataclasses.field(default_factory=list)
    exact: list[str] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: CompileStats) -> CompileStats:
        self.xla_compiles += other.xla_compiles
        self.cache_hits += other.cache_hits
        self.cache_misses.update(other.cache_misses)
        self.evictions += other.evictions
        self.cache_evictions += other.cache_evictions
        self.buckets.extend(other.buckets)
        self.exact.extend(other.exact)
        return self

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
            f"fmt{_FORMAT}",
            f"jax{jax.__version__}",
            f"jaxlib{jaxlib.__version__}",
            f"torch{torch.__version__}",
            f"dynajax{__version__}",
            f"cpu{_cpu()}",
        ]
    )


@functools.cache
def versions() -> tuple[tuple[str, str], ...]:
    """What a program-keyed entry must have been written with to be loaded: the
    versions of jax, jaxlib, torch and dynajax, and a digest of dynajax's sources (its
    rules are code; a rule edited without a new version must not reuse old programs)."""
    from dynajax._version import __version__

    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\x00")
        digest.update(path.read_bytes() + b"\x00")
    return (
        ("jax", jax.__version__),
        ("jaxlib", jaxlib.__version__),
        ("torch", torch.__version__),
        ("dynajax", __version__),
        ("dynajax sources", digest.hexdigest()[:16]),
    )


def _stale(written: Any) -> str:
    """What differs between the ``versions()`` an entry was written with and ours
    (``"torch, dynajax sources"``); empty if nothing does."""
    ours = dict(versions())
    theirs = dict(written)
    return ", ".join(name for name, value in ours.items() if theirs.get(name) != value)


def _device_key(platform_name: str) -> str:
    dev = jax.devices(platform_name)[0]
    return f"{platform_name}|{dev.device_kind}|{dev.client.platform_version}"


class ExecutableCache:
    """A directory of serialized, authenticated executables; a ``None`` directory means
    "off".

    One per ``Backend``; thread-safe, and safe to share with other processes.
    ``compile`` is the only entry point of the compile path; ``prune`` enforces the bound.

    Args:
        directory: the cache directory (created 0700 at the first store), or None.
        max_bytes: the bound on the entries' total size; None or 0: unbounded.
        key_file: the secret key's file (default ``default_key_file()``), created at the
            first use if missing.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        *,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        key_file: str | os.PathLike[str] | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None (no bound), got {max_bytes}")
        self.directory = Path(directory) if directory else None
        self.max_bytes = max_bytes or None
        self.key_file = Path(key_file) if key_file else default_key_file()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._unwritable = False
        self._secret: bytes | None = None
        self._no_secret = False

    @classmethod
    def from_option(
        cls, cache_dir: str | os.PathLike[str] | None, max_bytes: int | None = DEFAULT_MAX_BYTES
    ) -> ExecutableCache:
        """``None`` -> the default directory, ``""`` -> disabled, else that directory;
        ``max_bytes`` is ``cache_max_bytes``."""
        if cache_dir is None:
            return cls(default_cache_dir(), max_bytes=max_bytes)
        return cls(cache_dir or None, max_bytes=max_bytes)

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
    ) -> jax.stages.Compiled:
        """The executable of ``lowered``: loaded from the cache, or compiled and stored."""
        if self.directory is None:
            return self._compile(lowered, stats)
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
            return compiled
        with _STATS_LOCK:
            stats.cache_misses[why] += 1
        log.debug("cache miss: %s (%s): %s", name, key[:16], why)
        compiled = self._compile(lowered, stats)
        if secret is not None and self._store(path, key, secret, compiled, name):
            evicted = self.prune()
            if evicted:
                with _STATS_LOCK:
                    stats.cache_evictions += evicted
        return compiled

    def program_key(self, program: str, platform_name: str) -> str:
        """The entry's name for a program described before tracing
        (``programs.describe_call``), and for what compiles it."""
        h = hashlib.sha256()
        for part in (
            f"program|fmt{_FORMAT}",
            _cpu(),
            _device_key(platform_name),
            os.environ.get("XLA_FLAGS", ""),
            repr(sorted(COMPILER_OPTIONS.items())),
            program,
        ):
            h.update(part.encode())
            h.update(b"\x00")
        return h.hexdigest()

    def compile_traced(
        self,
        program: str | None,
        lower: Callable[[], jax.stages.Lowered],
        stats: CompileStats,
        *,
        name: str = "",
        platform_name: str | None = None,
        extra: Callable[[], Any] = lambda: None,
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

        Returns:
            The executable, and ``extra()`` as stored (None when ``program`` is None).
        """
        if program is None or self.directory is None:
            return self.compile(lower(), stats, name=name, platform_name=platform_name), None
        platform_name = platform_name or jax.default_backend()
        key = self.program_key(program, platform_name)
        path = self.directory / f"{key}.bin"
        secret = self._get_secret()
        value = None
        if secret is None:
            why = "no cache key"
            compiled = None
        else:
            compiled, value, why = self._load(path, key, secret, platform_name, program=True)
        if compiled is not None:
            with _STATS_LOCK:
                stats.cache_hits += 1
            log.debug("cache hit: %s (%s, not traced)", name, key[:16])
            return compiled, value
        with _STATS_LOCK:
            stats.cache_misses[why] += 1
        log.debug("cache miss: %s (%s): %s", name, key[:16], why)
        compiled = self._compile(lower(), stats)
        value = extra()
        if secret is not None and self._store(
            path, key, secret, compiled, name, trailer=(versions(), value)
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

    # -- the key --------------------------------------------------------------------------

    def _get_secret(self) -> bytes | None:
        """This user's secret key, read (or created) once; None if it cannot be used."""
        if self._secret is not None or self._no_secret:
            return self._secret
        problem = None
        with self._lock:
            if self._secret is None and not self._no_secret:
                try:
                    self._secret = _load_or_create_key(self.key_file)
                except _KeyProblem as e:
                    self._no_secret = True
                    problem = str(e)
        if problem is not None:
            self._warn("key", f"{problem}; running without the compilation cache.")
        return self._secret

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
                stale = _stale(written)
                if stale:
                    log.info("cache entry %s is stale (%s changed); compiling", path.name, stale)
                    return None, None, f"stale entry ({stale} changed)"
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
        _touch(path)
        return compiled, value, ""

    def _read_authentic(self, path: Path, key: str, secret: bytes) -> tuple[bytes | None, str]:
        """The body of the entry at ``path`` if it is authentic, else None and the
        reason of the miss (warned about unless the entry is simply absent)."""
        try:
            blob = _read_entry(path)
        except (FileNotFoundError, NotADirectoryError):  # (the write says why, if it fails)
            return None, "not cached yet"
        except OSError as e:
            self._warn("read", f"cannot read {path} ({e}); compiling instead")
            return None, "unreadable entry"
        if blob is None or len(blob) < len(_MAGIC) + _MAC or not blob.startswith(_MAGIC):
            self._warn(
                "corrupt",
                f"corrupt cache entry {path.name} (not a dynajax format-{_FORMAT} entry); "
                "compiling it again",
            )
            return None, "corrupt entry"
        body = blob[len(_MAGIC) + _MAC :]
        if not hmac.compare_digest(blob[len(_MAGIC) : len(_MAGIC) + _MAC], _mac(secret, key, body)):
            self._warn(
                "unauthenticated",
                f"cache entry {path.name} failed authentication with the key {self.key_file}: "
                "it is damaged, was written with another key (another user, or a key that "
                "was replaced), or was planted. It was not loaded; compiling it again. If "
                "several users share this cache directory, give each their own cache_dir.",
            )
            return None, "unauthenticated entry"
        return body, ""

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

    def _write_authentic(self, path: Path, key: str, secret: bytes, body: bytes, what: str) -> bool:
        """Writes ``body`` as the entry at ``path``, authenticated and atomically; True
        if it was written. ``what`` names it in messages."""
        if self._unwritable:
            return False
        blob = _MAGIC + _mac(secret, key, body) + body
        if self.max_bytes is not None and len(blob) > self.max_bytes:
            log.info(
                "not caching %s: its entry (%d bytes) is larger than cache_max_bytes (%d)",
                what,
                len(blob),
                self.max_bytes,
            )
            return False
        directory = path.parent
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(
                dir=directory, prefix=f".tmp-{_HOST}-{os.getpid()}-", suffix=".part"
            )
        except OSError as e:
            self._unwritable = True  # one warning, no further attempts in this process
            self._warn(
                "write",
                f"cannot write the compilation cache at {self.directory} ({e}); running "
                "without it. Set DYNAJAX_CACHE_DIR to a writable directory, or to '' to "
                "turn the cache off.",
            )
            return False
        try:
            with os.fdopen(fd, "wb") as f:
                _write_entry(f, blob)
            os.replace(tmp, path)
            return True
        except OSError as e:  # disk full, or the file removed under us: this entry only
            self._warn(
                "store",
                f"could not store {what} in {directory} ({e}); it runs, "
                "but other processes will compile it again. Free space there, or set "
                "DYNAJAX_CACHE_DIR to another directory.",
            )
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    # -- values: what a compile computes besides executables --------------------------------

    def value_key(self, kind: str, description: str) -> str:
        """The entry's name for a value of ``kind`` (``"aot"``: aot_autograd's result)
        computed from what ``description`` describes."""
        assert kind in _VALUE_KINDS, kind
        h = hashlib.sha256()
        for part in (f"value|{kind}|fmt{_FORMAT}", description):
            h.update(part.encode())
            h.update(b"\x00")
        return h.hexdigest()

    def load_value(self, kind: str, key: str) -> tuple[bytes | None, str]:
        """The bytes stored under ``key`` (``value_key``) by ``store_value`` with the
        same ``versions()``, or None and the reason of the miss."""
        if self.directory is None:
            return None, "cache off"
        secret = self._get_secret()
        if secret is None:
            return None, "no cache key"
        path = self.directory / f"{key}.{kind}"
        body, why = self._read_authentic(path, key, secret)
        if body is None:
            return None, why
        try:  # (authenticated: only now is the body unpickled)
            written, payload = pickle.loads(body)
        except Exception as e:  # noqa: BLE001 - authentic but unreadable: a miss
            self._warn("unloadable", f"cannot load cache entry {path.name} ({type(e).__name__})")
            return None, "unloadable entry"
        stale = _stale(written)
        if stale:
            return None, f"stale entry ({stale} changed)"
        _touch(path)
        return payload, ""

    def store_value(self, kind: str, key: str, payload: bytes, what: str) -> bool:
        """Stores ``payload`` under ``key`` (with ``versions()``); True if written."""
        if self.directory is None:
            return False
        secret = self._get_secret()
        if secret is None:
            return False
        body = pickle.dumps((versions(), payload))
        path = self.directory / f"{key}.{kind}"
        if not self._write_authentic(path, key, secret, body, what):
            return False
        self.prune()
        return True

    def prune(self) -> int:
        """Keeps the directory within ``max_bytes`` and removes abandoned temp files.

        Removes entries least recently used first (oldest mtime: the time of their last
        hit or store) until the entries' total size is within the bound, and temporary
        files left by writers that were killed. Only files named like entries
        (``<64 hex digits>.bin``, ``.aot``, ``.verdicts``) or like dynajax's temp files
        are touched, so a directory shared with other files loses none of them. Safe to
        run in several processes at once. Returns the number of entries this call
        removed.
        """
        directory = self.directory
        if directory is None:
            return 0
        now = time.time()
        entries: list[tuple[int, str, int]] = []
        total = 0
        try:
            scan = os.scandir(directory)
        except OSError:
            return 0
        with scan:
            for item in scan:
                try:
                    if _ENTRY.fullmatch(item.name):
                        st = item.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            entries.append((st.st_mtime_ns, item.name, st.st_size))
                            total += st.st_size
                    elif (temp := _TEMP.fullmatch(item.name)) is not None:
                        st = item.stat(follow_symlinks=False)
                        if _abandoned(temp.group(1), int(temp.group(2)), now - st.st_mtime):
                            os.unlink(item.path)
                            log.debug("removed %s, left by a writer that was stopped", item.name)
                except OSError:  # removed meanwhile by another process
                    continue
        if self.max_bytes is None or total <= self.max_bytes:
            return 0
        removed = 0
        for _, name, size in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.unlink(directory / name)
                removed += 1
            except FileNotFoundError:  # another process evicted it first
                pass
            except OSError:
                continue  # still there, still counted
            total -= size
        log.debug("evicted %d cache entr(ies) to stay within %d bytes", removed, self.max_bytes)
        return removed

    def _warn(self, kind: str, message: str) -> None:
        """Logs every problem; warns once per kind of problem and cache."""
        log.warning("dynajax compilation cache: %s", message)
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        warnings.warn(f"dynajax compilation cache: {message}", RuntimeWarning, stacklevel=2)


def _touch(path: Path) -> None:
    """Marks the entry at ``path`` as used now (mtime: the LRU order of eviction)."""
    try:
        os.utime(path)
    except OSError:  # evicted meanwhile, or a read-only cache: order only
        pass


def _mac(secret: bytes, key: str, body: bytes) -> bytes:
    """HMAC-SHA256 of an entry: its format, its key (its file name) and its body."""
    mac = hmac.new(secret, _MAGIC, hashlib.sha256)
    mac.update(key.encode() + b"\x00")
    mac.update(body)
    return mac.digest()


def _read_entry(path: Path) -> bytes | None:
    """The bytes of the entry at ``path``; None if it is not a regular file. Neither a
    symlink nor a FIFO planted under an entry's name is followed or waited on."""
    flags = os.O_RDONLY
    for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_BINARY"):
        flags |= getattr(os, name, 0)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read()


def _write_entry(f: IO[bytes], blob: bytes) -> None:
    """Writes an entry's bytes to its temp file (a seam for the killed-writer test)."""
    f.write(blob)


def _abandoned(host: str, pid: int, age: float) -> bool:
    """Whether a temp file of writer ``pid`` on ``host``, ``age`` seconds old, is dead."""
    if age > _TEMP_ABANDONED_S:
        return True
    return host == _HOST and age > _TEMP_DEAD_S and not _process_alive(pid)


def _process_alive(pid: int) -> bool:
    if os.name != "posix":  # (os.kill would terminate the process on Windows)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


class _KeyProblem(Exception):
    """The key file cannot be used; the message says why and what to do."""


def _load_or_create_key(path: Path) -> bytes:
    """Reads the secret key at ``path``, creating it (0600, in a 0700 directory) if
    missing. Safe when several processes create it at once: the key is written to a
    temp file and linked to ``path``, which fails if another process got there first;
    every process then reads the one file that won."""
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise _KeyProblem(f"cannot read the cache key {path} ({e})") from None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cache.key-")  # 0600
    except OSError as e:
        raise _KeyProblem(
            f"cannot create the cache key {path} ({e}); set XDG_CONFIG_HOME to a writable "
            "directory of your own"
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(_KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process created it meanwhile: use theirs
            pass
    except OSError as e:
        raise _KeyProblem(f"cannot create the cache key {path} ({e})") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    try:
        return _read_key(path)
    except OSError as e:
        raise _KeyProblem(f"cannot read the cache key {path} ({e})") from None


def _read_key(path: Path) -> bytes:
    """The key in ``path``, if only this user can read or replace it."""
    _check_private(path.parent, "directory of the cache key", 0o022)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        _check_private(path, "cache key", 0o077, os.fstat(f.fileno()))
        key = f.read(_KEY_BYTES + 1)
    if len(key) != _KEY_BYTES:
        raise _KeyProblem(
            f"the cache key {path} is damaged ({len(key)} bytes, expected {_KEY_BYTES}); "
            "delete it and dynajax makes a new one (cached entries are then compiled again)"
        )
    return key


def _check_private(path: Path, what: str, forbidden: int, st: os.stat_result | None = None) -> None:
    """Raises _KeyProblem unless ``path`` is this user's and has no ``forbidden`` bits."""
    if os.name != "posix":
        return
    st = st if st is not None else os.stat(path)
    if st.st_uid != os.getuid():
        raise _KeyProblem(
            f"the {what} {path} belongs to user id {st.st_uid}, not to you ({os.getuid()}), "
            "so whoever owns it could forge cache entries; point XDG_CONFIG_HOME at a "
            "directory of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & forbidden:
        fix = "chmod 600" if forbidden == 0o077 else "chmod go-w"
        raise _KeyProblem(
            f"the {what} {path} has mode {mode:o}, so other users could read or replace "
            f"it and forge cache entries; run `{fix} {path}`"
        )


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
