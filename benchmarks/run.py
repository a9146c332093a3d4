"""One command for the side-by-side benchmark: ``python -m benchmarks.run`` (``make bench``).

    python -m benchmarks.run                   # every workload, every peer
    python -m benchmarks.run --quick           # smoke: quick rows, few repeats
    python -m benchmarks.run --workloads mlp,gpt2 --peers eager,dynajax

Prints a table of per-call medians and ratios, cold first-call times, memory over many
calls and the project's speed targets; writes ``benchmarks/results/<stamp>.json`` (and
``latest.json``) and a plot (``<stamp>.png``, ``latest.png``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks.threads import set_threads

RESULTS = Path(__file__).parent / "results"


def _fmt_time(s: float | None) -> str:
    from benchmarks.figures import time_text

    return time_text(s) or "-"


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _median(res: dict[str, Any], peer: str) -> float | None:
    r = res.get(peer, {})
    return r.get("median_s") if r.get("status") == "ok" else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks import harness
    from benchmarks.workloads import WORKLOADS, default_rows, device, grid_rows

    if args.suite:  # the test suite's models: rows built on the fly, not in WORKLOADS
        from benchmarks.suite import suite_workloads

        WORKLOADS = suite_workloads(train=args.train)  # noqa: N806
        args.no_first_call = True  # first-call workers look rows up in WORKLOADS
    names = args.workloads.split(",") if args.workloads else default_rows(WORKLOADS)
    if args.grid and not args.workloads:
        names = grid_rows(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    if args.quick and not args.workloads:
        names = [n for n in names if WORKLOADS[n].quick]
    peers = args.peers.split(",")
    bad = [p for p in peers if p not in harness.PEERS]
    if bad:
        sys.exit(f"unknown peer(s) {bad}; known: {list(harness.PEERS)}")

    repeats = args.repeats or (5 if args.quick or args.suite else 30)
    out: dict[str, Any] = {
        "meta": {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "jax": __import__("jax").__version__,
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "quick": args.quick,
            "repeats": repeats,
            "peers": peers,
            "torch_threads": torch.get_num_threads(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "cpu_settings": cpu_settings(),
            "cpu": cpu_description(),
            "suite": args.suite,
            "device": str(device()),
            "device_name": torch.cuda.get_device_name() if device().type == "cuda" else None,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        },
        "workloads": {},
    }
    for name in names:
        w = WORKLOADS[name]
        print(f"[bench] {name}: steady state ...", file=sys.stderr, flush=True)
        steady = harness.time_steady(
            w,
            peers,
            repeats=repeats,
            warmup=args.warmup
            if args.warmup is not None
            else (2 if args.quick or args.suite else 5),
            budget_s=args.budget if args.budget is not None else (5.0 if args.suite else 20.0),
        )
        if args.no_memory:
            steady.get("dynajax", {}).pop("memory", None)
        first: dict[str, Any] = {}
        if not args.no_first_call:
            for peer in peers:
                print(f"[bench] {name}: first call, {peer} ...", file=sys.stderr, flush=True)
                first[peer] = harness.time_first_call(name, peer)
        out["workloads"][name] = {
            "group": w.group,
            "description": w.description,
            "steady": steady,
            "first_call": first,
        }
        # What is measured so far, should a long run be stopped (--report re-prints it).
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "partial.json").write_text(json.dumps(out, indent=1, default=str))
    out["summary"] = summarize(out)
    return out


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Ratios and the project's speed targets."""
    rows = out["workloads"]
    s: dict[str, Any] = {"ratios": {}, "targets": {}}
    for name, r in rows.items():
        st = r["steady"]
        d = _median(st, "dynajax")
        s["ratios"][name] = {
            "dynajax/inductor": _ratio(d, _median(st, "inductor")),
            "dynajax/eager": _ratio(d, _median(st, "eager")),
            "dynajax/jax": _ratio(d, _median(st, "jax")),
            "inductor/eager": _ratio(_median(st, "inductor"), _median(st, "eager")),
        }
        fc = r["first_call"]
        fd = fc.get("dynajax", {}).get("first_s")
        fi = fc.get("inductor", {}).get("first_s")
        s["ratios"][name]["first_call dynajax/inductor"] = _ratio(fd, fi)
    t = s["targets"]

    def target(key: str, value: float | None, limit: float) -> None:
        t[key] = {"value": value, "limit": limit, "met": value is not None and value <= limit}

    # Issue 19's targets: x + 1 and 100 inputs at most inductor's time, every model
    # and training row at most inductor's, their geomean at most 0.9x.
    for name in ("add-one", "100-inputs"):
        if name in rows:
            target(f"{name}: dynajax/inductor", s["ratios"][name]["dynajax/inductor"], 1.0)
    if "100-inputs" in rows:
        target("100-inputs: dynajax/jax", s["ratios"]["100-inputs"]["dynajax/jax"], 2.0)
    models = [n for n, r in rows.items() if r["group"] == "model"]
    heavy = [n for n, r in rows.items() if r["group"] in ("model", "training")]
    for n in heavy:
        target(f"{n}: dynajax/inductor", s["ratios"][n]["dynajax/inductor"], 1.0)
    if heavy:
        g = _geomean([s["ratios"][n]["dynajax/inductor"] for n in heavy])
        target("model and training rows geomean: dynajax/inductor", g, 0.9)
    if models:
        # The inference rows' own geomean targets.
        for peer, limit in (("inductor", 0.7), ("eager", 0.6)):
            g = _geomean([s["ratios"][n][f"dynajax/{peer}"] for n in models])
            target(f"models geomean: dynajax/{peer}", g, limit)
        g = _geomean([s["ratios"][n]["first_call dynajax/inductor"] for n in models])
        if g is not None:
            target("models first-call geomean: dynajax/inductor", g, 0.5)
    for n, parts in interleaved_parts(rows).items():
        target(f"{n}: interleaved sum dynajax/inductor", s["ratios"][n]["dynajax/inductor"], 1.0)
        for call in ("compiled", "eager"):
            ratio = parts.get("dynajax", {}).get(f"{call} vs alone")
            target(f"{n}: dynajax row's {call} call vs alone", ratio, 1.1)
    training = [n for n, r in rows.items() if r["group"] == "training"]
    if training:  # no target of their own: reported beside the model rows
        s["training geomean"] = {
            f"dynajax/{peer}": _geomean([s["ratios"][n][f"dynajax/{peer}"] for n in training])
            for peer in ("inductor", "eager")
        }
    mem = {
        n: r["steady"]["dynajax"]["memory"]
        for n, r in rows.items()
        if "memory" in r["steady"].get("dynajax", {})
    }
    if mem:
        t["memory flat (RSS < 2 MiB growth, live buffers not growing)"] = {
            "value": {n: round(m["rss_delta_mib"], 2) for n, m in mem.items()},
            "limit": "flat",
            "met": all(m["flat"] for m in mem.values()),
        }
    return s


