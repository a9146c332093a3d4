"""Entries are authenticated with a per-user key kept outside the cache directory: a
planted or tampered entry is never unpickled nor handed to XLA; it warns and compiles."""

from __future__ import annotations

import hashlib
import os
import pickle
import stat
import threading
from pathlib import Path

import pytest
import torch

import dynajax
from dynajax import store
from tests.tolerances import assert_same


def _run(cache_dir: Path, x: torch.Tensor):
    torch._dynamo.reset()
    backend = dynajax.Backend(cache_dir=str(cache_dir))
    out = torch.compile(_f, backend=backend)(x)
    return out, dynajax.Report(backend.graphs).compile_stats


def _f(x):
    return torch.sin(x) * 2 + x.exp()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class _Payload:
    """Unpickling this creates ``marker``: what an attacker's entry would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_key_is_private_and_outside_the_cache(tmp_path) -> None:
    x = torch.randn(4, 3)
    _run(tmp_path / "cache", x)
    key = store.default_key_file()
    assert key.parent.parent == Path(os.environ["XDG_CONFIG_HOME"])
    assert not key.is_relative_to(tmp_path / "cache")
    assert len(key.read_bytes()) == 32
    assert _mode(key) == 0o600 and _mode(key.parent) == 0o700
    before = key.read_bytes()
    _, again = _run(tmp_path / "cache", x)
    assert again.cache_hits == 1 and key.read_bytes() == before  # made once, reused


def _planted_bad_mac(body: bytes, name: str) -> bytes:
    return store._MAGIC + os.urandom(32) + body


def _planted_other_key(body: bytes, name: str) -> bytes:
    return store._MAGIC + store._mac(os.urandom(32), name, body) + body


def _planted_old_format(body: bytes, name: str) -> bytes:
    # dynajax's format 2: a plain checksum, which anyone can compute
    return b"DYNAJAX-XLA\x00" + hashlib.sha256(body).digest() + body


@pytest.mark.parametrize(
    "plant, reason",
    [
        (_planted_bad_mac, "unauthenticated entry"),
        (_planted_other_key, "unauthenticated entry"),
        (_planted_old_format, "corrupt entry"),
    ],
    ids=["random-mac", "attackers-key", "checksum-only"],
)
def test_planted_pickle_is_never_unpickled(tmp_path, plant, reason) -> None:
    x = torch.randn(4, 3)
    _run(tmp_path / "cache", x)
    [entry] = (tmp_path / "cache").glob("*.bin")
    marker = tmp_path / "pwned"
    body = pickle.dumps(_Payload(marker))
    # The payload is armed: unpickling it elsewhere does create a marker.
    armed = tmp_path / "armed"
    pickle.loads(pickle.dumps(_Payload(armed)))
    assert armed.exists()

    entry.write_bytes(plant(body, entry.stem))
    with pytest.warns(RuntimeWarning, match="failed authentication|corrupt cache entry"):
        out, stats = _run(tmp_path / "cache", x)
    assert not marker.exists()
    assert_same(out, _f(x))
    assert dict(stats.cache_misses) == {reason: 1} and stats.xla_compiles == 1
    _, again = _run(tmp_path / "cache", x)  # overwritten with an authentic entry
    assert again.cache_hits == 1 and not marker.exists()


def test_authentic_entry_replayed_under_another_name_is_rejected(tmp_path) -> None:
    # The MAC covers the entry's name (its key): a valid entry of one program copied
    # over another's would otherwise load the wrong executable.
    small, large = torch.randn(4, 3), torch.randn(5, 3)
    _run(tmp_path, small)
    [a] = tmp_path.glob("*.bin")
    _run(tmp_path, large)
    [b] = set(tmp_path.glob("*.bin")) - {a}
    b.write_bytes(a.read_bytes())
    with pytest.warns(RuntimeWarning, match="failed authentication"):
        out, stats = _run(tmp_path, large)
    assert_same(out, _f(large))
    assert dict(stats.cache_misses) == {"unauthenticated entry": 1}


def test_symlink_under_an_entry_name_is_not_followed(tmp_path) -> None:
    x = torch.randn(4, 3)
    _run(tmp_path / "cache", x)
    [entry] = (tmp_path / "cache").glob("*.bin")
    elsewhere = tmp_path / "elsewhere.bin"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)
    with pytest.warns(RuntimeWarning, match="cannot read"):
        out, stats = _run(tmp_path / "cache", x)
    assert_same(out, _f(x))
    assert dict(stats.cache_misses) == {"unreadable entry": 1}


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda key: key.chmod(0o644), r"mode 644.*chmod 600"),
        (lambda key: key.parent.chmod(0o777), r"mode 777.*chmod go-w"),
        (lambda key: key.write_bytes(b"short"), r"damaged \(5 bytes, expected 32\)"),
    ],
    ids=["key-readable-by-others", "key-directory-writable-by-others", "key-damaged"],
)
def test_unsafe_key_turns_the_cache_off(tmp_path, spoil, message) -> None:
    x = torch.randn(4, 3)
    _run(tmp_path, x)  # an entry, and the key
    spoil(store.default_key_file())
    with pytest.warns(RuntimeWarning, match=message):
        out, stats = _run(tmp_path, x)
    assert_same(out, _f(x))
    assert dict(stats.cache_misses) == {"no cache key": 1} and stats.cache_hits == 0
    assert stats.xla_compiles == 1


def test_key_created_by_many_at_once_is_one_key(tmp_path) -> None:
    path = tmp_path / "config" / "dynajax" / "cache.key"
    start = threading.Barrier(8)
    keys: list[bytes] = []

    def make() -> None:
        start.wait()
        keys.append(store._load_or_create_key(path))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(keys) == 8 and len(set(keys)) == 1 and keys[0] == path.read_bytes()
    assert os.listdir(path.parent) == ["cache.key"]  # no temp file left
    assert _mode(path) == 0o600
