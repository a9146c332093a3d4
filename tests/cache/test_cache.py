"""The persistent compilation cache: reuse across processes, hits and misses with
reasons, and a corrupt, unloadable or unwritable cache that never breaks a run.
(Authentication: test_security.py; the size bound and concurrent writers:
test_bound.py.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dynajax
from dynajax.lowering import attention
from dynajax.runtime import cache
from dynajax.store import default_cache_dir
from tests.helpers import run_python
from tests.models import mlp
from tests.tolerances import assert_same


def _run(cache_dir, fn, *args, **options):
    torch._dynamo.reset()
    backend = dynajax.Backend(cache_dir=str(cache_dir), **options)
    out = torch.compile(fn, backend=backend)(*args)
    return out, dynajax.Report(backend.graphs).compile_stats


def _f(x):
    return torch.sin(x) * 2 + x.exp()


def _entries(path: Path) -> list[Path]:
    return sorted(path.glob("*.bin"))


def test_hit_in_a_second_compile(tmp_path) -> None:
    x = torch.randn(4, 3)
    out, first = _run(tmp_path, _f, x)
    assert_same(out, _f(x))
    assert first.xla_compiles == 1 and first.cache_hits == 0
    assert dict(first.cache_misses) == {"not cached yet": 1}
    assert len(_entries(tmp_path)) == 1
    out, second = _run(tmp_path, _f, x)
    assert_same(out, _f(x))
    assert second.xla_compiles == 0 and second.cache_hits == 1
    assert not second.cache_misses


def test_key_covers_shapes_dtypes_and_options(tmp_path) -> None:
    x = torch.randn(4, 3)
    _run(tmp_path, _f, x)
    _, other_shape = _run(tmp_path, _f, torch.randn(5, 3))
    _, other_dtype = _run(tmp_path, _f, x.double())
    # fallback_ops changes what the partition contains: a different program
    _, other_options = _run(tmp_path, _f, x, fallback_ops=["aten.exp"])
    for stats in (other_shape, other_dtype, other_options):
        assert stats.cache_hits == 0 and stats.xla_compiles >= 1, stats
    assert len(_entries(tmp_path)) == 4


def test_key_covers_the_cpu_count(tmp_path, monkeypatch) -> None:
    """The attention rule splits its heads by the CPUs the process may use, so an
    executable compiled under another count is another program."""
    x = torch.randn(4, 3)
    _run(tmp_path, _f, x)
    # Another count than this machine's, whatever it has (a constant would be this
    # machine's count on some machine, and the same program there).
    other = attention.cpus() + 1
    monkeypatch.setattr(attention, "cpus", lambda: other)
    cache._cpu.cache_clear()
    try:
        _, other_count = _run(tmp_path, _f, x)
    finally:
        cache._cpu.cache_clear()
    assert other_count.cache_hits == 0 and other_count.xla_compiles == 1, other_count
    assert len(_entries(tmp_path)) == 2


def test_hits_and_misses_are_logged(tmp_path, caplog) -> None:
    x = torch.randn(3)
    with caplog.at_level(logging.DEBUG, logger="dynajax.cache"):
        _run(tmp_path, _f, x)
        _run(tmp_path, _f, x)
    messages = [r.getMessage() for r in caplog.records if r.name == "dynajax.cache"]
    assert any("cache miss" in m and "not cached yet" in m for m in messages), messages
    assert any("cache hit" in m for m in messages), messages


def test_reused_across_processes(tmp_path) -> None:
    code = textwrap.dedent(
        """
        import json, torch, dynajax
        from tests.models import mlp
        torch.manual_seed(0)
        model = mlp().eval()
        backend = dynajax.Backend()
        x = torch.randn(8, 32)
        with torch.no_grad():
            out = torch.compile(model, backend=backend)(x)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
        stats = dynajax.Report(backend.graphs).compile_stats
        print(json.dumps([stats.xla_compiles, stats.cache_hits, out.sum().item()]))
        """
    )
    env = dict(os.environ, DYNAJAX_CACHE_DIR=str(tmp_path))
    root = Path(__file__).resolve().parents[2]
    results = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(proc.stdout.strip().splitlines()[-1])
    import json

    (c1, h1, s1), (c2, h2, s2) = map(json.loads, results)
    assert (c1, h1) == (1, 0)
    assert (c2, h2) == (0, 1)  # the second process compiled nothing
    assert s1 == s2


def test_an_entry_for_one_device_loads_onto_that_device_among_eight(tmp_path) -> None:
    # JAX's loader gives an executable every device of the platform unless told which:
    # with 8 CPU devices a cached single-device executable then expected 8 shards per
    # argument ("Expected args to execute_sharded_on_local_devices to have 8 shards").
    code = textwrap.dedent(
        """
        import torch, dynajax
        from tests.models import mlp
        torch.manual_seed(0)
        model = mlp().eval()
        x = torch.randn(8, 32)
        outs = []
        for _ in range(2):  # the second backend loads the first one's entry
            torch._dynamo.reset()
            backend = dynajax.Backend()
            with torch.no_grad():
                outs.append(torch.compile(model, backend=backend)(x))
        torch.testing.assert_close(outs[1], outs[0])
        print(dynajax.Report(backend.graphs).compile_stats.cache_hits)
        """
    )
    hits = run_python(
        "-c",
        code,
        timeout=300,
        DYNAJAX_CACHE_DIR=str(tmp_path),
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
    )
    assert hits == "1"


def test_corrupt_entry_warns_and_recompiles(tmp_path) -> None:
    x = torch.randn(4, 3)
    _run(tmp_path, _f, x)
    [entry] = _entries(tmp_path)
    entry.write_bytes(b"garbage" * 100)
    with pytest.warns(RuntimeWarning, match="corrupt cache entry"):
        out, stats = _run(tmp_path, _f, x)
    assert_same(out, _f(x))
    assert dict(stats.cache_misses) == {"corrupt entry": 1} and stats.xla_compiles == 1
    _, again = _run(tmp_path, _f, x)  # the entry was written anew
    assert again.cache_hits == 1


def test_truncated_entry_warns_and_recompiles(tmp_path) -> None:
    x = torch.randn(4, 3)
    _run(tmp_path, _f, x)
    [entry] = _entries(tmp_path)
    entry.write_bytes(entry.read_bytes()[: len(entry.read_bytes()) // 2])
    with pytest.warns(RuntimeWarning, match="failed authentication"):
        out, stats = _run(tmp_path, _f, x)
    assert_same(out, _f(x))
    assert stats.cache_misses["unauthenticated entry"] == 1


def test_entry_that_cannot_be_loaded_warns_and_recompiles(tmp_path) -> None:
    import pickle

    from dynajax import store

    x = torch.randn(4, 3)
    _run(tmp_path, _f, x)
    [entry] = _entries(tmp_path)
    body = pickle.dumps(("not an executable", None, None))
    secret = store.default_key_file().read_bytes()
    entry.write_bytes(store._MAGIC + store._mac(secret, entry.stem, body) + body)  # authentic
    with pytest.warns(RuntimeWarning, match="cannot load cache entry"):
        out, stats = _run(tmp_path, _f, x)
    assert_same(out, _f(x))
    assert stats.cache_misses["unloadable entry"] == 1


def test_unwritable_directory_warns_and_runs(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    x = torch.randn(4, 3)
    with pytest.warns(RuntimeWarning, match="cannot write the compilation cache"):
        out, stats = _run(blocker / "cache", _f, x)
    assert_same(out, _f(x))
    assert stats.xla_compiles == 1


def test_disabled_cache_writes_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", "")
    backend = dynajax.Backend()
    assert backend.cache.directory is None
    x = torch.randn(3)
    assert_same(torch.compile(_f, backend=backend)(x), _f(x))
    stats = dynajax.Report(backend.graphs).compile_stats
    assert stats.xla_compiles == 1 and not stats.cache_misses and stats.cache_hits == 0
    assert list(tmp_path.iterdir()) == []


def test_default_directory(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "dynajax" / "xla"
    monkeypatch.delenv("DYNAJAX_CACHE_DIR", raising=False)
    assert dynajax.Backend().cache.directory == tmp_path / "dynajax" / "xla"
    assert dynajax.Backend(cache_dir=str(tmp_path / "x")).cache.directory == tmp_path / "x"


def test_dynamic_shapes_share_the_cache(tmp_path) -> None:
    model = mlp().eval()
    for expected_hits in (0, 3):
        torch._dynamo.reset()
        backend = dynajax.Backend(cache_dir=str(tmp_path))
        f = torch.compile(model, backend=backend, dynamic=True)
        with torch.no_grad():
            for n in (2, 3, 4):
                x = torch.randn(n, 32)
                assert_same(f(x), model(x))
        stats = dynajax.Report(backend.graphs).compile_stats
        assert stats.cache_hits == expected_hits and stats.xla_compiles == 3 - expected_hits
    assert "compiles: 0 XLA compile(s), 3 cache hit(s)" in dynajax.Report(backend.graphs).text(
        width=None
    )


def test_float32_matmul_precision_is_part_of_the_program(tmp_path) -> None:
    # PyTorch's default "highest" lowers float32 products at JAX's HIGHEST precision
    # (JAX's own default is TF32 on a GPU); "high" allows TF32 and is another program.
    x = torch.randn(4, 4)

    def mm(x):
        return x @ x

    assert torch.get_float32_matmul_precision() == "highest"
    _, first = _run(tmp_path, mm, x)
    _, again = _run(tmp_path, mm, x)
    assert again.cache_hits == 1
    torch.set_float32_matmul_precision("high")
    try:
        _, high = _run(tmp_path, mm, x)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert high.cache_hits == 0 and high.xla_compiles == 1, high
    assert len(_entries(tmp_path)) == 2


def test_an_executable_calling_lapack_runs_when_loaded_in_a_new_process(tmp_path) -> None:
    # A triangular solve is jaxlib's LAPACK kernel (a custom call); a process that loads
    # its executable without having lowered any linear algebra crashed running it
    # (SIGSEGV in jaxlib 0.10.2) until the kernels are initialized before the load.
    code = (
        "import dynajax, torch\n"
        "torch.manual_seed(0)\n"
        "a = torch.randn(6, 6).tril() + 6 * torch.eye(6); b = torch.randn(6, 3)\n"
        "f = lambda a, b: torch.linalg.solve_triangular(a, b, upper=False) * 2\n"
        "backend = dynajax.Backend()\n"
        "out = torch.compile(f, backend=backend)(a, b)\n"
        "torch.testing.assert_close(out, f(a, b))\n"
        "print(backend.graphs[0].compile_stats.line())\n"
    )
    first = run_python("-c", code, timeout=300, DYNAJAX_CACHE_DIR=str(tmp_path))
    second = run_python("-c", code, timeout=300, DYNAJAX_CACHE_DIR=str(tmp_path))
    assert "1 XLA compile(s)" in first, first
    assert "1 cache hit(s)" in second, second
