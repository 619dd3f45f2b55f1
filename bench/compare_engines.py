"""Two engine builds replayed side by side at the results points and their neighbours.

One results point is one batch, and where a step's buffers land moves its time by
several percent either way: a rule that wins at one batch can lose at the next. So a
change to the engine's rules is judged here at each prefetch point of docs/results.json
and at batches a few percent either side of it (docs/how-it-works.md, "Copies in by
deadline, judged at neighbouring batches"). Each side is a whole revision: its C++ engine
and its Python replay, built once into ~/.cache/tflms/engines/<commit> from `git archive`
(the working tree itself is the default head). Both sides replay the same points in one
run, each in its own process, and the replays are deterministic, so a tree compared with
itself gives every point the same time to the last bit.

    .venv/bin/python bench/compare_engines.py --base HEAD            # working tree vs HEAD
    .venv/bin/python bench/compare_engines.py --base main~3 --head main --only ResNet50
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKTREE = "WORKTREE"
DEFAULT_FRACTIONS = (0.96, 0.98, 1.0, 1.02, 1.04)
# A point counts as changed when its step moved by more than this fraction.
CHANGED = 0.01


@dataclass(frozen=True)
class Point:
    model: str
    machine: str
    batch: int
    input_size: int | None  # the 3D U-Net's cube edge (batch 1); None for batch points

    def label(self) -> str:
        size = f"{self.input_size}^3" if self.input_size is not None else str(self.batch)
        return f"{self.model} {self.machine} {size}"


def results_points(
    results: dict[str, Any], fractions: tuple[float, ...], only: str | None = None
) -> list[Point]:
    """Each prefetch point of a saved `tflms results` JSON, batch points also at
    `fractions` of their batch (rounded to even, as the results' batches are). Points
    given by size are taken as they are: a cube edge a few percent off changes the model."""
    out: list[Point] = []
    for study in results["studies"]:
        for row in study["overhead"]:
            if not row["prefetch"]:
                continue
            size = row.get("input_size")
            if size is not None:
                candidates = [Point(study["model"], row["machine"], row["batch_size"], size)]
            else:
                candidates = [
                    Point(
                        study["model"], row["machine"], 2 * round(row["batch_size"] * f / 2), None
                    )
                    for f in fractions
                ]
            for p in candidates:
                if p not in out and (only is None or only in p.label()):
                    out.append(p)
    return out


def resolve_commit(rev: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"{rev!r} names no commit in {REPO}: {exc.stderr.strip()}") from exc


def engines_dir() -> Path:
    root = os.environ.get("TFLMS_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "tflms"
    return base / "engines"


def built_tree(rev: str) -> Path:
    """The source tree of `rev` with its engine built in place: the working tree itself
    for WORKTREE (built by `make install`), else a cached export of that commit."""
    if rev == WORKTREE:
        if not list((REPO / "tflms").glob("_core*.so")):
            raise SystemExit("the working tree's engine is not built: run `make install` first")
        return REPO
    commit = resolve_commit(rev)
    tree = engines_dir() / commit
    if list((tree / "tflms").glob("_core*.so")):
        return tree
    print(f"building the engine of {rev} ({commit[:10]}) in {tree} ...", file=sys.stderr)
    tree.parent.mkdir(parents=True, exist_ok=True)
    # Exported and built aside, then renamed: an interrupted build leaves no tree that
    # looks built.
    staging = Path(tempfile.mkdtemp(prefix=f"{commit[:10]}-", dir=tree.parent))
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(staging)], input=archive, check=True)
        build = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
            cwd=staging,
            capture_output=True,
            text=True,
        )
        if build.returncode != 0:
            raise SystemExit(f"building the engine of {rev} failed:\n{build.stderr[-4000:]}")
        staging.rename(tree)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tree


# Runs inside each side's tree, with only that tree's tflms importable: reads the points
# as JSON on stdin and prints one JSON line per point as it is replayed. With "ideal", also
# the Ideal schedule's step and the Ideal's with copies in issue order (the yardsticks of
# docs/results.md, same steps); with "unfragmented", also the step with the engine's
# addresses taken out (tflms/planner/unfragmented.py) and by how many bytes its peak
# passed the device (0 unless the yardstick is broken).
WORKER = """
import dataclasses, json, sys
from tflms.planner import machines, replay, study
from tflms.planner.simulate import Machine, machine_yardsticks
job = json.load(sys.stdin)
for i, (model, machine, batch, size) in enumerate(job["points"]):
    trace = study.get_trace(model, batch if size is None else 1, size)
    m = Machine.from_pairing(machines.get_pairing(machine))
    plan = replay.build_plan(trace, m.gpu)
    r = replay.replay(plan, m.gpu, m.config(prefetch=True), steps=job["steps"], timed=True)
    row = {"i": i, "step_s": r.step_time_s if r.fits else None}
    if job["ideal"]:
        ys = machine_yardsticks(plan, m, job["steps"])
        for key, res in (("ideal_s", ys.ideal), ("ideal_in_order_s", ys.ideal_in_order)):
            row[key] = res.step_time_s if res.fits else None
    if job.get("unfragmented"):
        cfg = dataclasses.replace(m.config(prefetch=True), unfragmented=True)
        u = replay.replay(plan, m.gpu, cfg, steps=job["steps"], timed=True)
        row["unfragmented_s"] = u.step_time_s if u.fits else None
        peak = int(u.stats.get("peak_bytes_in_use", 0)) if u.stats else 0
        row["unfragmented_over_device"] = max(0, peak - m.gpu.memory_bytes)
    print(json.dumps(row), flush=True)
"""

Row = dict[str, Any]  # one point's figures from a side: step_s, and the Ideal's if asked


def replay_side(
    tree: Path,
    points: list[Point],
    steps: int,
    on_point: Callable[[], None],
    ideal: bool = False,
    unfragmented: bool = False,
) -> list[Row]:
    """Each point's mean step time with prefetch (step_s; None: out of memory), replayed
    by `tree`'s own engine and planner in a process of its own; with `ideal`, also
    ideal_s and ideal_in_order_s."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    job = json.dumps(
        {
            "steps": steps,
            "ideal": ideal,
            "unfragmented": unfragmented,
            "points": [[p.model, p.machine, p.batch, p.input_size] for p in points],
        }
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER],
        cwd=tree,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(job)
    proc.stdin.close()
    rows: list[Row] = [{"step_s": None} for _ in points]
    seen = 0
    for line in proc.stdout:
        row = json.loads(line)
        rows[row.pop("i")] = row
        seen += 1
        on_point()
    if proc.wait() != 0 or seen != len(points):
        raise SystemExit(f"the replay in {tree} failed after {seen} of {len(points)} points")
    return rows


