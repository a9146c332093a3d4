"""The persistent cache's blob store: authenticated entries in one directory, shared
across processes and bounded in size.

Its users name what it keeps: compiled executables (``runtime/cache.py``, entries
``<key>.bin``) and values, what a compile computes besides executables:

    entry = <dir>/<key>.bin:  MAGIC | HMAC-SHA256(secret, MAGIC | key | body) | body

    value key = sha256(kind, format, description)      (``value_key``; kind "aot":
                                                         aot_autograd's ATen graph,
                                                         ``aot/cache.py``;
                                                         "verdicts": abstract
                                                         evaluations of rules,
                                                         ``capability/memo.py``)
    entry     = <dir>/<key>.<kind>, authenticated the same way; body pickle((versions,
                payload bytes))

``versions`` (jax, jaxlib, torch, dynajax and a digest of dynajax's sources) are
compared when an entry is loaded: an entry of another version is a miss with the
reason ``stale entry (<what> changed)``, computed again and overwritten.

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
renamed over ``<key>.bin`` (or ``<key>.<kind>``; ``os.replace``, atomic), so a reader
sees no entry or a whole one; a process killed while writing leaves only a temporary
file, which nothing loads and a later store removes (once it is a minute old and its
writer's process on this host is gone, or once it is an hour old).
Evictions racing with each other or with a reader are harmless: a removed file is a
later miss, a file removed twice is ignored, and an open file stays readable. After
every store, the directory is within the bound once the last writer's scan is done.

A cache never breaks a run. A missing entry is a miss, with its reason, and its user
computes and stores it; a corrupt, unauthenticated or unloadable entry warns and is a
miss, overwritten by the next store; an unreadable or unwritable directory, or an
unusable key, warns once and the store is skipped. Problems are logged on
``dynajax.cache``.

This module is a leaf: it imports nothing of dynajax but ``dynajax._version``, so every
stage may keep what it computes here (``capability/memo.py`` does, below the runtime).
"""

from __future__ import annotations

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
from pathlib import Path
from typing import IO, Any, TypeVar

import jax
import jaxlib
import torch

from dynajax._version import __version__

log = logging.getLogger("dynajax.cache")

FORMAT = 4  # bump when the on-disk layout changes
_MAGIC = b"DYNAJAX-XLA\x04"
_MAC = 32  # bytes of an HMAC-SHA256
_KEY_BYTES = 32

DEFAULT_MAX_BYTES = 1 << 30
"""The default bound of a cache directory (``cache_max_bytes``): 1 GiB."""

# Only these are ever loaded or evicted: executables (.bin, runtime/cache.py's) and
# values (.aot: aot_autograd's graphs, .verdicts: abstract evaluations of rules).
_VALUE_KINDS = ("aot", "verdicts")
_ENTRY = re.compile(r"[0-9a-f]{64}\.(bin|aot|verdicts)")
_TEMP = re.compile(r"\.tmp-([0-9a-f]{8})-([0-9]+)-[A-Za-z0-9_]+\.part")
# A temporary file whose writer's process is gone (same host) is removed after this
# long; one from another host, or whose writer cannot be checked, after the second.
_TEMP_DEAD_S = 60.0
_TEMP_ABANDONED_S = 3600.0
_HOST = hashlib.sha256(platform.node().encode()).hexdigest()[:8]

_S = TypeVar("_S", bound="BlobStore")


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


@functools.cache
def versions() -> tuple[tuple[str, str], ...]:
    """What a program-keyed entry (and a value entry) must have been written with to be
    loaded: the versions of jax, jaxlib, torch and dynajax, and a digest of dynajax's
    sources (its rules are code; a rule edited without a new version must not reuse old
    programs)."""
    package = Path(__file__).resolve().parent  # (this module lies at dynajax's top)
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


def stale(written: Any) -> str:
    """What differs between the ``versions()`` an entry was written with and ours
    (``"torch, dynajax sources"``); empty if nothing does."""
    ours = dict(versions())
    theirs = dict(written)
    return ", ".join(name for name, value in ours.items() if theirs.get(name) != value)


class BlobStore:
    """A directory of authenticated entries; a ``None`` directory means "off".

    Thread-safe, and safe to share with other processes. ``value_key``, ``load_value``
    and ``store_value`` keep values; ``prune`` enforces the bound. The executables'
    cache is one (``runtime/cache.py``'s ``ExecutableCache``).

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
        cls: type[_S],
        cache_dir: str | os.PathLike[str] | None,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
    ) -> _S:
        """``None`` -> the default directory, ``""`` -> disabled, else that directory;
        ``max_bytes`` is ``cache_max_bytes``."""
        if cache_dir is None:
            return cls(default_cache_dir(), max_bytes=max_bytes)
        return cls(cache_dir or None, max_bytes=max_bytes)

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
                f"corrupt cache entry {path.name} (not a dynajax format-{FORMAT} entry); "
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
        for part in (f"value|{kind}|fmt{FORMAT}", description):
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
        changed = stale(written)
        if changed:
            return None, f"stale entry ({changed} changed)"
        touch(path)
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


def touch(path: Path) -> None:
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
