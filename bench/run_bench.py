"""`make bench`: the engine against TensorFlow's own BFC allocator, side by side in one run.

Builds bench/tf_bfc_harness if needed (see bench/harness_build.py), runs it,
and prints two tables:

* nanoseconds per allocate/free pair on a ResNet-50-like training trace and on
  a random trace, for TensorFlow's tsl::BFCAllocator (libtensorflow_framework
  from the tensorflow-cpu wheel) and the engine with LMS off, with LMS on but
  no memory pressure (raw allocations, buffers, and the full tensor lifecycle);
  each ratio is the median over repetitions of (variant / TensorFlow) timed in
  the same repetition, so load from other processes affects both sides;
* page-out/page-in throughput of the sim backend against memcpy of the same bytes.

Exits non-zero only when something fails (build, harness); a missed speed goal
is reported, not fatal. Raw results go to build/bench/bench_results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness_build import BUILD_DIR, BuildError, build_harness, harness_env  # noqa: E402

# Goals from the project brief: LMS off clearly faster than TensorFlow, LMS on
# without pressure no slower; the tensor path (AllocateBuffer) no slower either, and a
# whole tensor lifecycle with a pin and an unpin at most 1.5x (issue 11).
GOALS: dict[str, float] = {
    "engine_lms_off_raw": 0.8,
    "engine_lms_on_raw": 1.0,
    "engine_lms_on_buffer": 1.0,
    "engine_lms_on_tensor": 1.5,
}

ROW_LABELS: dict[str, str] = {
    "tf_bfc": "TensorFlow tsl::BFCAllocator",
    "engine_lms_off_raw": "engine, LMS off (AllocateRaw)",
    "engine_lms_on_raw": "engine, LMS on, no pressure (AllocateRaw)",
    "engine_lms_on_buffer": "engine, LMS on, no pressure (AllocateBuffer)",
    "engine_lms_on_tensor": "engine, LMS on, tensor lifecycle (+unpin/pin/unpin)",
}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per variant (default 7)")
    p.add_argument(
        "--quick", action="store_true", help="small traces (a smoke run, not a measurement)"
    )
    p.add_argument("--rebuild", action="store_true", help="recompile the harness from scratch")
    p.add_argument(
        "--json",
        type=Path,
        default=BUILD_DIR / "bench_results.json",
        help="where to write the raw results (default build/bench/bench_results.json)",
    )
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    return args


def _paired_ratios(rows: dict[str, list[float]], name: str) -> list[float]:
    """This variant's time over TensorFlow's in the same repetition, one per repetition."""
    return [a / b for a, b in zip(rows[name], rows["tf_bfc"], strict=True)]


def _spread(ratios: list[float]) -> str:
    """The middle half of the paired ratios (all of them under four repetitions).

    On a shared 2-core machine the ratios of one run spread over +-10%, so a median
    near a goal can land on either side of it from run to run: the spread says when.
    """
    if len(ratios) < 4:
        return f"{min(ratios):.2f}-{max(ratios):.2f}"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return f"{q1:.2f}-{q3:.2f}"


def format_speed_table(result: dict[str, Any]) -> tuple[str, dict[str, bool]]:
    lines: list[str] = []
    header = (
        f"{'trace':<10} {'allocator':<52} {'ns/pair':>9} {'vs TF':>7} {'middle half':>12}  goal"
    )
    lines.append(header)
    lines.append("-" * len(header))
    met: dict[str, bool] = {name: True for name in GOALS}
    for trace in result["traces"]:
        rows = {r["name"]: r["ns_per_pair"] for r in trace["rows"]}
        for name, samples in rows.items():
            ratios = _paired_ratios(rows, name)
            ratio = statistics.median(ratios)
            goal = ""
            if name in GOALS:
                ok = ratio <= GOALS[name]
                met[name] = met[name] and ok
                goal = f"<= {GOALS[name]:.2f}x {'met' if ok else 'MISSED'}"
            label = ROW_LABELS.get(name, name)
            lines.append(
                f"{trace['name']:<10} {label:<52} {statistics.median(samples):>9.1f} "
                f"{ratio:>6.2f}x {_spread(ratios):>12}  {goal}"
            )
        lines.append(
            f"{'':<10} ({trace['allocs']:,} allocations, peak live "
            f"{trace['max_live_bytes'] / 2**20:,.0f} MiB, {len(rows['tf_bfc'])} repetitions)"
        )
    return "\n".join(lines), met


def format_paging_table(paging: list[dict[str, Any]]) -> str:
    lines = [
        f"{'size':>9} {'page-out GB/s':>14} {'page-in GB/s':>13} {'memcpy GB/s':>12} "
        f"{'out/memcpy':>11} {'in/memcpy':>10}"
    ]
    for p in paging:
        out = statistics.median(p["page_out_gbps"])
        inn = statistics.median(p["page_in_gbps"])
        cpy = statistics.median(p["memcpy_gbps"])
        lines.append(
            f"{p['bytes'] / 2**20:>6.0f} MiB {out:>14.2f} {inn:>13.2f} {cpy:>12.2f} "
            f"{out / cpy:>10.2f}x {inn / cpy:>9.2f}x"
        )
    return "\n".join(lines)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:,.0f} KiB"


def format_bookkeeping_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'device':>10} {'TensorFlow BFC':>15} {'engine':>10} {'TF / device':>12}"]
    for r in rows:
        lines.append(
            f"{r['memory_limit'] / 2**30:>6.0f} GiB {_kib(r['tf_bytes']):>15} "
            f"{_kib(r['engine_bytes']):>10} {r['tf_bytes'] / r['memory_limit']:>12.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    print("bench: building the harness (engine + TensorFlow's BFC) if needed...", flush=True)
    try:
        binary = build_harness(progress=lambda m: print(f"  {m}", flush=True), force=args.rebuild)
    except BuildError as err:
        print(f"bench: error: {err}", file=sys.stderr)
        return 1
    scale = "small" if args.quick else "full"
    cmd = [str(binary), "bench", f"reps={args.reps}", f"scale={scale}"]
    print(
        f"bench: running {' '.join(cmd[1:])} (about {'10 s' if args.quick else '1-2 min'})...",
        flush=True,
    )
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=harness_env(), check=False)
    if proc.returncode != 0:
        print(f"bench: error: the harness failed:\n{proc.stderr[-4000:]}", file=sys.stderr)
        return 1
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        print(f"bench: error: unreadable harness output:\n{proc.stdout[-2000:]}", file=sys.stderr)
        return 1
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    table, met = format_speed_table(result)
    print(
        f"\nTime per allocate/free pair (median; {time.monotonic() - start:.0f} s). vs TF: each "
        "repetition's time over TensorFlow's in the same repetition, median and middle half.\n"
    )
    print(table)
    print("\nSim backend page-out/page-in vs memcpy (median)\n")
    print(format_paging_table(result["paging"]))
    print("\nHost memory the allocator's own bookkeeping holds (whole device as one region)\n")
    print(format_bookkeeping_table(result["bookkeeping"]))
    print()
    for name, goal in GOALS.items():
        verdict = "met" if met[name] else "NOT met"
        print(f"goal: {ROW_LABELS[name]} <= {goal:.1f}x TensorFlow on every trace: {verdict}")
    print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
