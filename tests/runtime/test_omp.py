"""runtime/omp.py: libgomp's spin shortened when dynajax is imported before torch, left
alone otherwise (torch first, the user's own setting, DYNAJAX_GOMP_SPINCOUNT=off), and
the shortened spin measured: PyTorch's OpenMP threads sleep soon after an eager op."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.helpers import run_python


def _run(code: str, **env: str) -> dict[str, object]:
    result: dict[str, object] = json.loads(
        run_python("-c", textwrap.dedent(code), timeout=300, unset=_SETTINGS, **env)
    )
    return result


_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "DYNAJAX_GOMP_SPINCOUNT")


FIRST = """
import json, os
import dynajax, torch
print(json.dumps({"spin": os.environ.get("GOMP_SPINCOUNT")}))
"""


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, "10000"),
        ({"DYNAJAX_GOMP_SPINCOUNT": "2000"}, "2000"),
        ({"DYNAJAX_GOMP_SPINCOUNT": "off"}, None),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, None),  # the user's choice stands
    ],
)
def test_dynajax_first_sets_the_spin_unless_told_otherwise(
    env: dict[str, str], expected: str | None
) -> None:
    assert _run(FIRST, **env)["spin"] == expected


def test_torch_first_is_left_alone_and_the_first_compile_says_how() -> None:
    out = _run(
        """
        import json, logging, os
        import torch, dynajax
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("dynajax.runtime").addHandler(handler)
        logging.getLogger("dynajax.runtime").setLevel(logging.INFO)
        torch.compile(lambda x: x + 1, backend="dynajax")(torch.ones(2))
        said = [r.getMessage() for r in records if "GOMP_SPINCOUNT" in r.getMessage()]
        print(json.dumps({"spin": os.environ.get("GOMP_SPINCOUNT"), "said": len(said)}))
        """
    )
    assert out == {"spin": None, "said": 1}


@pytest.mark.parametrize("torch_first", [True, False])
def test_a_report_of_cpu_partitions_says_how_when_torch_came_first(torch_first: bool) -> None:
    imports = "import torch, dynajax" if torch_first else "import dynajax, torch"
    out = _run(
        f"""
        import json
        {imports}
        report = dynajax.explain(lambda x: x + 1, torch.ones(2))
        print(json.dumps({{"note": "GOMP_SPINCOUNT=10000" in report.text(width=None)}}))
        """
    )
    assert out == {"note": torch_first}


def test_the_shortened_spin_lets_torch_threads_sleep() -> None:
    # CPU time the process burns in the 20 ms after an eager op that uses every thread:
    # 9.5 ms with libgomp's default spin on this project's machine, 1.7 ms shortened.
    out = _run(
        """
        import json, resource, time
        import dynajax, torch
        a = torch.randn(512, 2048)
        b = torch.randn(2048, 512)
        def cpu():
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime
        spent = []
        for _ in range(15):
            a @ b
            c0 = cpu()
            time.sleep(0.02)
            spent.append(cpu() - c0)
        print(json.dumps({"spin_ms": sorted(spent)[7] * 1e3}))
        """
    )
    assert float(out["spin_ms"]) < 5.0, out  # default spin: 9.5 ms here  # type: ignore[arg-type]