def interleaved_parts(rows: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per interleaved row and peer: the compiled call's and the eager call's median
    seconds, and each against its time alone (the row's model row in the same run: the
    peer's call there, and eager's)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, r in rows.items():
        if r["group"] != "interleaved":
            continue
        alone = rows.get(name.removesuffix("-interleaved"), {}).get("steady", {})
        out[name] = {}
        for peer, res in r["steady"].items():
            parts = res.get("parts_median_s")
            if not parts:
                continue
            out[name][peer] = {
                "compiled": parts["compiled"],
                "eager": parts["eager"],
                "compiled vs alone": _ratio(parts["compiled"], _median(alone, peer)),
                "eager vs alone": _ratio(parts["eager"], _median(alone, "eager")),
            }
    return out


def print_report(out: dict[str, Any]) -> None:
    peers = out["meta"]["peers"]
    rows = out["workloads"]
    ratios = out["summary"]["ratios"]
    print()
    meta = out["meta"]
    if meta.get("cpu"):
        print(f"CPU: {meta['cpu']}")
    print(
        f"load average at start: {meta['load_avg']}  cpus: {meta['cpus']}  "
        f"torch threads: {meta.get('torch_threads')}  XLA_FLAGS: {meta.get('xla_flags') or '-'}"
    )
    if meta.get("cpu_settings"):
        print("  ".join(f"{k}: {v}" for k, v in meta["cpu_settings"].items()))
    if meta.get("device", "cpu") != "cpu":
        print(
            f"device: {meta['device']} ({meta.get('device_name')}), float32 matmul precision: "
            f"{meta.get('float32_matmul_precision')}  torch {meta['torch']}  jax {meta['jax']}"
        )
    # The largest |dynajax - eager| over a row's outputs, on its first call (inference rows).
    errs = {n: r["steady"].get("dynajax", {}).get("max_abs_diff_vs_eager") for n, r in rows.items()}
    show_err = any(e is not None for e in errs.values())
    head = (
        ["workload"]
        + peers
        + ["dj/ind", "dj/eager", "dj/jax"]
        + (["|dj-eager|"] if show_err else [])
    )
    lines = [head]
    for name, r in rows.items():
        st = r["steady"]
        cells = [name]
        for p in peers:
            res = st.get(p, {})
            cells.append(
                _fmt_time(res.get("median_s"))
                if res.get("status") == "ok"
                else res.get("status", "-")
            )
        for k in ("dynajax/inductor", "dynajax/eager", "dynajax/jax"):
            v = ratios[name][k]
            cells.append(f"{v:.2f}" if v else "-")
        if show_err:
            cells.append("-" if errs[name] is None else f"{errs[name]:.1e}")
        lines.append(cells)
    _table("steady state, median per call", lines)

    if any(r["first_call"] for r in rows.values()):
        lines = [["workload"] + peers + ["dj/ind"]]
        for name, r in rows.items():
            fc = r["first_call"]
            cells = [name]
            for p in peers:
                res = fc.get(p, {})
                cells.append(
                    _fmt_time(res.get("first_s"))
                    if res.get("status") == "ok"
                    else res.get("status", "-")
                )
            v = ratios[name]["first_call dynajax/inductor"]
            cells.append(f"{v:.2f}" if v else "-")
            lines.append(cells)
        _table("first call (compile + run), cold caches, fresh process", lines)

    split = interleaved_parts(rows)
    if any(split.values()):
        lines = [["workload", "peer", "compiled call", "eager call", "sum", "vs alone"]]
        for name, by_peer in split.items():
            for peer, p in by_peer.items():
                vs = [p["compiled vs alone"], p["eager vs alone"]]
                total = rows[name]["steady"][peer]["median_s"]
                lines.append(
                    [
                        name,
                        peer,
                        _fmt_time(p["compiled"]),
                        _fmt_time(p["eager"]),
                        _fmt_time(total),
                        " / ".join(f"{v:.2f}" if v else "-" for v in vs),
                    ]
                )
        _table(
            "interleaved: each call's median (vs alone: the compiled call against the "
            "peer's model row, the eager call against eager's)",
            lines,
        )

    mem_lines = [["workload", "calls", "RSS before", "RSS delta", "live arrays", "flat"]]
    for name, r in rows.items():
        m = r["steady"].get("dynajax", {}).get("memory")
        if m:
            mem_lines.append(
                [
                    name,
                    str(m["calls"]),
                    f"{m['rss_before_mib']:.1f} MiB",
                    f"{m['rss_delta_mib']:+.2f} MiB",
                    f"{m['live_arrays_before']} -> {m['live_arrays_after']}",
                    "yes" if m["flat"] else "NO",
                ]
            )
    if len(mem_lines) > 1:
        _table("dynajax memory over repeated calls", mem_lines)

    errors = [
        (name, p, res["error"])
        for name, r in rows.items()
        for part in ("steady", "first_call")
        for p, res in r[part].items()
        if isinstance(res, dict) and res.get("status") == "error"
    ]
    for name, p, e in errors:
        print(f"error: {name} / {p}: {e}")
    graphs = {n: r["steady"].get("dynajax", {}).get("graphs") for n, r in rows.items()}
    if any(graphs.values()):
        print("\ndynajax's graphs per row:")
        for name, g in graphs.items():
            if g:
                print(f"  {name}: {g}")

    if "training geomean" in out["summary"]:
        shown = {
            k: round(v, 2) if v else None for k, v in out["summary"]["training geomean"].items()
        }
        print(f"\ntraining rows geomean (no target): {shown}")
    print("\ntargets:")
    for k, v in out["summary"]["targets"].items():
        val = v["value"]
        shown = f"{val:.2f}" if isinstance(val, float) else str(val)
        print(f"  [{'met' if v['met'] else 'MISSED'}] {k} = {shown} (limit {v['limit']})")


def _table(title: str, lines: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    print(f"\n{title}")
    for j, row in enumerate(lines):
        print(
            "  ".join(
                c.rjust(wd) if i else c.ljust(wd)
                for i, (c, wd) in enumerate(zip(row, widths, strict=True))
            )
        )
        if j == 0:
            print("  ".join("-" * wd for wd in widths))


def plot(out: dict[str, Any], path: Path) -> bool:
    """Each row's time against inductor's, as the guide's plot draws it (benchmarks.figures)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    from benchmarks import figures

    figures.draw_benchmarks(out, figures.benchmarks_table(out), path)
    return True


# Environment settings that change the CPU's kernels or threads, read when the libraries
# load (so as the process started): the OpenMP runtime's spin (runtime/omp.py), the
# instruction sets PyTorch's kernels, oneDNN, MKL and XLA may use (an AVX2-only CPU is
# emulated with these on an AVX-512 one; benchmarks/RECORD.md).
CPU_SETTINGS = (
    "GOMP_SPINCOUNT",
    "OMP_WAIT_POLICY",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)


def cpu_settings() -> dict[str, str]:
    """The CPU settings in effect: PyTorch's kernels' instruction set, and each of
    ``CPU_SETTINGS`` that the environment sets."""
    import torch

    found = {"torch kernels": torch.backends.cpu.get_cpu_capability()}
    found.update({k: os.environ[k] for k in CPU_SETTINGS if k in os.environ})
    return found


def cpu_description() -> str:
    """The CPU a speed claim names: vendor, model (family and model numbers) and the
    instruction sets the kernels may use, from ``/proc/cpuinfo`` (``platform`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    isa = [
        name
        for name, flag in (
            ("AVX2", "avx2"),
            ("AVX-512", "avx512f"),
            ("AVX-512 BF16", "avx512_bf16"),
            ("AMX", "amx_tile"),
        )
        if flag in flags
    ]
    return (
        f"{fields.get('vendor_id', '?')} {fields.get('model name', '?')} "
        f"(family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}); "
        f"{', '.join(isa) or 'no AVX2'}; {os.cpu_count()} logical CPUs"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="quick rows only, few repeats")
    p.add_argument(
        "--grid",
        action="store_true",
        help="every model row at three sizes (its own, a smaller and a larger one)",
    )
    p.add_argument("--workloads", help="comma-separated names (default: all)")
    p.add_argument(
        "--peers",
        help="default eager,inductor,dynajax,jax (suite: no jax); also dynajax-jax: "
        "perf_fallbacks=False, every op with a rule in JAX",
    )
    p.add_argument("--repeats", type=int, help="timing rounds per peer (default 30; quick 5)")
    p.add_argument("--warmup", type=int, help="untimed calls before timing (default 5; quick 2)")
    p.add_argument(
        "--budget", type=float, help="seconds of timing per workload (default 20; suite 5)"
    )
    p.add_argument(
        "--suite",
        choices=["models"],
        help="models: every model of the test suite (tests/test_models.py and the "
        "transformers zoo) instead of the benchmark table; peers eager,inductor,dynajax, "
        "5 repeats, no first-call runs",
    )
    p.add_argument("--train", action="store_true", help="with --suite: a training row per model")
    p.add_argument(
        "--decode",
        action="store_true",
        help="run benchmarks.decode (greedy generation with a static KV cache) instead",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where models and inputs live (default cpu); cuda: every step synchronizes "
        "the device before its time is taken",
    )
    p.add_argument("--no-first-call", action="store_true", help="skip cold first-call runs")
    p.add_argument("--no-memory", action="store_true", help="skip memory checks")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--docs",
        action="store_true",
        help="also write docs/benchmarks.json and redraw the guide's tables and plots from "
        "it (python -m benchmarks.figures)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    p.add_argument(
        "--first-call-worker", nargs=2, metavar=("WORKLOAD", "PEER"), help=argparse.SUPPRESS
    )
    p.add_argument("--report", type=Path, help="re-print the tables of a saved results JSON")
    p.add_argument(
        "--threads",
        type=int,
        help="compute threads for every peer (torch intra-op threads; 1 also makes XLA's "
        "CPU backend single-threaded). On a loaded machine, torch's OpenMP threads suffer "
        "far more from oversubscription than XLA's pool: --threads 1 compares like with "
        "like there. Default: each library's own default.",
    )
    args = p.parse_args(argv)
    from benchmarks.workloads import DEVICE_ENV

    if args.device:  # an environment variable: first-call workers inherit it
        os.environ[DEVICE_ENV] = args.device
    if args.peers is None:
        args.peers = "eager,inductor,dynajax" + ("" if args.suite else ",jax")
    if args.threads:
        set_threads(args.threads)
    if args.decode:
        from benchmarks import decode

        return decode.main([f"--rounds={args.repeats or 5}", f"--device={args.device or 'cpu'}"])

    if args.report:
        out = json.loads(args.report.read_text())
        out["summary"] = summarize(out)
        print_report(out)
        return 0

    if os.environ.get("DYNAJAX_BENCH_THREADS") and not args.threads:
        set_threads(int(os.environ["DYNAJAX_BENCH_THREADS"]))
    if args.first_call_worker:
        from benchmarks.harness import first_call_worker

        print(json.dumps(first_call_worker(*args.first_call_worker)))
        return 0

    out = run(args)
    print_report(out)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    js = args.out / f"{stamp}.json"
    js.write_text(json.dumps(out, indent=1, default=str))
    shutil.copyfile(js, args.out / "latest.json")
    print(f"\nwrote {js}")
    if not args.no_plot:
        png = args.out / f"{stamp}.png"
        if plot(out, png):
            shutil.copyfile(png, args.out / "latest.png")
            print(f"wrote {png}")
    if args.docs:
        from benchmarks import figures

        shutil.copyfile(js, figures.FIGURES["benchmarks"].source)
        figures.update()
    return 0


if __name__ == "__main__":
    sys.exit(main())
