"""Persistent cache of compiled XLA executables, shared across processes.

    key   = sha256(format, versions of jax/jaxlib/torch/dynajax, platform, device kind,
                   platform version, host CPU features, XLA_FLAGS, lowered StableHLO)
    entry = <dir>/<key>.bin:  MAGIC | sha256(body) | body = pickle((executable, trees))

The lowered StableHLO text is what the executable is compiled from, so the key covers
everything that changes it: the partition's graph and the lowering rules applied to it,
input shapes and dtypes, static sizes, x64 mode, and every option that changes what a
partition contains (``min_block_size``, ``fallback_ops``) or its shapes
(``pad_to_buckets``). The rest of the key covers what compiles the text: versions,
device, host CPU features (an executable compiled for one CPU may use instructions
another lacks) and ``XLA_FLAGS``.

A cache never breaks a run. A missing entry compiles and stores; a corrupt entry
(checksum or unpickling fails) warns, compiles and overwrites it; an unreadable or
unwritable directory warns once and compiles. Entries are written atomically (temp file
in the same directory, then ``os.replace``), so concurrent processes see either no entry
or a whole one. The checksum is verified before anything is unpickled or handed to XLA.

Entries are pickles (as ``jax.experimental.serialize_executable`` makes them): load only
from a directory you trust. The default directory is created private to the user.

Hits and misses, with the reason of each miss, are logged on ``dynajax.cache`` and
counted in a ``CompileStats`` (shown in the Report).
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
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import jax
import jaxlib
import torch
from jax.experimental import serialize_executable

log = logging.getLogger("dynajax.cache")

_FORMAT = 2  # bump when the on-disk layout changes
_MAGIC = b"DYNAJAX-XLA\x00"
_DIGEST = 32


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dynajax/xla``, else ``~/.cache/dynajax/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dynajax" / "xla"


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
        buckets: partitions that pad dynamic dimensions to buckets.
        exact: partitions compiled per exact size although bucketing was asked for,
            with the reason (``jax_0: s0: reduce_sum over the padded dimension``).
    """

    xla_compiles: int = 0
    cache_hits: int = 0
    cache_misses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    evictions: int = 0
    buckets: list[str] = dataclasses.field(default_factory=list)
    exact: list[str] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: CompileStats) -> CompileStats:
        self.xla_compiles += other.xla_compiles
        self.cache_hits += other.cache_hits
        self.cache_misses.update(other.cache_misses)
        self.evictions += other.evictions
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
        return text


@functools.cache
def _environment() -> str:
    """Everything besides the program that decides what XLA compiles it to."""
    from dynajax import __version__

    cpu = platform.processor() or platform.machine()
    try:  # the CPU features an XLA:CPU executable may have been specialized for
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
        cpu += "|" + hashlib.sha256(flags.encode()).hexdigest()[:16]
    except OSError:
        pass
    return "|".join(
        [
            f"fmt{_FORMAT}",
            f"jax{jax.__version__}",
            f"jaxlib{jaxlib.__version__}",
            f"torch{torch.__version__}",
            f"dynajax{__version__}",
            f"cpu{cpu}",
        ]
    )


def _device_key(platform_name: str) -> str:
    dev = jax.devices(platform_name)[0]
    return f"{platform_name}|{dev.device_kind}|{dev.client.platform_version}"


class ExecutableCache:
    """A directory of serialized executables; a ``None`` directory means "off".

    One per ``Backend``; thread-safe. ``compile`` is the only entry point.
    """

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self.directory = Path(directory) if directory else None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._unwritable = False

    @classmethod
    def from_option(cls, cache_dir: str | os.PathLike[str] | None) -> ExecutableCache:
        """``None`` -> the default directory, ``""`` -> disabled, else that directory."""
        if cache_dir is None:
            return cls(default_cache_dir())
        return cls(cache_dir or None)

    def key(self, lowered: jax.stages.Lowered, platform_name: str) -> str:
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
        compiled, why = self._load(path, platform_name)
        if compiled is not None:
            stats.cache_hits += 1
            log.debug("cache hit: %s (%s)", name, key[:16])
            return compiled
        stats.cache_misses[why] += 1
        log.debug("cache miss: %s (%s): %s", name, key[:16], why)
        compiled = self._compile(lowered, stats)
        self._store(path, compiled, name)
        return compiled

    @staticmethod
    def _compile(lowered: jax.stages.Lowered, stats: CompileStats) -> jax.stages.Compiled:
        stats.xla_compiles += 1
        return lowered.compile(compiler_options=dict(COMPILER_OPTIONS))

    # -- entries ------------------------------------------------------------------------

    def _load(self, path: Path, platform_name: str) -> tuple[jax.stages.Compiled | None, str]:
        try:
            blob = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # (the write says why, if it fails)
            return None, "not cached yet"
        except OSError as e:
            self._warn("read", f"cannot read {path} ({e}); compiling instead")
            return None, "unreadable entry"
        body = blob[len(_MAGIC) + _DIGEST :]
        if (
            not blob.startswith(_MAGIC)
            or blob[len(_MAGIC) : len(_MAGIC) + _DIGEST] != hashlib.sha256(body).digest()
        ):
            self._warn("corrupt", f"corrupt cache entry {path.name}; compiling it again")
            return None, "corrupt entry"
        try:
            payload, in_tree, out_tree = pickle.loads(body)
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=platform_name
            )
        except Exception as e:  # noqa: BLE001 - an entry that passed its checksum but
            # cannot be loaded (e.g. written by a jaxlib that pickles differently) is
            # stale, not fatal: compile and overwrite it.
            self._warn(
                "corrupt", f"cannot load cache entry {path.name} ({type(e).__name__}); compiling"
            )
            return None, "unloadable entry"
        return compiled, ""

    def _store(self, path: Path, compiled: jax.stages.Compiled, name: str) -> None:
        if self._unwritable:
            return
        try:
            body = pickle.dumps(serialize_executable.serialize(compiled))
        except (ValueError, NotImplementedError, TypeError, pickle.PicklingError) as e:
            # e.g. executables with host callbacks or closed-over constants
            log.info("not caching %s: the executable cannot be serialized (%s)", name, e)
            return
        blob = _MAGIC + hashlib.sha256(body).digest() + body
        tmp = None
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".bin")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            self._unwritable = True  # one warning, no further attempts in this process
            self._warn(
                "write",
                f"cannot write the compilation cache at {self.directory} ({e}); running "
                "without it. Set DYNAJAX_CACHE_DIR to a writable directory, or to '' to "
                "turn the cache off.",
            )
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def _warn(self, kind: str, message: str) -> None:
        """Logs every problem; warns once per kind of problem and cache."""
        log.warning("dynajax compilation cache: %s", message)
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        warnings.warn(f"dynajax compilation cache: {message}", RuntimeWarning, stacklevel=2)


def stats_of(items: Any) -> CompileStats:
    """The sum of the ``CompileStats`` in ``items``."""
    total = CompileStats()
    for s in items:
        total += s
    return total
