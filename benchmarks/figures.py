"""The documents' measured tables and the plots beside them, both drawn from one JSON.

Each figure is a JSON file that a benchmark command writes, the Markdown tables that
the documents show, and a plot. A document asks for a table with two lines of its own,

    <!-- table: benchmarks -->
    | workload | eager | dynajax / inductor |
    |---|---|---|
    <!-- /table -->

and chooses its columns by the header it writes; this module fills in the rows from the
JSON. The plot is drawn from the same rows, and carries them in its PNG metadata, so
that ``--check`` (and ``tests/test_figures.py``) can tell a table that no longer says
what its JSON or its plot says.

    python -m benchmarks.figures           # rewrite every table, redraw every plot
    python -m benchmarks.figures --check   # what differs; exit status 1 if anything does

The benchmark commands write the JSON and call this module for the plot:
``python -m benchmarks.run --save-docs`` (docs/benchmarks.json),
``python -m benchmarks.overhead --plot docs/overhead.png`` (docs/overhead.json) and
``python -m benchmarks.sweep`` (docs/sweep.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import struct
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.sweep_record import first_failure

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOCUMENTS = (ROOT / "README.md", *sorted(DOCS.glob("*.md")))
START = re.compile(r"^<!-- table: ([a-z0-9-]+) -->$", re.MULTILINE)
END = "<!-- /table -->"
PNG_KEY = "dynajax-table"


@dataclasses.dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def columns(self, names: Sequence[str]) -> Table:
        """The table with only these columns, in this order."""
        missing = [n for n in names if n not in self.header]
        if missing:
            raise KeyError(f"no column {missing} (the columns are {list(self.header)})")
        idx = [self.header.index(n) for n in names]
        return Table(tuple(names), tuple(tuple(r[i] for i in idx) for r in self.rows))

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |"]
        lines.append("|" + "|".join("---" for _ in self.header) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)

    @staticmethod
    def parse(text: str) -> Table:
        """A Markdown table's cells (the separator line dropped)."""
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        cells = [tuple(c.strip() for c in ln.strip("|").split(" | ")) for ln in lines]
        return Table(cells[0], tuple(cells[2:]) if len(cells) > 1 else ())

    def to_json(self) -> str:
        return json.dumps({"header": self.header, "rows": self.rows}, ensure_ascii=True)

    @staticmethod
    def from_json(text: str) -> Table:
        data = json.loads(text)
        return Table(tuple(data["header"]), tuple(tuple(r) for r in data["rows"]))


@dataclasses.dataclass(frozen=True)
class Figure:
    """A JSON file, the table it gives and the plot drawn from that table."""

    name: str
    source: Path
    plot: Path | None
    table: Callable[[dict[str, Any]], Table]
    draw: Callable[[dict[str, Any], Table, Path], None] | None = None


def time_text(s: float | None) -> str:
    """A time as the tables print it: µs below a millisecond, ms below a second."""
    if s is None:
        return ""
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


# -- the main benchmark: docs/benchmarks.json (python -m benchmarks.run) -------------------

# The peers of benchmarks.run as the documents name them.
PEER_NAMES = {
    "eager": "eager",
    "inductor": "inductor",
    "dynajax": "dynajax",
    "dynajax-jax": "dynajax, all in JAX",
    "dynajax-defaults": "dynajax, default choices",
    "jax": "jax floor",
}


def _median(workload: dict[str, Any], peer: str) -> float | None:
    r = workload["steady"].get(peer, {})
    return r.get("median_s") if r.get("status") == "ok" else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else ""


DIFF = "max \\|dynajax - eager\\|"


def _diff(d: float | None) -> str:
    return "" if d is None else "0" if d == 0 else f"{d:.1e}"


