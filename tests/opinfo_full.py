"""The whole OpInfo database through dynajax: a table of samples in JAX / via fallback /
failing per dtype, and a JSON summary.

    python -m tests.opinfo_full                      # every op, dtype and sample (hours)
    python -m tests.opinfo_full --jobs 8             # the same on 8 cores
    python -m tests.opinfo_full --max-samples 3      # the first 3 samples of each
    python -m tests.opinfo_full --dtypes float32 --ops add,sum,nn.functional.conv2d
    python -m tests.opinfo_full --ci                 # exactly the CI subset

The samples run in worker processes, ``--chunk`` (op, dtype) pairs each, so memory
stays bounded over a long run (each compilation leaves some behind in torch), and a
sample that kills its worker is recorded as failing and the run goes on; ``--jobs N``
runs N workers at once on a machine with cores to spare. Each sample's outcome is
appended to a JSON-lines log as it finishes (``--log``), so a long run can be watched
and, with ``--resume``, continued after an interruption. The samples of one (op, dtype)
are first compiled together (``opinfo_harness.run_samples``: about twice as fast); any
batch that is not wholly clean, or that kills its worker, runs again sample by sample,
so each recorded outcome and reason is that sample's own. The summary (``--json``)
holds the per-dtype counts (with, apart, the samples matched by the criteria of
``tests/opinfo_accuracy.py`` rather than within the tolerance), the float32 in-JAX
fraction, the top fallback reasons, failures not listed in
``tests/opinfo_expected_failures.py``, and listed expected failures that no longer fail.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from tests.opinfo_accuracy import FLOAT64, TIES
from tests.opinfo_expected_failures import EXPECTED_FAILURES
from tests.opinfo_harness import (
    DTYPES,
    FAILING,
    FALLBACK,
    JAX,
    ci_selection,
    dtype_name,
    op_db,
    op_id,
    run_sample,
    run_samples,
    samples,
)

BATCH = -1  # the sample index of a start marker for a whole batch (harness.run_samples)
DYNAMO = "dynamo"  # counts of fallbacks that are Dynamo graph breaks alone
DYNAMO_BREAK = "dynamo graph break:"  # how harness._classify words those reasons


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.opinfo_full",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dtypes",
        default=",".join(dtype_name(d) for d in DTYPES),
        help="comma-separated dtypes (default: %(default)s)",
    )
    p.add_argument("--ops", default="", help="comma-separated op ids (default: all)")
    p.add_argument("--max-samples", type=int, default=0, help="first N samples (0: all)")
    p.add_argument("--ci", action="store_true", help="run exactly the CI subset")
    p.add_argument("--log", default="opinfo_full.jsonl", help="per-sample JSON lines")
    p.add_argument("--json", default="opinfo_full.json", help="summary JSON")
    p.add_argument("--resume", action="store_true", help="skip samples already in --log")
    p.add_argument("--jobs", type=int, default=1, help="worker processes at once")
    p.add_argument(
        "--chunk",
        type=int,
        default=40,
        help="(op, dtype) pairs per worker process (bounds its memory)",
    )
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--entries", default="[]", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _plan(args: argparse.Namespace) -> list[tuple[Any, torch.dtype, int | None]]:
    """(op, dtype, max samples or None for all), in database order."""
    if args.ci:
        return [(op, dt, n) for op, dt, n in ci_selection()]
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    wanted = {o.strip() for o in args.ops.split(",") if o.strip()}
    plan = []
    for op in op_db():
        if wanted and op_id(op) not in wanted and op.name not in wanted:
            continue
        supported = op.supported_dtypes("cpu")
        for dt in dtypes:
            if dt in supported:
                plan.append((op, dt, args.max_samples or None))
    return plan


def _reason_kind(detail: str) -> list[str]:
    """Fallback details grouped for the table: ``op: REASON`` without per-shape text."""
    out = []
    for part in detail.split("; "):
        part = re.sub(r"\[[^\]]*\]", "[..]", part)
        out.append(part[:160])
    return out


Entry = tuple[str, str, int | None]  # (op id, dtype name, sample limit or None)


def _read_log(path: Path) -> tuple[dict[tuple[str, str, int], dict[str, Any]], list[Any]]:
    """The sample records in a log, and its start markers (in order)."""
    done: dict[tuple[str, str, int], dict[str, Any]] = {}
    starts = []
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "start" in rec:
                starts.append(rec)
            else:
                done[(rec["op"], rec["dtype"], rec["sample"])] = rec
    return done, starts


def _record(op: Any, dn: str, i: int, **outcome: Any) -> dict[str, Any]:
    return {
        "op": op_id(op),
        "name": op.name,
        "variant": op.variant_test_name,
        "dtype": dn,
        "sample": i,
        **outcome,
    }


def _work(entries: list[Entry], log_path: Path, token: str) -> None:
    """Worker process: runs the entries' samples not yet in the log, appending to it."""
    ops = {op_id(op): op for op in op_db()}
    done, starts = _read_log(log_path)
    crashed = [s["start"] for s in starts if s.get("crashed")]
    with log_path.open("a") as log:
        for oid, dn, limit in entries:
            op = ops[oid]
            try:
                it = list(_take(samples(op, getattr(torch, dn)), limit))
            except Exception as e:  # the database's own sample generator failed
                print(f"{oid} {dn}: sample_inputs raised {type(e).__name__}: {e}", file=sys.stderr)
                continue
            todo = [(i, s) for i, s in enumerate(it) if (oid, dn, i) not in done]
            if len(todo) > 1 and [oid, dn, BATCH] not in crashed:
                # A marker first: if the batch kills the process, the parent finds it
                # and the next worker runs these samples one by one.
                log.write(json.dumps({"start": [oid, dn, BATCH], "token": token}) + "\n")
                log.flush()
                outcomes = run_samples(op, [s for _, s in todo])
                for (i, _), outcome in zip(todo, outcomes, strict=True):
                    rec = _record(op, dn, i, **dataclasses.asdict(outcome))
                    log.write(json.dumps(rec) + "\n")
                log.flush()
                continue
            for i, sample in todo:
                # A marker first: if this sample kills the process, the parent finds it.
                log.write(json.dumps({"start": [oid, dn, i], "token": token}) + "\n")
                log.flush()
                outcome = run_sample(op, sample)
                log.write(json.dumps(_record(op, dn, i, **dataclasses.asdict(outcome))) + "\n")
                log.flush()


