"""The whole OpInfo database through dynajax: a table of samples in JAX / via fallback /
failing per dtype, and a JSON summary.

    python -m tests.opinfo_full                      # every op, dtype and sample (hours)
    python -m tests.opinfo_full --max-samples 3      # the first 3 samples of each
    python -m tests.opinfo_full --dtypes float32 --ops add,sum,nn.functional.conv2d
    python -m tests.opinfo_full --ci                 # exactly the CI subset

Each sample's outcome is appended to a JSON-lines log as it finishes (``--log``), so a
long run can be watched and, with ``--resume``, continued after an interruption. The
summary (``--json``) holds the per-dtype counts, the float32 in-JAX fraction, the top
fallback reasons, failures not listed in ``tests/opinfo_expected_failures.py``, and
listed expected failures that no longer fail.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

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
    samples,
)


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


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    log_path = Path(args.log)
    done: dict[tuple[str, str, int], dict[str, Any]] = {}
    if args.resume and log_path.exists():
        for line in log_path.read_text().splitlines():
            rec = json.loads(line)
            done[(rec["op"], rec["dtype"], rec["sample"])] = rec
    plan = _plan(args)
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    with log_path.open("a" if args.resume else "w") as log:
        for k, (op, dt, limit) in enumerate(plan):
            oid, dn = op_id(op), dtype_name(dt)
            try:
                it = list(_take(samples(op, dt), limit))
            except Exception as e:  # the database's own sample generator failed
                print(f"{oid} {dn}: sample_inputs raised {type(e).__name__}: {e}", file=sys.stderr)
                continue
            for i, sample in enumerate(it):
                if (oid, dn, i) in done:
                    records.append(done[(oid, dn, i)])
                    continue
                outcome = run_sample(op, sample)
                rec = {
                    "op": oid,
                    "name": op.name,
                    "variant": op.variant_test_name,
                    "dtype": dn,
                    "sample": i,
                    **dataclasses.asdict(outcome),
                }
                records.append(rec)
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if k % 25 == 0:
                print(
                    f"[{time.perf_counter() - start:7.0f}s] {k}/{len(plan)} {oid} {dn}",
                    file=sys.stderr,
                    flush=True,
                )
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
    f32_total = sum(f32.values())
    return {
        "counts": {d: {s: c[s] for s in (JAX, FALLBACK, FAILING)} for d, c in counts.items()},
        "float32_in_jax_fraction": round(f32[JAX] / f32_total, 4) if f32_total else None,
        "samples": len(records),
        "top_fallback_reasons": reasons.most_common(40),
        "new_failures": [[*k, v] for k, v in sorted(new_failures.items())],
        "expected_failures_now_passing": [list(k) for k in now_passing],
    }


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'dtype':<12}{'in JAX':>9}{'fallback':>10}{'failing':>9}{'total':>8}"]
    tot = collections.Counter()
    for d, c in summary["counts"].items():
        n = sum(c.values())
        tot.update(c)
        lines.append(f"{d:<12}{c[JAX]:>9}{c[FALLBACK]:>10}{c[FAILING]:>9}{n:>8}")
    lines.append(
        f"{'all':<12}{tot[JAX]:>9}{tot[FALLBACK]:>10}{tot[FAILING]:>9}{sum(tot.values()):>8}"
    )
    frac = summary["float32_in_jax_fraction"]
    if frac is not None:
        lines.append(f"float32 samples in JAX: {100 * frac:.1f}%")
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
