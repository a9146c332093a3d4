"""The cache directory stays within ``cache_max_bytes`` (least recently used entries go
first), several processes can write it at once, and a writer killed half way leaves
nothing that a later process loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dynajax
from dynajax import Options, OptionsError, store
from dynajax.capability import memo
from dynajax.runtime.cache import CompileStats, ExecutableCache
from tests.cache.worker import graph
from tests.tolerances import assert_same

ROOT = Path(__file__).resolve().parents[2]


def _lowered(n: int) -> jax.stages.Lowered:
    """A small program per ``n`` (its shape), so each has an entry of its own."""
    return jax.jit(lambda x: jnp.sin(x) * 2 + 1).lower(jax.ShapeDtypeStruct((n,), jnp.float32))


def _compile(c: ExecutableCache, n: int, stats: CompileStats | None = None) -> CompileStats:
    stats = stats if stats is not None else CompileStats()
    exe = c.compile(_lowered(n), stats)
    x = np.arange(n, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(exe(x)), np.sin(x) * 2 + 1, rtol=1e-5, atol=1e-6)
    return stats


def _entries(directory: Path) -> dict[str, int]:
    """Every entry: executables, aot_autograd's graphs, abstract evaluations."""
    found = [p for kind in ("bin", "aot", "verdicts") for p in directory.glob(f"*.{kind}")]
    return {p.name: p.stat().st_size for p in found}


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def _entry_of(c: ExecutableCache, n: int) -> Path:
    assert c.directory is not None
    return c.directory / f"{c.key(_lowered(n), 'cpu')}.bin"


def test_least_recently_used_entries_are_evicted(tmp_path) -> None:
    probe = ExecutableCache(tmp_path / "probe", max_bytes=None)
    _compile(probe, 8)
    size = max(_entries(tmp_path / "probe").values())
    c = ExecutableCache(tmp_path / "c", max_bytes=int(2.5 * size))
    for n in (8, 9):
        _compile(c, n)
    _age(_entry_of(c, 8), 30)
    _age(_entry_of(c, 9), 20)
    assert _compile(c, 8).cache_hits == 1  # a hit is a use: 8 is now the newest
    stats = _compile(c, 10)  # a third entry: over the bound, the oldest goes
    assert stats.cache_evictions == 1 and "1 cache entr(ies) evicted" in stats.line()
    assert not _entry_of(c, 9).exists()
    assert _entry_of(c, 8).exists() and _entry_of(c, 10).exists()
    assert sum(_entries(tmp_path / "c").values()) <= c.max_bytes


@pytest.mark.parametrize("unbounded", [None, 0])
def test_none_or_zero_is_no_bound(tmp_path, unbounded) -> None:
    c = ExecutableCache(tmp_path, max_bytes=unbounded)
    assert c.max_bytes is None
    for n in range(8, 14):
        _compile(c, n)
    assert len(_entries(tmp_path)) == 6


def test_entry_larger_than_the_bound_is_not_stored(tmp_path, caplog) -> None:
    c = ExecutableCache(tmp_path, max_bytes=100)
    with caplog.at_level("INFO", logger="dynajax.cache"):
        _compile(c, 8)
    assert _entries(tmp_path) == {}
    assert "larger than cache_max_bytes (100)" in caplog.text


def test_files_that_are_not_entries_are_never_evicted(tmp_path) -> None:
    mine = {"notes.txt": b"x" * 100_000, "model.bin": b"y" * 100_000, ".tmp-x.part": b"z"}
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
    c = ExecutableCache(tmp_path, max_bytes=1)
    assert c.prune() == 0
    old_tmp = tmp_path / f".tmp-{store._HOST}-1-abc.part"  # a dynajax temp, a day old
    old_tmp.write_bytes(b"half an entry")
    _age(old_tmp, 86_400)
    c.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(mine)