def _run_chunk(chunk: list[Entry], log_path: Path, ops: dict[str, Any]) -> None:
    """Runs a chunk in fresh worker processes (bounded memory) until it completes; a
    sample that kills its worker (a segfault, say) is recorded as failing."""
    while True:
        token = uuid.uuid4().hex
        cmd = [
            sys.executable,
            "-m",
            "tests.opinfo_full",
            "--worker",
            token,
            "--log",
            str(log_path),
            "--entries",
            json.dumps(chunk),
        ]
        rc = subprocess.run(cmd, check=False).returncode
        if rc == 0:
            return
        done, starts = _read_log(log_path)
        mine = [s["start"] for s in starts if s.get("token") == token]
        crashed = [m for m in mine if tuple(m) not in done]
        if not crashed:
            raise RuntimeError(f"worker exited with {rc} outside any sample: {cmd}")
        oid, dn, i = crashed[-1]
        if i == BATCH:  # the next worker runs this batch's samples one by one
            with log_path.open("a") as log:
                log.write(json.dumps({"start": [oid, dn, BATCH], "crashed": True}) + "\n")
            continue
        rec = _record(
            ops[oid],
            dn,
            i,
            status=FAILING,
            detail=f"worker process died ({rc})",
            eager_error="",
            shape_only=False,
            seconds=0.0,
        )
        with log_path.open("a") as log:
            log.write(json.dumps(rec) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    log_path = Path(args.log)
    # Every sample compiles afresh (workers inherit this): the persistent executable
    # cache would only fill the disk with ~100k one-off programs.
    os.environ.setdefault("DYNAJAX_CACHE_DIR", "")
    if args.worker:
        _work([tuple(e) for e in json.loads(args.entries)], log_path, args.worker)
        return 0
    plan = [(op_id(op), dtype_name(dt), n) for op, dt, n in _plan(args)]
    ops = {op_id(op): op for op in op_db()}
    if not args.resume:
        log_path.write_text("")
    chunks = [plan[i : i + args.chunk] for i in range(0, len(plan), args.chunk)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_run_chunk, c, log_path, ops) for c in chunks]
        for k, f in enumerate(concurrent.futures.as_completed(futures)):
            f.result()
            print(
                f"[{time.perf_counter() - start:7.0f}s] {k + 1}/{len(chunks)} chunks done",
                file=sys.stderr,
                flush=True,
            )
    done, _ = _read_log(log_path)
    wanted = {(oid, dn): n for oid, dn, n in plan}
    records = [
        r
        for (oid, dn, i), r in sorted(done.items())
        if (oid, dn) in wanted and (wanted[(oid, dn)] is None or i < wanted[(oid, dn)])
    ]
    summary = summarize(records)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    summary["command"] = " ".join(["python -m tests.opinfo_full", *(argv or sys.argv[1:])])
    Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary))
    return 0


