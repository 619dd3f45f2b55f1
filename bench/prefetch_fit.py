"""`make bench-prefetch`: prefetch against on-demand paging inside real TensorFlow, in time.

Runs the CPU harness's Keras `fit` (tests/tfcpu_cases.py `keras_fit`: a 16-layer CNN over
a tf.data pipeline, validation each epoch, a callback between steps) in fresh processes,
on-demand and prefetch interleaved, with both copy streams paced to a link of
`--link-gbps` in real time. A kernel then waits for a late page-in as the GPU's compute
stream would; the harness measures that wall time (`kernel_wait_ns`), which no engine
counter sees on a GPU.

Prints, per mode, the median [min - max] over runs of: the fit's wall time, the time
kernels waited for copies, the time reclaims waited for page-outs, bytes paged in, bytes
paged in on demand (what prefetch did not bring back in time), the kernels' wait per MB
paged in, prefetch hits, the share of them whose copy had not landed when their kernel
pinned them, and the share of pins found in the learned order; then
prefetch / on-demand of the medians.

The traffic varies by up to 3x between runs in both modes, mostly between two levels,
because TensorFlow runs the training function's kernels in a different order from one
process to the next (docs/how-it-works.md; the cause is not found). Medians of the wait
then say more about which orders the runs drew than about the mode. The wait per MB paged
in hardly depends on the order (0.84-0.90 ms on demand at 2 GB/s, in either), and it is
the figure to compare. `--device-memory` sets the modelled device (default: the test's, a
quarter of the fit's peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("lms", "prefetch")
CASES = ("keras_fit", "keras_fit_deep")
LABELS = {
    "lms": "on-demand",
    "prefetch": "prefetch",
    "guarded": "prefetch + guard",
    "unheld": "prefetch, host unheld",
}
# Modes that run another tfcpu_cases mode under extra environment: `unheld` is prefetch with
# the engine's host throttle off (TF_LMS_RUN_AHEAD_EPOCHS=0; its default holds the host
# within 8 last-use epochs of the compute stream).
CASE_MODES = {"unheld": ("prefetch", {"TF_LMS_RUN_AHEAD_EPOCHS": "0"})}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs per mode (default 5)")
    p.add_argument(
        "--link-gbps",
        type=float,
        default=2.0,
        help="modelled link in GB/s each way, 0 for memcpy speed (default 2)",
    )
    p.add_argument(
        "--device-memory",
        default=None,
        help="modelled device memory, e.g. 4736KiB (default: the test's, a quarter of the "
        "fit's peak)",
    )
    p.add_argument(
        "--case",
        choices=CASES,
        default="keras_fit",
        help="keras_fit (activations 22%% of its device, over the prefetch budget) or "
        "keras_fit_deep (48 narrower layers, activations a twelfth of its device, as on a "
        "GPU); default keras_fit",
    )
    p.add_argument(
        "--guard",
        action="store_true",
        help="also run prefetch with the engine's guard (times steps with and without "
        "prefetch once learned and keeps the faster mode)",
    )
    p.add_argument(
        "--unheld",
        action="store_true",
        help="also run prefetch with the host throttle off (TF_LMS_RUN_AHEAD_EPOCHS=0), to "
        "measure what holding the host near the compute stream does",
    )
    p.add_argument("--json", type=Path, help="also write every run's figures here")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    if args.link_gbps < 0:
        p.error(f"--link-gbps must be >= 0, got {args.link_gbps}")
    return args


def run_fit(
    mode: str, link_gbps: float, device_memory: str | None = None, case: str = "keras_fit"
) -> dict[str, Any]:
    """One Keras fit in a fresh process; its figures."""
    case_mode, extra = CASE_MODES.get(mode, (mode, {}))
    env = {
        **os.environ,
        **extra,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "TFCPU_LINK_BYTES_PER_SECOND": str(link_gbps * 1e9),
        "TFCPU_VERIFY_PINS": "0",  # the tests' byte checks would be timed too
    }
    if device_memory:
        env["TFCPU_DEVICE_MEMORY"] = device_memory
    proc = subprocess.run(
        [sys.executable, "-m", "tests.tfcpu_cases", case, case_mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{case} ({mode}) failed:\n{proc.stderr[-3000:]}")
    return figures_of(json.loads(lines[-1][len("RESULT ") :]))


def figures_of(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the table shows, from one run's RESULT line."""
    s = result["stats"]
    return {
        "wall_s": result["wall_s"],
        "kernel_wait_ms": result["kernel_wait_ns"] / 1e6,
        "page_out_wait_ms": s["page_out_wait_ns"] / 1e6,
        "mb_paged_in": s["bytes_paged_in"] / 1e6,
        "mb_on_demand": s["bytes_paged_in_on_demand"] / 1e6,
        # The traffic depends on the kernel order a run draws, whatever the mode; the wait
        # per MB moved compares the modes across that.
        "wait_per_mb": result["kernel_wait_ns"] / 1e6 / (s["bytes_paged_in"] / 1e6)
        if s["bytes_paged_in"]
        else 0.0,
        "prefetch_hits": s["prefetch_hits"],
        "in_flight_pct": 100.0 * s["prefetch_hits_in_flight"] / s["prefetch_hits"]
        if s["prefetch_hits"]
        else 0.0,
        "in_order_pct": 100.0 * s["prefetch_pins_in_order"] / s["prefetch_pins"]
        if s["prefetch_pins"]
        else 0.0,
    }


COLUMNS = (
    ("wall_s", "fit wall", "{:.2f} s"),
    ("kernel_wait_ms", "kernels waited", "{:.0f} ms"),
    ("page_out_wait_ms", "reclaims waited", "{:.0f} ms"),
    ("mb_paged_in", "paged in", "{:.0f} MB"),
    ("mb_on_demand", "on demand", "{:.0f} MB"),
    ("wait_per_mb", "waited per MB in", "{:.2f} ms"),
    ("prefetch_hits", "prefetch hits", "{:.0f}"),
    ("in_flight_pct", "hits in flight", "{:.0f}%"),
    ("in_order_pct", "pins in order", "{:.0f}%"),
)


def format_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    header = "| mode | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 1)]
    for mode in runs:
        cells = []
        for key, _, fmt in COLUMNS:
            values = [r[key] for r in runs[mode]]
            med = statistics.median(values)
            cells.append(
                f"{fmt.format(med)} [{fmt.format(min(values))} - {fmt.format(max(values))}]"
            )
        lines.append(f"| {LABELS[mode]} | " + " | ".join(cells) + " |")
    lines.append("")
    base = {key: statistics.median(r[key] for r in runs["lms"]) for key, _, _ in COLUMNS[:6]}
    for mode in runs:
        if mode == "lms":
            continue
        ratios = []
        for key, label, _ in COLUMNS[:6]:
            other = statistics.median(r[key] for r in runs[mode])
            ratios.append(f"{label} {other / base[key]:.2f}x" if base[key] else f"{label} -")
        lines.append(f"{LABELS[mode]} / on-demand (medians): " + ", ".join(ratios))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from tqdm import tqdm  # noqa: PLC0415

    import tflms.tfcpu as tc  # noqa: PLC0415

    tc.library()  # built once, with its own progress bar, before the runs
    modes = (*MODES, *(("guarded",) if args.guard else ()), *(("unheld",) if args.unheld else ()))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tqdm(total=args.runs * len(modes), desc=args.case, unit="run") as bar:
        for _ in range(args.runs):
            for mode in modes:  # interleaved: drift in machine load hits both
                runs[mode].append(run_fit(mode, args.link_gbps, args.device_memory, args.case))
                bar.update()
    link = f"{args.link_gbps:g} GB/s each way" if args.link_gbps else "memcpy speed"
    memory = args.device_memory or "the test's (a quarter of the peak)"
    print(
        f"\n{args.case} in the CPU harness, link {link}, device memory {memory}, "
        f"{args.runs} runs per mode\n"
    )
    print(format_table(runs))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "case": args.case,
                    "link_gbps": args.link_gbps,
                    "device_memory": args.device_memory,
                    "runs": runs,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