@dataclass(frozen=True)
class Comparison:
    geomean_ratio: float  # head / base, over the points both fit
    faster: int  # points where head is faster by more than CHANGED
    slower: int
    compared: int
    new_ooms: list[str]  # fit with base, out of memory with head
    fixed_ooms: list[str]  # the other way round
    changed: list[tuple[str, float, float]]  # (label, base s, head s) beyond CHANGED


def geomean(ratios: list[float]) -> float:
    """The geometric mean of step ratios (nan for none)."""
    if not ratios:
        return float("nan")
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def compare(points: list[Point], base: list[float | None], head: list[float | None]) -> Comparison:
    ratios: list[float] = []
    faster = slower = 0
    new_ooms: list[str] = []
    fixed_ooms: list[str] = []
    changed: list[tuple[str, float, float]] = []
    for p, b, h in zip(points, base, head, strict=True):
        if b is None or h is None:
            if b is not None:
                new_ooms.append(p.label())
            elif h is not None:
                fixed_ooms.append(p.label())
            continue
        ratio = h / b
        ratios.append(ratio)
        faster += ratio < 1 - CHANGED
        slower += ratio > 1 + CHANGED
        if abs(ratio - 1) > CHANGED:
            changed.append((p.label(), b, h))
    return Comparison(geomean(ratios), faster, slower, len(ratios), new_ooms, fixed_ooms, changed)


def report(c: Comparison, base_name: str, head_name: str) -> str:
    lines = [f"# {head_name} against {base_name}, prefetch, mean step time", ""]
    if c.changed:
        lines += ["| point | base | head | change |", "|---|---|---|---|"]
        for label, b, h in c.changed:
            lines.append(f"| {label} | {b:.3f} s | {h:.3f} s | {h / b - 1:+.1%} |")
        lines.append("")
    lines.append(
        f"{c.compared} points: geometric mean {c.geomean_ratio - 1:+.2%}; "
        f"faster by over {CHANGED:.0%}: {c.faster}, slower by over {CHANGED:.0%}: {c.slower}"
    )
    for what, labels in (("out of memory with head only", c.new_ooms), ("fixed", c.fixed_ooms)):
        if labels:
            lines.append(f"{what}: {', '.join(labels)}")
    return "\n".join(lines)


def ideal_report(points: list[Point], head: list[Row], head_name: str) -> str:
    """Each point's head step against the Ideal and the Ideal in issue order."""
    lines = [
        f"# {head_name} against the Ideal schedule",
        "",
        "| point | head | Ideal | / Ideal | Ideal in issue order | / in order |",
        "|---|---|---|---|---|---|",
    ]
    ratios: list[float] = []
    for p, row in zip(points, head, strict=True):
        step, ideal, in_order = row["step_s"], row.get("ideal_s"), row.get("ideal_in_order_s")
        if step is None or ideal is None or in_order is None:
            lines.append(f"| {p.label()} | {step} | {ideal} | - | {in_order} | - |")
            continue
        ratios.append(step / ideal)
        lines.append(
            f"| {p.label()} | {step:.3f} s | {ideal:.3f} s | {step / ideal:.3f}x "
            f"| {in_order:.3f} s | {step / in_order:.3f}x |"
        )
    if ratios:
        within = sum(r <= 1.05 for r in ratios)
        lines += [
            "",
            f"{len(ratios)} points: {geomean(ratios):.3f}x the Ideal by geometric mean, "
            f"{within} within 1.05x, worst {max(ratios):.3f}x",
        ]
    return "\n".join(lines)