def benchmarks_table(data: dict[str, Any]) -> Table:
    peers = [p for p in PEER_NAMES if p in data["meta"]["peers"]]
    header = ["workload", *(PEER_NAMES[p] for p in peers)]
    header += ["dynajax / inductor", "dynajax / eager", "dynajax / floor", DIFF]
    rows = []
    for name, w in data["workloads"].items():
        t = {p: _median(w, p) for p in peers}
        dj = t.get("dynajax")
        rows.append(
            (
                f"`{name}`",
                *(time_text(t[p]) for p in peers),
                _ratio(dj, t.get("inductor")),
                _ratio(dj, t.get("eager")),
                _ratio(dj, t.get("jax")),
                _diff(w["steady"].get("dynajax", {}).get("max_abs_diff_vs_eager")),
            )
        )
    return Table(tuple(header), tuple(rows))


def workload_list(data: dict[str, Any]) -> Table:
    """What each row runs, as benchmarks.run describes it."""
    rows = tuple((f"`{n}`", w["description"]) for n, w in data["workloads"].items())
    return Table(("workload", "what it runs"), rows)


def _seconds(cell: str) -> float | None:
    if not cell:
        return None
    value, unit = cell.split()
    return float(value) * {"µs": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def draw_benchmarks(data: dict[str, Any], table: Table, path: Path) -> None:
    """Each row's time against inductor's (eager's in a run without inductor), one bar
    per peer (the line at 1)."""
    plt = _pyplot()
    # Against inductor's time; a run without inductor, against eager's.
    base = "inductor" if "inductor" in table.header else "eager"
    peers = [h for h in table.header[1:] if h in PEER_NAMES.values() and h != base]
    names = [r[0].strip("`") for r in table.rows]
    fig, ax = plt.subplots(figsize=(8, 0.16 * len(names) * max(len(peers), 1) + 1.6))
    height = 0.8 / max(len(peers), 1)
    ind = table.header.index(base)
    for k, peer in enumerate(peers):
        col = table.header.index(peer)
        ys, xs = [], []
        for j, row in enumerate(table.rows):
            t, t_base = _seconds(row[col]), _seconds(row[ind])
            if t and t_base:
                ys.append(j + k * height)
                xs.append(t / t_base)
        ax.barh(ys, xs, height=height, label=peer)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(plt.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(plt.FormatStrFormatter("%g"))
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time per call / {base}'s (log; left of the line is faster)")
    meta = data["meta"]
    ax.set_title(
        f"python -m benchmarks.run, {meta['time'][:16].replace('T', ' ')} UTC, "
        f"{meta['cpus']} cpus, {meta.get('device_name') or meta['device']}",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, table, path)


# -- peak memory of the training steps: docs/memory.json (python -m benchmarks.memory) ---


def memory_table(data: dict[str, Any]) -> Table:
    """Per row: each peer's peak resident set during a steady step, dynajax's against
    eager's and inductor's, and dynajax's peak up to its steady step (the compiles)."""
    peers = list(next(iter(data["rows"].values())))
    header = ["workload", *peers]  # (each peer's peak during a steady step)
    header += ["dynajax / eager", "dynajax / inductor", "dynajax, first steps"]

    def mib(r: dict[str, Any], key: str) -> str:
        return f"{r[key] / 2**20:.0f} MiB" if key in r else ""

    rows = []
    for name, by_peer in data["rows"].items():
        dj = by_peer.get("dynajax", {})
        rows.append(
            (
                f"`{name}`",
                *(mib(by_peer.get(p, {}), "steady") for p in peers),
                _ratio(dj.get("steady"), by_peer.get("eager", {}).get("steady")),
                _ratio(dj.get("steady"), by_peer.get("inductor", {}).get("steady")),
                mib(dj, "first"),
            )
        )
    return Table(tuple(header), tuple(rows))


# -- per-call overhead, layer by layer: docs/overhead.json (python -m benchmarks.overhead) -


def overhead_table(data: dict[str, Any]) -> Table:
    recorded = data["us_per_call"]
    cols = [(case, mode) for case in recorded for mode in recorded[case]]
    header = ["layer", *(case if mode == "alone" else f"{case}, {mode}" for case, mode in cols)]
    first = next(iter(recorded.values()))
    layers = list(next(iter(first.values())))
    rows = tuple(
        (layer, *(f"{recorded[case][mode][layer][0]:.1f}" for case, mode in cols))
        for layer in layers
    )
    return Table(tuple(header), rows)


def draw_overhead(data: dict[str, Any], table: Table, path: Path) -> None:
    """One panel per case: a bar per layer and mode (the median µs per call)."""
    plt = _pyplot()
    cases = list(data["us_per_call"])
    fig, axes = plt.subplots(1, len(cases), figsize=(6.5 * len(cases), 4.2), squeeze=False)
    layers = [r[0] for r in table.rows]
    for ax, case in zip(axes[0], cases, strict=True):
        cols = [(i, h) for i, h in enumerate(table.header) if h.split(", ")[0] == case]
        height = 0.8 / len(cols)
        for k, (i, h) in enumerate(cols):
            ys = [j + k * height for j in range(len(layers))]
            values = [float(r[i]) for r in table.rows]
            ax.barh(ys, values, height=height, label=h.removeprefix(case).strip(", ") or "alone")
            for y, v in zip(ys, values, strict=True):
                ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
        ax.set_yticks([j + 0.4 - height / 2 for j in range(len(layers))], layers, fontsize=8)
        ax.invert_yaxis()
        ax.margins(x=0.15)
        ax.set_title(case)
        ax.set_xlabel("µs per call (median of rounds)")
        ax.legend(fontsize=8, loc="lower right")
    meta = data["meta"]
    fig.suptitle(
        f"python -m benchmarks.overhead, {meta['date']}, {meta['cpus']} cpus, load "
        f"{meta['load_average']}, {meta['rounds']} rounds, tensors on {meta['device']}",
        fontsize=9,
    )
    _save(fig, table, path)


# -- the architecture sweep: docs/sweep.json (python -m benchmarks.sweep) ------------------

SWEEP_STATUSES = ("ok", "upstream", "failing", "unbuilt")
SWEEP_COLORS = {"ok": "#2a9d4b", "upstream": "#8d99ae", "failing": "#d62828", "unbuilt": "#e9c46a"}


def sweep_table(data: dict[str, Any]) -> Table:
    results = data["results"]
    families = list(dict.fromkeys(r["family"] for r in results))
    rows = []
    for family in [*families, None]:
        mine = [r for r in results if family is None or r["family"] == family]
        counts = [sum(r["status"] == s for r in mine) for s in SWEEP_STATUSES]
        label = family or "all"
        rows.append((label, *map(str, counts), str(len(mine))))
    return Table(("family", *SWEEP_STATUSES, "total"), tuple(rows))


SWEEP_STAGES = {
    "dynajax": "the backend (`torch.compile`)",
    "jax_forward": "`jax_function`, `jax.jit` forward",
    "jax_grad": "`jax.grad` of `jax_function` against `torch.autograd`",
}


def sweep_stages(data: dict[str, Any]) -> Table:
    """Of the architectures eager runs, how many give eager's answer at each stage (a
    stage not reached counts as not giving it; upstream: the same fails without
    dynajax)."""
    ran = [r for r in data["results"] if r.get("stages", {}).get("eager", {}).get("ok")]
    rows = []
    for stage, label in SWEEP_STAGES.items():
        stages = [r["stages"].get(stage, {}) for r in ran]
        ok = sum(bool(s.get("ok")) for s in stages)
        upstream = sum(bool(s.get("upstream")) for s in stages)
        rows.append((label, str(ok), str(upstream), str(len(ran))))
    return Table(("stage", "eager's answer", "upstream", "of those eager runs"), tuple(rows))


def _innermost(error: str) -> str:
    """An error that wraps others as its outermost type and the innermost error's text
    (``JaxFunctionError: ... could not be traced: RuntimeError: Expected ...`` ->
    ``JaxFunctionError <- RuntimeError: Expected ...``)."""
    found = list(re.finditer(r"\b(\w+(?:Error|Exception)): ", error))
    if len(found) < 2:
        return error
    return f"{found[0].group(1)} <- {error[found[-1].start() :]}"


def sweep_failures(data: dict[str, Any]) -> Table:
    """Each architecture that eager and aot_eager run and dynajax does not, with the
    stage that stopped it and the start of its error."""
    rows = []
    for r in data["results"]:
        if r["status"] == "failing":
            stage, error = first_failure(r)
            error = _innermost(" ".join(error.split()))
            error = error if len(error) <= 140 else error[:137] + "..."
            rows.append((r["model_type"], r["family"], stage, error.replace("|", "\\|")))
    return Table(("architecture", "family", "stage", "error"), tuple(rows))


def draw_sweep(data: dict[str, Any], table: Table, path: Path) -> None:
    """A stacked bar per family; a count is written in its segment where it fits, and
    every count is in the legend's totals and the table."""
    plt = _pyplot()
    rows = [r for r in table.rows if r[0] != "all"]
    total = dict(zip(table.header, next(r for r in table.rows if r[0] == "all"), strict=True))
    families = [r[0] for r in rows]
    widest = max(int(r[-1]) for r in rows)
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(families) + 1.4))
    left = [0] * len(rows)
    for status in SWEEP_STATUSES:
        col = table.header.index(status)
        counts = [int(r[col]) for r in rows]
        label = f"{status} ({total[status]})"
        bars = ax.barh(families, counts, left=left, color=SWEEP_COLORS[status], label=label)
        for bar, c in zip(bars, counts, strict=True):
            # Room for the digits: about 1.6% of the widest bar per digit, and a margin.
            if c and c / widest >= 0.018 * len(str(c)) + 0.012:
                ax.text(
                    bar.get_x() + bar.get_width() / 2,
                    bar.get_y() + bar.get_height() / 2,
                    str(c),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if status == "unbuilt" else "white",
                )
        left = [a + b for a, b in zip(left, counts, strict=True)]
    for y, r in enumerate(rows):
        ax.text(int(r[-1]), y, f"  {r[-1]}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.08)
    ax.set_xlabel("architectures")
    meta = data["meta"]
    ax.set_title(
        f"transformers {meta['transformers']} architectures, tiny random configs, "
        f"through dynajax ({meta['date'][:10]})",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    _save(fig, table, path)


# -- the registry ---------------------------------------------------------------------------

FIGURES = {
    f.name: f
    for f in (
        Figure("benchmarks", DOCS / "benchmarks.json", DOCS / "benchmarks.png",
               benchmarks_table, draw_benchmarks),
        Figure("benchmark-rows", DOCS / "benchmarks.json", None, workload_list),
        Figure("overhead", DOCS / "overhead.json", DOCS / "overhead.png",
               overhead_table, draw_overhead),
        Figure("sweep", DOCS / "sweep.json", DOCS / "sweep.png", sweep_table, draw_sweep),
        Figure("sweep-failing", DOCS / "sweep.json", None, sweep_failures),
        Figure("sweep-stages", DOCS / "sweep.json", None, sweep_stages),
        Figure("benchmarks-h100", DOCS / "benchmarks-h100.json", None, benchmarks_table),
        Figure("memory", DOCS / "memory.json", None, memory_table),
    )
}  # fmt: skip


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        sys.exit("the plots need matplotlib: pip install 'dynajax[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, table: Table, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={PNG_KEY: table.to_json()})
    _pyplot().close(fig)


def png_table(path: Path) -> Table | None:
    """The table a plot was drawn from (its PNG text chunk), or None if it has none."""
    data = path.read_bytes()
    pos = 8  # the PNG signature
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"tEXt":
            key, _, text = body.partition(b"\0")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            text = zlib.decompress(rest[1:])
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            rest = rest.split(b"\0", 2)[2]  # language tag, translated keyword
            text = zlib.decompress(rest) if compressed else rest
        else:
            continue
        if key == PNG_KEY.encode():
            return Table.from_json(text.decode("utf-8"))
    return None


def load(figure: Figure) -> Table:
    return figure.table(json.loads(figure.source.read_text()))


def marked_tables(text: str) -> list[tuple[str, int, int]]:
    """(figure, start, end) of each marked table's body in a document's text."""
    out = []
    for m in START.finditer(text):
        end = text.find(END, m.end())
        if end < 0:
            raise ValueError(f"<!-- table: {m.group(1)} --> has no {END} line")
        out.append((m.group(1), m.end() + 1, end))
    return out


def render(text: str, tables: dict[str, Table]) -> str:
    """The document with each marked table's rows filled in from ``tables`` (the columns
    its header names)."""
    for name, start, end in reversed(marked_tables(text)):
        if name not in tables:
            raise KeyError(f"<!-- table: {name} -->: no such figure (of {sorted(tables)})")
        header = Table.parse(text[start:end]).header if text[start:end].strip() else None
        full = tables[name]
        shown = full.columns(header) if header else full
        text = text[:start] + shown.markdown() + "\n" + text[end:]
    return text


def problems(documents: Sequence[Path] = DOCUMENTS) -> list[str]:
    """Each table that differs from its JSON, each plot drawn from other data than its
    JSON gives, and each column of a table that differs from the same column in the
    plot beside it."""
    out = []
    tables = {name: load(f) for name, f in FIGURES.items()}
    for name, f in FIGURES.items():
        if f.plot is None:
            continue
        drawn = png_table(f.plot) if f.plot.exists() else None
        if drawn is None:
            out.append(f"{f.plot.relative_to(ROOT)}: no data in the plot (redraw it)")
        elif drawn != tables[name]:
            out.append(
                f"{f.plot.relative_to(ROOT)} was drawn from other data than "
                f"{f.source.relative_to(ROOT)} gives (redraw it)"
            )
    for doc in documents:
        text = doc.read_text()
        for name, start, end in marked_tables(text):
            where = f"{doc.relative_to(ROOT)}, table {name}"
            shown = Table.parse(text[start:end])
            try:
                expected = tables[name].columns(shown.header)
            except KeyError as e:
                out.append(f"{where}: {e.args[0]}")
                continue
            if shown != expected:
                out.append(f"{where} differs from {FIGURES[name].source.relative_to(ROOT)}")
            plot = FIGURES[name].plot
            drawn = png_table(plot) if plot and plot.exists() else None
            if drawn is not None and set(shown.header) <= set(drawn.header):
                if drawn.columns(shown.header) != shown:
                    out.append(f"{where} differs from its plot {plot.relative_to(ROOT)}")
    return out


def update(documents: Sequence[Path] = DOCUMENTS, plots: bool = True) -> None:
    tables = {name: load(f) for name, f in FIGURES.items()}
    if plots:
        for name, f in FIGURES.items():
            if f.plot is not None and f.draw is not None:
                f.draw(json.loads(f.source.read_text()), tables[name], f.plot)
                print(f"drew {f.plot.relative_to(ROOT)}")
    for doc in documents:
        text = doc.read_text()
        new = render(text, tables)
        if new != text:
            doc.write_text(new)
            print(f"rewrote {doc.relative_to(ROOT)}")


def draw(name: str) -> None:
    """Redraws one figure's plot from its JSON (the benchmark commands call this)."""
    f = FIGURES[name]
    assert f.plot is not None and f.draw is not None
    f.draw(json.loads(f.source.read_text()), load(f), f.plot)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--check", action="store_true", help="only say what differs")
    p.add_argument("--tables-only", action="store_true", help="leave the plots as they are")
    args = p.parse_args(argv)
    if not args.check:
        update(plots=not args.tables_only)
    found = problems()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
