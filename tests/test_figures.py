"""The documents' measured tables say what their JSON and the plots beside them say
(``python -m benchmarks.figures``)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from benchmarks import figures
from benchmarks.figures import Table


def test_every_table_and_plot_agrees_with_its_json() -> None:
    found = figures.problems()
    assert not found, "\n".join(found) + "\n(python -m benchmarks.figures redraws them)"


def test_every_figure_is_shown_in_a_document() -> None:
    shown = {n for doc in figures.DOCUMENTS for n, *_ in figures.marked_tables(doc.read_text())}
    assert shown == set(figures.FIGURES)


def _png_with_text(path: Path, key: str, text: str) -> None:
    """A 1x1 PNG carrying one tEXt chunk (what matplotlib's savefig(metadata=) writes)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"tEXt", key.encode() + b"\0" + text.encode("latin-1"))
        + chunk(b"IDAT", zlib.compress(b"\0\0"))
        + chunk(b"IEND", b"")
    )


@pytest.fixture
def figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One figure in tmp_path: its JSON, a plot drawn from it, a document showing it."""
    source = tmp_path / "sweep.json"
    results = [
        {"family": "causal-lm", "status": "ok"},
        {"family": "causal-lm", "status": "failing"},
        {"family": "masked-lm", "status": "ok"},
    ]
    source.write_text(json.dumps({"meta": {}, "results": results}))
    plot = tmp_path / "sweep.png"
    fig = figures.Figure("sweep", source, plot, figures.sweep_table)
    monkeypatch.setattr(figures, "FIGURES", {"sweep": fig})
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    _png_with_text(plot, figures.PNG_KEY, figures.load(fig).to_json())
    doc = tmp_path / "doc.md"
    doc.write_text("text\n\n<!-- table: sweep -->\n| family | ok | total |\n<!-- /table -->\n")
    figures.update([doc], plots=False)
    return doc


def test_a_table_is_filled_in_with_the_columns_its_header_names(figure: Path) -> None:
    text = figure.read_text()
    assert "| causal-lm | 1 | 2 |\n| masked-lm | 1 | 1 |\n| all | 2 | 3 |\n<!-- /table -->" in text
    assert figures.problems([figure]) == []


def test_a_table_edited_by_hand_is_found(figure: Path) -> None:
    figure.write_text(figure.read_text().replace("| masked-lm | 1 | 1 |", "| masked-lm | 2 | 2 |"))
    assert figures.problems([figure]) == [
        "doc.md, table sweep differs from sweep.json",
        "doc.md, table sweep differs from its plot sweep.png",
    ]


def test_a_plot_drawn_from_other_data_is_found(figure: Path) -> None:
    stale = figures.load(figures.FIGURES["sweep"])
    stale = Table(stale.header, (("causal-lm", "2", "0", "0", "0", "2"), *stale.rows[1:]))
    _png_with_text(figures.FIGURES["sweep"].plot, figures.PNG_KEY, stale.to_json())  # type: ignore[arg-type]
    assert figures.problems([figure]) == [
        "sweep.png was drawn from other data than sweep.json gives (redraw it)",
        "doc.md, table sweep differs from its plot sweep.png",
    ]


def test_a_json_rerun_without_redrawing_is_found(figure: Path) -> None:
    source = figures.FIGURES["sweep"].source
    data = json.loads(source.read_text())
    data["results"].append({"family": "masked-lm", "status": "unbuilt"})
    source.write_text(json.dumps(data))
    found = figures.problems([figure])
    assert "sweep.png was drawn from other data than sweep.json gives (redraw it)" in found
    assert "doc.md, table sweep differs from sweep.json" in found


def test_a_column_the_figure_lacks_is_named(figure: Path) -> None:
    figure.write_text(figure.read_text().replace("| family | ok | total |", "| family | speed |"))
    (problem,) = figures.problems([figure])
    assert problem.startswith("doc.md, table sweep: no column ['speed']")


@pytest.mark.parametrize("peers", [["eager", "inductor", "dynajax"], ["eager", "dynajax"]])
def test_the_benchmark_plot_names_the_peer_it_divides_by(
    peers: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    base = "inductor" if "inductor" in peers else "eager"
    seconds = {"eager": 2e-3, "inductor": 1e-3, "dynajax": 5e-4}
    data = {
        "meta": {"time": "2026-12-07T10:00:00", "cpus": 2, "device": "cpu", "peers": peers},
        "workloads": {
            "mlp": {"steady": {p: {"status": "ok", "median_s": seconds[p]} for p in peers}},
        },
    }
    drawn: list = []
    monkeypatch.setattr(figures, "_save", lambda fig, table, path: drawn.append(fig))
    figures.draw_benchmarks(data, figures.benchmarks_table(data), tmp_path / "b.png")
    (fig,) = drawn
    assert fig.axes[0].get_xlabel().startswith(f"time per call / {base}'s ")
