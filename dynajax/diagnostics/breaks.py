"""What Dynamo did not capture: graph breaks and skipped frames, as Dynamo explains them.

Dynamo writes each graph break, with its reason, its hints and the user's line, to its
``graph_breaks`` log artifact (``TORCH_LOGS=graph_breaks``), and each frame it gives up
on to the same artifact. ``watch_breaks()`` listens there while a function is compiled
(``dynajax.explain`` does), without printing anything or changing torch's logging for
longer than that; ``GraphBreak`` is one of them, read back into its parts.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import linecache
import logging
import os
import re
import sysconfig
from collections.abc import Iterator

# The loggers of Dynamo's ``graph_breaks`` artifact (torch._logging.getArtifactLogger).
_LOGGERS = (
    "torch._dynamo.symbolic_convert.__graph_breaks",
    "torch._dynamo.convert_frame.__graph_breaks",
)
_AT = re.compile(r"in user code at (?P<file>.+?):(?P<line>\d+)\s*$", re.MULTILINE)
_REASON = re.compile(r"Graph Break Reason: (?P<reason>.*?)(?:\n\nUser code traceback:|\Z)", re.S)
_SKIP = re.compile(r"torch\.compile will skip tracing the frame (?P<frame>.+?) and fall back")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
# Where Python's and installed packages' code lives: not the user's line.
_LIBRARIES = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """One place where Dynamo stopped capturing: the code there ran in Python.

    Attributes:
        kind: ``"graph break"`` (the graph ends there and a new one starts after) or
            ``"skipped frame"`` (the whole function ran in Python).
        reason: Dynamo's reason, its first line (``Attempted to wrap RNN, GRU, or LSTM``).
        explanation: Dynamo's explanation of it, if it gave one.
        hints: what would capture it, in Dynamo's words
            (``Set torch._dynamo.config.allow_rnn=True ...``).
        where: ``file:line`` of the user's code.
        code: that line of code.
        count: how many times it was seen.
    """

    kind: str
    reason: str
    explanation: str
    hints: tuple[str, ...]
    where: str
    code: str
    count: int = 1

    def lines(self, indent: str = "  ") -> list[str]:
        times = f" (x{self.count})" if self.count > 1 else ""
        out = [f"{indent}{self.kind} at {short_location(self.where)}{times}: {self.reason}"]
        if self.code:
            out.append(f"{indent}  {self.code}")
        if self.explanation:
            out.append(f"{indent}  why: {self.explanation}")
        for hint in self.hints[:2]:
            out.append(f"{indent}  hint: {hint}")
        return out


def parse(message: str) -> GraphBreak | None:
    """The break a ``graph_breaks`` record describes (None: not one)."""
    frames = [
        (f, n) for f, n in _FRAME.findall(message) if not f.startswith(_LIBRARIES)
    ]  # the user's frames of its traceback, innermost last
    skip = _SKIP.search(message)
    if skip is not None:
        file, line = frames[-1] if frames else ("?", "0")
        text = f"Dynamo gave up on the function {skip.group('frame')}"
        return _make("skipped frame", text, file, line)
    at, reason = _AT.search(message), _REASON.search(message)
    if at is None or reason is None:
        return None
    text = reason.group("reason")
    kind = "graph break"
    if "skipping the rest of the function" in text or "Skipping the function" in text:
        kind = "graph break; the rest of the function ran in Python"
    # Dynamo's location may be inside a library the user called (copy.py): the user's
    # own line is the innermost frame of theirs.
    file, line = at.group("file"), at.group("line")
    if file.startswith(_LIBRARIES) and frames:
        file, line = frames[-1]
    return _make(kind, text, file, line)


def _make(kind: str, text: str, file: str, line: str) -> GraphBreak:
    # Dynamo's reason: a line that says where tracing stopped ("Encountered graph
    # break when attempting to trace CALL: ...:"), then a paragraph: the break's name,
    # its explanation and hints, a debug context and a link.
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    if len(paragraphs) > 1 and paragraphs[0].rstrip().endswith(":"):
        paragraphs = paragraphs[1:]
    first, explanation, hints = "", "", []
    for raw in paragraphs[0].splitlines() if paragraphs else []:
        s = raw.strip()
        if s.startswith("Explanation:"):
            explanation = s.removeprefix("Explanation:").strip()
        elif s.startswith("Hint:"):
            hints.append(s.removeprefix("Hint:").strip())
        elif not first and s:
            first = s
    code = linecache.getline(file, int(line)).strip() if file != "?" else ""
    # Dynamo's generic hint (report the break to PyTorch) is no way to capture it.
    useful = tuple(h for h in hints if "report an issue" not in h.lower())
    return GraphBreak(kind, first, explanation, useful or tuple(hints), f"{file}:{line}", code)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.found: list[GraphBreak] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            found = parse(record.getMessage())
        except Exception:  # a message of another form: not ours to fail on
            return
        if found is not None:
            self.found.append(found)


@contextlib.contextmanager
def watch_breaks() -> Iterator[list[GraphBreak]]:
    """Collects the graph breaks and skipped frames of what Dynamo compiles inside;
    the list is filled when the block ends, the same break seen again counted once
    with its count. Prints nothing: the records go to this collector only."""
    handler = _Collect()
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    saved = [(lg.level, lg.propagate, lg.disabled) for lg in loggers]
    found: list[GraphBreak] = []
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.propagate = False
        lg.disabled = False
        lg.addHandler(handler)
    try:
        yield found
    finally:
        for lg, (level, propagate, disabled) in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate
            lg.disabled = disabled
        counts = collections.Counter((b.kind, b.reason, b.where) for b in handler.found)
        seen = set()
        for b in handler.found:
            key = (b.kind, b.reason, b.where)
            if key not in seen:
                seen.add(key)
                found.append(dataclasses.replace(b, count=counts[key]))


def short_location(location: str) -> str:
    """``file:line`` (or ``file:line (code)``) with the file relative to the working
    directory when inside it."""
    path, sep, rest = location.partition(":")
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return location
    return f"{rel}{sep}{rest}" if not rel.startswith("..") else location