def _take(it: Any, limit: int | None) -> Any:
    for i, x in enumerate(it):
        if limit is not None and i >= limit:
            return
        yield x


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    reasons: collections.Counter[str] = collections.Counter()
    failing_triples: dict[tuple[str, str, str], str] = {}
    seen_triples: set[tuple[str, str, str]] = set()
    for r in records:
        counts[r["dtype"]][r["status"]] += 1
        if r.get("accuracy"):  # matched by opinfo_accuracy's criteria, not within tolerance
            counts[r["dtype"]][r["accuracy"]] += 1
        if r["status"] == FALLBACK and all(
            part.startswith(DYNAMO_BREAK) for part in r["detail"].split("; ")
        ):  # Dynamo ran the op eagerly itself: dynajax never saw it
            counts[r["dtype"]][DYNAMO] += 1
        key = (r["name"], r["variant"], r["dtype"])
        seen_triples.add(key)
        if r["status"] == FALLBACK:
            reasons.update(_reason_kind(r["detail"]))
        elif r["status"] == FAILING:
            failing_triples.setdefault(key, f"sample {r['sample']}: {r['detail']}")
    new_failures = {k: v for k, v in failing_triples.items() if k not in EXPECTED_FAILURES}
    now_passing = sorted(
        k for k in EXPECTED_FAILURES if k in seen_triples and k not in failing_triples
    )
    f32 = counts.get("float32", collections.Counter())
    f32_total = f32[JAX] + f32[FALLBACK] + f32[FAILING]
    return {
        "counts": {
            d: {s: c[s] for s in (JAX, FALLBACK, FAILING, DYNAMO, TIES, FLOAT64)}
            for d, c in counts.items()
        },
        "float32_in_jax_fraction": round(f32[JAX] / f32_total, 4) if f32_total else None,
        "float32_in_jax_fraction_of_samples_reaching_dynajax": (
            round(f32[JAX] / (f32_total - f32[DYNAMO]), 4) if f32_total > f32[DYNAMO] else None
        ),
        "samples": len(records),
        "top_fallback_reasons": reasons.most_common(40),
        "new_failures": [[*k, v] for k, v in sorted(new_failures.items())],
        "expected_failures_now_passing": [list(k) for k in now_passing],
    }


def table(summary: dict[str, Any]) -> str:
    lines = [
        f"{'dtype':<12}{'in JAX':>9}{'fallback':>10}{'failing':>9}{'total':>8}"
        f"{'dynamo':>8}{'ties':>7}{'float64':>9}"
    ]
    tot: collections.Counter[str] = collections.Counter()
    for d, c in [*summary["counts"].items(), ("all", tot)]:
        if d != "all":
            tot.update(c)
        n = c[JAX] + c[FALLBACK] + c[FAILING]
        lines.append(
            f"{d:<12}{c[JAX]:>9}{c[FALLBACK]:>10}{c[FAILING]:>9}{n:>8}"
            f"{c[DYNAMO]:>8}{c[TIES]:>7}{c[FLOAT64]:>9}"
        )
    lines.append(
        "dynamo: fallbacks where Dynamo broke the graph and ran the op itself (dynajax never "
        "saw it); ties, float64: samples in JAX or via fallback that differ from eager as "
        "tests/opinfo_accuracy.py accepts (a valid index among tied values; a result at "
        "least as close to the float64 one as eager's)"
    )
    frac = summary["float32_in_jax_fraction"]
    if frac is not None:
        lines.append(f"float32 samples in JAX: {100 * frac:.1f}%")
    reaching = summary.get("float32_in_jax_fraction_of_samples_reaching_dynajax")
    if reaching is not None:
        lines.append(f"  of those Dynamo hands to dynajax: {100 * reaching:.1f}%")
    lines.append("")
    lines.append("top fallback reasons (samples):")
    lines += [f"  {n:>6}  {r}" for r, n in summary["top_fallback_reasons"][:20]]
    lines.append("")
    lines.append(
        f"failing (op, variant, dtype) not in the expected-failure list: "
        f"{len(summary['new_failures'])}"
    )
    lines += [f"  {k}" for k in summary["new_failures"][:50]]
    lines.append(
        f"expected failures that passed every sample run: "
        f"{len(summary['expected_failures_now_passing'])}"
    )
    lines += [f"  {tuple(k)}" for k in summary["expected_failures_now_passing"][:50]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
