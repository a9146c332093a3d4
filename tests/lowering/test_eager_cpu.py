"""Rules that follow eager's CPU kernel bit for bit where the kernel itself depends on
the CPU capability it dispatched to and on its thread count (``lowering/eager_cpu.py``).
Each capability the machine has runs in its own process (``ATEN_CPU_CAPABILITY``), at
1, 2 and 3 threads."""

from __future__ import annotations

import pytest
import torch

from dynajax.lowering import eager_cpu
from tests.helpers import run_worker


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_half_softmax_follows_eagers_vectorized_positions(
    capability: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if capability == "avx512" and "avx512f" not in _cpu_flags():
        # Asked for a capability the CPU lacks, this torch runs AVX-512 code and dies
        # of an illegal instruction (seen on an AVX2-only AMD EPYC).
        pytest.skip("this CPU has no avx512 (no avx512f in /proc/cpuinfo)")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    facts = run_worker("tests.lowering.eager_cpu_worker", "1", "2", "3", timeout=600)
    if facts["capability"] != capability.upper():
        # ATen takes the best capability the CPU has at most: an AVX2-only machine
        # runs "avx512" as AVX2, which the "avx2" case already covers.
        pytest.skip(f"this CPU has no {capability}: eager dispatched to {facts['capability']}")
    assert facts["differs"] == []


def test_settings_name_the_capability_and_threads() -> None:
    # Part of every program's cache key: a program traced under one capability or
    # thread count must not be reused under another.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert eager_cpu.settings() == f"cpu_capability={eager_cpu.capability()} threads=3"
    finally:
        torch.set_num_threads(threads)
    assert eager_cpu.vector_bytes() == (64 if eager_cpu.capability() == "AVX512" else 32)