def unfragmented_report(points: list[Point], head: list[Row], head_name: str) -> str:
    """Each point's head step with its addresses taken out, against the Ideal and the step
    as it runs (tflms/planner/unfragmented.py)."""
    lines = [
        f"# {head_name} with its addresses taken out (unfragmented)",
        "",
        "| point | as it runs | unfragmented | / Ideal | / in order | addresses cost |",
        "|---|---|---|---|---|---|",
    ]
    ratios: list[float] = []
    in_order: list[float] = []
    cost: list[float] = []
    broken: list[str] = []
    for p, row in zip(points, head, strict=True):
        step, free = row["step_s"], row.get("unfragmented_s")
        ideal, order = row.get("ideal_s"), row.get("ideal_in_order_s")
        if row.get("unfragmented_over_device"):
            broken.append(f"{p.label()} (+{row['unfragmented_over_device']} bytes)")
        if free is None or ideal is None or order is None:
            lines.append(f"| {p.label()} | {step} | {free} | - | - | - |")
            continue
        ratios.append(free / ideal)
        in_order.append(free / order)
        runs = "out of memory" if step is None else f"{step:.3f} s"
        paid = "-" if step is None else f"{step / free - 1:+.1%}"
        if step is not None:
            cost.append(step / free)
        lines.append(
            f"| {p.label()} | {runs} | {free:.3f} s | {free / ideal:.3f}x "
            f"| {free / order:.3f}x | {paid} |"
        )

    if ratios:
        lines += [
            "",
            f"{len(ratios)} points unfragmented: {geomean(ratios):.3f}x the Ideal by geometric "
            f"mean, {sum(r <= 1.05 for r in ratios)} within 1.05x, worst {max(ratios):.3f}x; "
            f"{geomean(in_order):.3f}x the Ideal in issue order, "
            f"{sum(r <= 1.05 for r in in_order)} within 1.05x",
        ]
    if cost:
        lines.append(
            f"addresses cost the engine {geomean(cost) - 1:+.2%} by geometric mean "
            f"(slower unfragmented at {sum(c < 1 for c in cost)} of {len(cost)})"
        )
    if broken:
        lines.append(f"THE YARDSTICK IS BROKEN: its peak passed the device at {', '.join(broken)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="revision to compare against (default HEAD)")
    ap.add_argument(
        "--head", default=WORKTREE, help=f"revision to judge (default {WORKTREE}, as built)"
    )
    ap.add_argument("--results", default=str(REPO / "docs" / "results.json"))
    ap.add_argument(
        "--fractions",
        default=" ".join(str(f) for f in DEFAULT_FRACTIONS),
        help="batch multiples around each batch point (space-separated)",
    )
    ap.add_argument("--only", help="only points whose label contains this text")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per replay (as results)")
    ap.add_argument(
        "--ideal",
        action="store_true",
        help="also the head's step against the Ideal schedule at every point",
    )
    ap.add_argument(
        "--unfragmented",
        action="store_true",
        help="also the head with its addresses taken out, against the Ideal (implies --ideal)",
    )
    ap.add_argument("--json", dest="json_out", help="also write every point's times here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        fractions = tuple(float(f) for f in args.fractions.split())
    except ValueError as exc:
        raise SystemExit(
            f"--fractions takes numbers such as '0.98 1 1.02', not {args.fractions!r}"
        ) from exc
    if not fractions or any(f <= 0 for f in fractions):
        raise SystemExit("--fractions needs at least one positive multiple")
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.unfragmented:
        args.ideal = True
    points = results_points(json.loads(Path(args.results).read_text()), fractions, args.only)
    if not points:
        raise SystemExit(f"no prefetch point of {args.results} matches --only {args.only!r}")
    trees = [built_tree(args.base), built_tree(args.head)]

    from tqdm import tqdm

    bar = tqdm(total=2 * len(points), unit="replay", disable=args.no_progress)
    lock = threading.Lock()

    def tick() -> None:
        with lock:
            bar.update(1)

    results: list[list[Row]] = [[], []]
    errors: list[BaseException] = []

    def run(side: int) -> None:
        try:
            want_ideal = args.ideal and side == 1
            want_free = args.unfragmented and side == 1
            results[side] = replay_side(
                trees[side], points, args.steps, tick, want_ideal, want_free
            )
        except BaseException as exc:  # SystemExit too: a thread would swallow it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(side,)) for side in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    if errors:
        raise errors[0]
    base = [row["step_s"] for row in results[0]]
    head = [row["step_s"] for row in results[1]]
    c = compare(points, base, head)
    print(report(c, args.base, args.head))
    if args.ideal:
        print()
        print(ideal_report(points, results[1], args.head))
    if args.unfragmented:
        print()
        print(unfragmented_report(points, results[1], args.head))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "base": args.base,
                    "head": args.head,
                    "steps": args.steps,
                    "points": [
                        {
                            "label": p.label(),
                            "base_s": b["step_s"],
                            "head_s": h["step_s"],
                            **{k: v for k, v in h.items() if k != "step_s"},
                        }
                        for p, b, h in zip(points, results[0], results[1], strict=True)
                    ],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
