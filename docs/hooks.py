"""MkDocs hooks: the guide's tables that must not drift are generated from the code.

A page asks for a table with an HTML comment on a line of its own, which this hook
replaces at build time (and which stays invisible where the Markdown is read raw):

    <!-- generated: options -->   dynajax.config.Options: names, defaults, env, meaning
    <!-- generated: ops -->       the lowering registry, one section per rule module
    <!-- generated: core-aten --> tests/lowering/core_aten_coverage.txt, summarized
    <!-- generated: opinfo -->    docs/opinfo_summary.json, the OpInfo table
    <!-- generated: explain-rnn -->   examples/explain_rnn.py's report, as it prints it
                                      now, by default and with allow_rnn

``python docs/hooks.py options`` (or ops, core-aten, opinfo) prints one of them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


def _md(text: str) -> str:
    """reST-style ``code`` of the docstrings as Markdown `code`, on one line."""
    return re.sub(r"``([^`]+)``", r"`\1`", " ".join(text.split())).replace("|", "\\|")


def option_docs() -> dict[str, str]:
    """Each option's description, from the Attributes section of Options' docstring."""
    from dynajax.config import Options

    doc = Options.__doc__ or ""
    section = doc.split("Attributes:", 1)[1]
    out: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        m = re.match(r"^ {8}(\w+): (.*)$", line)
        if m:
            name = m.group(1)
            out[name] = m.group(2)
        elif name and line.startswith(" " * 12):
            out[name] += " " + line.strip()
    return out


def options_table() -> str:
    from dynajax.config import Options

    docs = option_docs()
    rows = [
        "| option | default | environment variable | meaning |",
        "|---|---|---|---|",
    ]
    for field in dataclasses.fields(Options):
        text = docs.get(field.name, "")
        env = ""
        m = re.search(r"\s*Env: (.*?)\.?\s*$", text)
        if m:
            env, text = m.group(1), text[: m.start()]
        elif "No environment variable" in text:
            text = re.sub(r"\s*No environment variable[^.]*\.", "", text)
        default = field.default if field.default is not dataclasses.MISSING else None
        rows.append(f"| `{field.name}` | `{default!r}` | {_md(env) or '(none)'} | {_md(text)} |")
    return "\n".join(rows)


def ops_tables() -> str:
    import dynajax.lowering  # noqa: F401  (fills the table)
    from dynajax.lowering import registry

    ops = registry.supported_ops()
    by_module: dict[str, list[registry.Rule]] = {}
    for op in ops:
        rule = registry.get_rule(op)
        if rule is None or rule.user:
            continue
        module = rule.fn.__module__.removeprefix("dynajax.lowering.")
        by_module.setdefault(module, []).append(rule)
    pending = sorted(registry._PENDING)
    lines = [
        f"{sum(len(v) for v in by_module.values())} ATen and library overloads have a "
        f"JAX rule in this build, in {len(by_module)} modules of `dynajax/lowering/`. "
        "*checked*: the rule has a `check` that may refuse some arguments (the node "
        "then stays in PyTorch with reason `CHECK_REFUSED`); *random*: the rule takes "
        "a PRNG key.",
        "",
        "| module | overloads | checked | random |",
        "|---|---|---|---|",
    ]
    for module in sorted(by_module):
        rules = by_module[module]
        lines.append(
            f"| [`{module}`](#{module.replace('.', '')}) | {len(rules)} | "
            f"{sum(r.check is not None for r in rules)} | {sum(r.needs_key for r in rules)} |"
        )
    if pending:
        lines += [
            "",
            "Rules waiting for their library to define the op (bound when it does): "
            + ", ".join(f"`{name}`" for name in pending)
            + ".",
        ]
    for module in sorted(by_module):
        lines += ["", f"### {module}", ""]
        names = []
        for rule in sorted(by_module[module], key=lambda r: str(r.op)):
            tags = [t for t, on in (("checked", rule.check), ("random", rule.needs_key)) if on]
            names.append(f"`{rule.op}`" + (f" ({', '.join(tags)})" if tags else ""))
        lines.append(", ".join(names))
    return "\n".join(lines)


def core_aten_summary() -> str:
    path = ROOT / "tests" / "lowering" / "core_aten_coverage.txt"
    header = [line[2:] for line in path.read_text().splitlines() if line.startswith("# ")]
    other = []
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        op, verdict = line.split(None, 1)
        if verdict != "rule":
            other.append(f"| `{op}` | {_md(verdict)} |")
    return "\n".join(
        [
            " ".join(header[:2]).rstrip(".") + ", from `tests/lowering/core_aten_coverage.txt`, "
            "which a test keeps true. The core overloads without a rule of their own:",
            "",
            "| overload | verdict |",
            "|---|---|",
            *other,
        ]
    )


def opinfo_table() -> str:
    data = json.loads((DOCS / "opinfo_summary.json").read_text())
    # Two tables of at most 7 columns (tests/test_doc_widths.py): the counts, the shares.
    rows = [
        "| dtype | in JAX | fallback | of which Dynamo | failing | total |",
        "|---|---|---|---|---|---|",
    ]
    shares = [
        "",
        "| dtype | in JAX | in JAX, of what reaches dynajax | ties | float64 |",
        "|---|---|---|---|---|",
    ]
    order = ["float32", "float64", "int64", "int32", "bool", "bfloat16", "float16", "complex64"]
    counts = data["counts"]
    dtypes = [d for d in order if d in counts] + sorted(set(counts) - set(order))
    keys = ("jax", "fallback", "dynamo", "failing", "ties", "float64")
    total = dict.fromkeys(keys, 0)

    def add(name: str, c: dict[str, int]) -> None:
        n = c["jax"] + c["fallback"] + c["failing"]
        reach = n - c["dynamo"]
        rows.append(
            f"| {name} | {c['jax']:,} | {c['fallback']:,} | {c['dynamo']:,} | "
            f"{c['failing']:,} | {n:,} |"
        )
        shares.append(
            f"| {name} | {100 * c['jax'] / n:.1f}% | {100 * c['jax'] / reach:.1f}% | "
            f"{c['ties']:,} | {c['float64']:,} |"
        )

    for dtype in dtypes:
        add(dtype, counts[dtype])
        for k in keys:
            total[k] += counts[dtype].get(k, 0)
    add("all", total)
    reasons = ["", "The most frequent fallback reasons:", ""]
    reasons += ["| samples | reason |", "|---|---|"]
    for reason, n in data.get("top_fallback_reasons", [])[:10]:
        reasons.append(f"| {n:,} | {_md(reason)} |")
    return "\n".join(rows + shares + reasons)


def explain_rnn() -> str:
    """The reports ``examples/explain_rnn.py`` prints, run now (a real report of a
    model with a graph break, and of the same model captured whole, with times)."""
    import os
    import subprocess
    import tempfile

    out = []
    for title, flags in (("By default:", []), ("With `--allow-rnn`:", ["--allow-rnn"])):
        with tempfile.TemporaryDirectory() as cache:
            run = subprocess.run(
                # (wrapped to the width of the guide's code blocks, tests/test_doc_widths.py)
                [sys.executable, "examples/explain_rnn.py", *flags, "--width", "88"],
                cwd=ROOT,
                env={**os.environ, "DYNAJAX_CACHE_DIR": cache},
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
        out += [title, "", "```text", run.stdout.rstrip(), "```", ""]
    return "\n".join(out)


GENERATORS = {
    "options": options_table,
    "ops": ops_tables,
    "core-aten": core_aten_summary,
    "opinfo": opinfo_table,
    "explain-rnn": explain_rnn,
}


def expand(markdown: str) -> str:
    def replace(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated section {name!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    return expand(markdown)


if __name__ == "__main__":
    print(GENERATORS[sys.argv[1]]())
