"""Every code block of README.md and the user guide (docs/*.md) runs.

Each document's Python blocks are collected by Sybil and run in order in one namespace,
in a process of their own (``python -m tests.test_docs FILE``): the guide's mesh
examples need 8 XLA CPU devices, which must be asked for before JAX starts, and files a
snippet writes (``model.stablehlo``) land in a temporary directory. Hidden setup (a
small model, an input) sits in ``<!-- invisible-code-block: python ... -->`` comments.

A document that holds ``<!-- docs-test: devices=8 -->`` runs with 8 XLA CPU devices
(``--xla_force_host_platform_device_count=8``), the others with one; each with a
persistent cache in the temporary directory.

A block that cannot run here (a GPU, several hosts) follows a
``<!-- skip: next "why" -->`` comment: it is compiled, so at least its syntax is
checked. ``bash`` blocks are checked with ``bash -n``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _sybil():
    from sybil import Sybil
    from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

    def check_bash(example) -> None:
        subprocess.run(["bash", "-n"], input=example.parsed, text=True, check=True)

    return Sybil(
        parsers=[
            PythonCodeBlockParser(),
            CodeBlockParser(language="bash", evaluator=check_bash),
            SkipParser(),
        ]
    )


def run_document(path: Path) -> tuple[int, int]:
    """Runs every block of ``path`` in order; returns (blocks run, blocks syntax-checked).

    Raises the first block's error, with the document's line in the message."""
    document = _sybil().parse(path)
    ran = checked = 0
    for example in document.examples():
        source = getattr(example.region, "parsed", None)
        try:
            example.evaluate()
        except unittest.SkipTest:
            # Not runnable here: its Python must still compile.
            if isinstance(source, str) and example.region.evaluator is not None:
                compile(str(source), f"{path.name}:{example.line}", "exec")
                checked += 1
            continue
        except Exception as e:
            raise AssertionError(
                f"{path.relative_to(ROOT)}, the block at line {example.line} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        ran += 1
    return ran, checked


def _has_blocks(path: Path) -> bool:
    text = path.read_text()
    return "```python" in text or "```bash" in text or "invisible-code-block" in text


@pytest.mark.parametrize(
    "document",
    [d for d in DOCUMENTS if _has_blocks(d)],
    ids=lambda d: str(d.relative_to(ROOT)),
)
def test_code_blocks_run(document: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    many_devices = "<!-- docs-test: devices=8 -->" in document.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        if many_devices:
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        else:
            env.pop("XLA_FLAGS", None)
        env["DYNAJAX_CACHE_DIR"] = os.path.join(tmp, "cache")
        env["XDG_CONFIG_HOME"] = os.path.join(tmp, "config")
        done = subprocess.run(
            [sys.executable, "-m", "tests.test_docs", str(document)],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


def test_every_document_is_collected() -> None:
    """A page with Python blocks and no runnable one would pass vacuously."""
    for document in DOCUMENTS:
        if "```python" in document.read_text():
            examples = list(_sybil().parse(document).examples())
            assert examples, f"{document.name}: Python blocks, but none collected"


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_options_table_has_every_option() -> None:
    from dynajax.config import Options

    table = _hooks().options_table()
    for name in Options.names():
        row = next((r for r in table.splitlines() if r.startswith(f"| `{name}` |")), None)
        assert row is not None, f"option {name} missing from the generated table"
        assert row.split("|")[4].strip(), f"option {name}: no description in Options' docstring"


def test_api_reference_lists_every_public_name() -> None:
    """docs/reference.md names each entry of ``dynajax.__all__`` (mkdocstrings renders
    its docstring), so a new public name cannot go undocumented."""
    import dynajax

    reference = (ROOT / "docs" / "reference.md").read_text()
    missing = [
        name
        for name in dynajax.__all__
        if name != "__version__"
        and f"::: dynajax.{name}" not in reference
        and not reference.count(f"::: dynajax.{name}.")
    ]
    assert not missing, f"add to docs/reference.md: {missing}"


def test_generated_pages_name_their_markers() -> None:
    """Every ``<!-- generated: X -->`` of the guide has a generator (else the build fails
    late, in mkdocs); the pages that promise generated tables still ask for them."""
    hooks = _hooks()
    asked = set()
    for document in DOCUMENTS:
        asked |= set(hooks.MARKER.findall(document.read_text()))
    assert asked <= set(hooks.GENERATORS)
    assert {"options", "ops", "opinfo"} <= asked


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("error", category=DeprecationWarning, module="dynajax")
    target = Path(sys.argv[1]).resolve()
    ran, checked = run_document(target)
    print(f"{target.relative_to(ROOT)}: {ran} block(s) ran, {checked} syntax-checked")