def test_option_and_environment_variable(monkeypatch) -> None:
    assert Options().cache_max_bytes == 1 << 30
    assert dynajax.Backend().cache.max_bytes == 1 << 30
    monkeypatch.setenv("DYNAJAX_CACHE_MAX_BYTES", "1000")
    assert Options.resolve().cache_max_bytes == 1000
    assert dynajax.Backend().cache.max_bytes == 1000
    assert dynajax.Backend(cache_max_bytes=None).cache.max_bytes is None
    monkeypatch.setenv("DYNAJAX_CACHE_MAX_BYTES", "0")
    assert dynajax.Backend().cache.max_bytes is None
    monkeypatch.setenv("DYNAJAX_CACHE_MAX_BYTES", "-1")
    with pytest.raises(OptionsError, match="DYNAJAX_CACHE_MAX_BYTES='-1': cache_max_bytes must"):
        Options.resolve()
    monkeypatch.setenv("DYNAJAX_CACHE_MAX_BYTES", "1G")
    with pytest.raises(OptionsError, match="is not an integer"):
        Options.resolve()
    monkeypatch.delenv("DYNAJAX_CACHE_MAX_BYTES")
    for bad in (-5, 1.5, "big", True):
        with pytest.raises(OptionsError, match="cache_max_bytes must be an int >= 0"):
            Options(cache_max_bytes=bad)


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.cache.worker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),  # XDG_CONFIG_HOME: this test's key
    )


def test_four_processes_share_one_bounded_directory(tmp_path) -> None:
    # Four processes at once, each compiling the same four graphs and two of its own,
    # twice over, against a directory bounded to about three entries: stores, hits,
    # evictions and overwrites of one entry by several writers all race.
    directory, go = tmp_path / "cache", tmp_path / "go"
    bound = 35_000
    shared = ["2", "3", "4", "5"]
    procs = []
    for i in range(4):
        own = [str(10 + 2 * i), str(11 + 2 * i)]
        procs.append(_spawn("compile", str(directory), str(bound), str(go), *shared, *own))
    time.sleep(1)
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["compiles"] + r["hits"] == 12, r  # one partition per graph
        assert set(r["misses"]) <= {"not cached yet"}, r  # never a bad entry
    assert sum(r["evicted"] for r in results) > 0
    sizes = _entries(directory)
    assert 0 < sum(sizes.values()) <= bound, sizes
    assert sorted(p.name for p in directory.iterdir()) == sorted(sizes)  # no temp files
    # every entry left is whole and authentic
    secret = store.default_key_file().read_bytes()
    for name in sizes:
        blob = (directory / name).read_bytes()
        body = blob[len(store._MAGIC) + 32 :]
        assert blob[len(store._MAGIC) : len(store._MAGIC) + 32] == store._mac(
            secret, name.split(".")[0], body
        )


def test_writer_killed_half_way_leaves_nothing_loadable(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(memo, "_MEMORY", {})  # evaluated here, so stored here
    directory, ready = tmp_path / "cache", tmp_path / "ready"
    proc = _spawn("stall", str(directory), str(ready))
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    [partial] = directory.iterdir()  # half an entry, under a temp name only
    assert partial.name.startswith(".tmp-") and partial.suffix == ".part"
    assert _entries(directory) == {}

    _age(partial, 120)  # "later": a temp file of a dead writer, older than a minute
    torch._dynamo.reset()
    backend = dynajax.Backend(cache_dir=str(directory))
    x = torch.randn(4, 3)
    assert_same(torch.compile(graph, backend=backend)(x), graph(x))
    stats = dynajax.Report(backend.graphs).compile_stats
    assert dict(stats.cache_misses) == {"not cached yet": 1} and stats.xla_compiles == 1
    assert not partial.exists()  # cleaned up by the store
    # the executable, aot_autograd's graph and the abstract evaluations of its rules
    assert sorted(p.suffix for p in directory.iterdir()) == [".aot", ".bin", ".verdicts"]
    torch._dynamo.reset()
    backend = dynajax.Backend(cache_dir=str(directory))
    assert_same(torch.compile(graph, backend=backend)(x), graph(x))
    assert dynajax.Report(backend.graphs).compile_stats.cache_hits == 1
    assert backend.graphs[0].aot == "loaded from the cache (not traced)"


def test_young_temp_file_of_a_live_writer_is_kept(tmp_path) -> None:
    c = ExecutableCache(tmp_path, max_bytes=None)
    live = tmp_path / f".tmp-{store._HOST}-{os.getpid()}-abc.part"
    live.write_bytes(b"being written")
    _age(live, 600)  # older than a minute, but its writer (this process) is alive
    _compile(c, 8)
    assert live.exists()
    dead = tmp_path / f".tmp-{store._HOST}-{_dead_pid()}-abc.part"
    dead.write_bytes(b"half")  # a dead writer's, but only just written: kept for now
    c.prune()
    assert dead.exists()
    _age(dead, 120)
    c.prune()
    assert not dead.exists() and live.exists()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid
