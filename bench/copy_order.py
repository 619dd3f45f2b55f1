"""What the order of copies costs the Ideal schedule at the results points, link by link.

docs/results.md judges the engine against the Ideal (each link serves the copies ready to go
earliest deadline first) and against the Ideal with copies in issue order (each link runs
them in the order they were released, as a CUDA stream runs what was enqueued on it). This
splits the second yardstick's extra time by link, and asks how much of it a host could win
back by holding copies out and enqueueing them in deadline order, as an engine on a CUDA
stream could:

- *out in order*: only the device-to-host link in issue order;
- *in in order*: only the host-to-device link in issue order;
- *held N*: copies out in issue order, each held until the copies out due sooner and
  released within the next N ops were released (yardsticks._held_anchors); *held all*
  without a bound.

Every figure is the Ideal's own (no engine runs here), the same two steps as the results.

    .venv/bin/python bench/copy_order.py                 # the results points
    .venv/bin/python bench/copy_order.py --only UNet3D --json /tmp/order.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HOLDS = (8, 128)
HOLD_ALL = sys.maxsize
COLUMNS = (
    ("in_order_s", "both in order"),
    ("out_in_order_s", "out in order"),
    ("in_in_order_s", "in in order"),
    *((f"held_{n}_s", f"held {n}") for n in HOLDS),
    ("held_all_s", "held all"),
)


def _compare_engines() -> Any:
    """bench/compare_engines.py as a module: its Point and results_points."""
    spec = importlib.util.spec_from_file_location(
        "compare_engines", REPO / "bench" / "compare_engines.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compare_engines"] = mod  # its dataclasses look themselves up there
    spec.loader.exec_module(mod)
    return mod


def order_row(plan: Any, schedule: dict[str, Any], steps: int = 2) -> dict[str, float | None]:
    """The Ideal's step under each order of COLUMNS, and its own (`ideal_s`); None where the
    Ideal does not fit. `schedule`: simulate._schedule_on's keywords."""
    from tflms.planner.yardsticks import ideal

    def step(**order: Any) -> float | None:
        res = ideal(plan, steps=steps, **schedule, **order)
        return res.step_time_s if res.fits else None

    row: dict[str, float | None] = {
        "ideal_s": step(),
        "in_order_s": step(in_order=True),
        "out_in_order_s": step(out_in_order=True),
        "in_in_order_s": step(in_in_order=True),
    }
    for n in HOLDS:
        row[f"held_{n}_s"] = step(out_in_order=True, hold_out_ops=n)
    row["held_all_s"] = step(out_in_order=True, hold_out_ops=HOLD_ALL)
    return row


def report(labels: list[str], rows: list[dict[str, float | None]]) -> str:
    """Each point's Ideal and each order's step over it, then the geometric means."""
    head = " | ".join(name for _, name in COLUMNS)
    lines = [
        "# The Ideal's step with its copies ordered otherwise (over the Ideal's own)",
        "",
        f"| point | Ideal | {head} |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    logs: dict[str, list[float]] = {key: [] for key, _ in COLUMNS}
    for label, row in zip(labels, rows, strict=True):
        ideal_s = row["ideal_s"]
        if ideal_s is None:
            lines.append(f"| {label} | does not fit |" + " - |" * len(COLUMNS))
            continue
        cells = []
        for key, _ in COLUMNS:
            value = row[key]
            if value is None:
                cells.append("-")
                continue
            logs[key].append(math.log(value / ideal_s))
            cells.append(f"{value / ideal_s:.3f}x")
        lines.append(f"| {label} | {ideal_s:.3f} s | " + " | ".join(cells) + " |")
    if any(logs.values()):
        means = [
            f"{name} {math.exp(sum(v) / len(v)):.3f}x" if v else f"{name} -"
            for (key, name), v in ((c, logs[c[0]]) for c in COLUMNS)
        ]
        lines += ["", "Geometric means over the Ideal: " + ", ".join(means) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(REPO / "docs" / "results.json"))
    ap.add_argument("--only", help="only points whose label contains this text")
    ap.add_argument("--json", dest="json_out", help="also write every point's figures here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from tflms.planner import machines, replay, study
    from tflms.planner.simulate import Machine, _schedule_on

    ce = _compare_engines()
    try:
        results = json.loads(Path(args.results).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(
            f"cannot read {args.results}: {exc} (give --results a saved "
            "`tflms results --json-output` file)"
        ) from exc
    points = ce.results_points(results, (1.0,), args.only)
    if not points:
        raise SystemExit(f"no prefetch point in {args.results} matches --only {args.only!r}")
    rows = []
    for p in tqdm(points, unit="point", disable=args.no_progress):
        trace = study.get_trace(p.model, p.batch if p.input_size is None else 1, p.input_size)
        m = Machine.from_pairing(machines.get_pairing(p.machine))
        plan = replay.build_plan(trace, m.gpu)
        rows.append(order_row(plan, _schedule_on(m)))
    labels = [p.label() for p in points]
    print(report(labels, rows))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps([{"point": lb, **row} for lb, row in zip(labels, rows, strict=True)])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
