"""How steady the step times of docs/results.md are, replayed over many steps.

docs/results.md once reported one step per row: on demand the second, with prefetch the
20th. That is honest only where every step takes the same time, and near the largest
batch or size a model fits they do not: the 3D U-Net at 464^3 on the A100-80 ran its
20th step with prefetch in 11.1 s while its steps 11-30 took 12.6 s on the mean, and
ResNet50 at 1409 on the DGX-1 with twice the host ran its 20th in 40.1 s, the fastest of
30, against a mean of 52.8 s and 42.6 s on demand. The tables now report a mean over a
window of steps (replay.first_measured_step); whether prefetch wins, and so whether it
may be on by default, is a question about that mean.

For every point of a saved docs/results.json (the rows at 2x, 4x, 6x the batch and the
largest batch or size on each machine, with the more-host variant where it was searched)
this replays both modes for longer than the tables do and reports the mean, the fastest
and the slowest step of the window, the table's figure beside it, and whether every step
fitted. The figures are the planner's, as the tables are: predictions for the modelled
machines, not measurements.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING, Any

from tflms.planner.replay import PREFETCH_MIN_STEPS, PREFETCH_SETTLE_STEPS, TIMED_STEPS
from tflms.planner.report import pct

if TYPE_CHECKING:
    from tflms.planner.replay import StepPlan
    from tflms.planner.simulate import Machine

# Steps replayed in each mode: on demand as many as a timed replay runs (the same window
# as the tables); with prefetch ten more than the tables, since its swings and the
# memory it runs out of show over tens of steps (ResNet152 at 1457 on the AC922 with
# twice the host fits 16 steps, not 30).
ON_DEMAND_STEPS = TIMED_STEPS
PREFETCH_STEPS = 30

# Prefetch counts as faster (or slower) only by more than this share of the on-demand
# mean: the step-to-step swing of a steady point is under it.
MARGIN = 0.01


@dataclasses.dataclass(frozen=True)
class Point:
    """One row of docs/results.md: a model at a batch (or 3D input size) on a machine."""

    model: str
    pairing: str
    n: int  # the batch, or the input size where size_model
    size_model: bool
    more_host: bool  # the largest batch searched with HOST_FACTOR times the host
    kind: str  # "overhead" (2x, 4x, 6x) or "largest"
    trace_batch: int  # the batch of the study's trace, rescaled to n
    table_on_demand_s: float | None = None  # the step docs/results.md reports
    table_prefetch_s: float | None = None

    def label(self) -> str:
        what = f"{self.n}^3" if self.size_model else str(self.n)
        host = ", twice the host" if self.more_host else ""
        return f"{self.model} {what} on {self.pairing}{host}"


@dataclasses.dataclass
class Series:
    """The host time of each step of one replay, and where the window starts."""

    steps: list[float]
    wanted: int  # steps asked for
    first: int  # 1-based first step of the window
    oom_op: str = ""

    @property
    def fits(self) -> bool:
        return len(self.steps) >= self.wanted

    @property
    def window(self) -> list[float]:
        return self.steps[self.first - 1 :]

    def spread(self) -> tuple[float, float] | None:
        """The fastest and slowest step of the window, bar its first and last.

        A step is timed on the host, which runs ahead of the GPU: the first step after the
        window's drain looks short and the last, which waits for the final drain, long (the
        3D U-Net at 272^3 on the DGX-1: 2.03 and 7.16 s around eighteen of 4.59 s). The
        mean, from drain to drain, is not affected; the spread leaves those two out.
        """
        w = self.window
        if not w:
            return None
        inner = w[1:-1] if len(w) > 2 else w
        return min(inner), max(inner)

    def mean(self) -> float | None:
        w = self.window
        return statistics.fmean(w) if w else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "steps": [round(s, 5) for s in self.steps],
            "wanted": self.wanted,
            "first": self.first,
            "fits": self.fits,
        }
        if self.oom_op:
            out["oom_op"] = self.oom_op
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Series:
        return cls(list(d["steps"]), int(d["wanted"]), int(d["first"]), d.get("oom_op", ""))


def points_of(results: dict[str, Any]) -> list[Point]:
    """The points of a saved docs/results.json, in the page's order."""
    return [p for study in results.get("studies", []) for p in _study_points(study)]


def _study_points(study: dict[str, Any]) -> list[Point]:
    pairing = study.get("machine", {}).get("pairing")
    if not pairing:
        return []  # a what-if machine: no point of its own
    size_model = "max_size" in study
    base: dict[str, Any] = {
        "model": study["model"],
        "pairing": pairing,
        "size_model": size_model,
        "trace_batch": int((study.get("trace") or {}).get("batch_size") or 1),
    }
    table: dict[int, dict[bool, float]] = {}
    for row in study.get("overhead", []):
        if row.get("fits"):
            n = int(row["input_size"] if size_model else row["batch_size"])
            table.setdefault(n, {})[bool(row["config"]["prefetch"])] = float(row["step_time_s"])
    points = [
        Point(
            n=n,
            more_host=False,
            kind="overhead",
            table_on_demand_s=by_mode.get(False),
            table_prefetch_s=by_mode.get(True),
            **base,
        )
        for n, by_mode in table.items()
    ]
    largest = study.get("max_size" if size_model else "max_batch") or {}
    for found, more_host in ((largest, False), (largest.get("more_host") or {}, True)):
        if found.get("with_lms"):
            points.append(
                Point(n=int(found["with_lms"]), more_host=more_host, kind="largest", **base)
            )
    return points


def point_plan(point: Point) -> tuple[StepPlan, Machine]:
    """The step plan of a point and the machine it runs on, as docs/results.md had them."""
    from tflms.planner.machines import get_pairing
    from tflms.planner.simulate import Machine, build_plan
    from tflms.planner.study import HOST_FACTOR, get_trace

    machine = Machine.from_pairing(get_pairing(point.pairing))
    if point.more_host:
        machine = machine.with_host(machine.host_side.scaled(HOST_FACTOR))
    if point.size_model:
        trace = get_trace(point.model, 1, point.n)
    else:
        trace = get_trace(point.model, point.trace_batch, None)
        if point.n != trace.batch_size:
            trace = trace.rescaled(point.n)
    return build_plan(trace, machine.gpu), machine


def replay_point(point: Point) -> dict[str, Series]:
    """Both modes of one point, each replayed from a fresh engine."""
    return replay_modes(*point_plan(point))


# The series of one point: each mode with the host running ahead into the next step (as
# the tables replay), and with the host waiting for the GPU at every step's end.
MODES = (
    ("on_demand", False, ON_DEMAND_STEPS, False),
    ("prefetch", True, PREFETCH_STEPS, False),
    ("on_demand_drained", False, ON_DEMAND_STEPS, True),
    ("prefetch_drained", True, PREFETCH_STEPS, True),
)


def replay_modes(plan: StepPlan, machine: Machine) -> dict[str, Series]:
    """Every mode of MODES over its step count, each from a fresh engine."""
    from tflms.planner.replay import first_measured_step, replay

    out: dict[str, Series] = {}
    for name, prefetch, steps, drained in MODES:
        config = machine.config(prefetch=prefetch)
        r = replay(plan, machine.gpu, config, steps=steps, timed=True, drained=drained)
        first = first_measured_step(config, steps, timed=True)
        out[name] = Series(list(r.host_step_s), steps, first, "" if r.fits else r.oom_op)
    return out


def measure(
    points: list[Point], jobs: int = 1, on_done: Callable[[Point], None] | None = None
) -> Iterator[tuple[Point, dict[str, Series]]]:
    """Replays every point, `jobs` at a time; yields them in the order given."""
    if jobs <= 1:
        for p in points:
            s = replay_point(p)
            if on_done is not None:
                on_done(p)
            yield p, s
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(replay_point, p) for p in points]
        for p, f in zip(points, futures, strict=True):
            s = f.result()
            if on_done is not None:
                on_done(p)
            yield p, s


def verdict(series: dict[str, Series], drained: bool = False) -> str:
    """Prefetch against on demand by the means; `drained`: the replays drained every step."""
    suffix = "_drained" if drained else ""
    od, pf = series["on_demand" + suffix], series["prefetch" + suffix]
    if not od.fits:
        return "on demand out of memory"
    if not pf.fits:
        return f"prefetch out of memory in step {len(pf.steps) + 1}"
    od_mean, pf_mean = od.mean(), pf.mean()
    assert od_mean is not None and pf_mean is not None
    ratio = pf_mean / od_mean
    if ratio < 1 - MARGIN:
        return "prefetch faster"
    if ratio > 1 + MARGIN:
        return "prefetch slower"
    return "as fast"


def to_json(measured: list[tuple[Point, dict[str, Series]]]) -> dict[str, Any]:
    return {
        "points": [
            {
                "point": dataclasses.asdict(p),
                **{name: s.to_json() for name, s in series.items()},
            }
            for p, series in measured
        ]
    }


def from_json(d: dict[str, Any]) -> list[tuple[Point, dict[str, Series]]]:
    return [
        (
            Point(**e["point"]),
            # Pages written before the drained modes have none of them.
            {name: Series.from_json(e[name]) for name, *_ in MODES if name in e},
        )
        for e in d["points"]
    ]


STEADINESS_MARKER = (
    "<!-- generated by `tflms steadiness`: edit tflms/planner/steadiness.py instead -->"
)


def _spread(s: Series) -> str:
    spread = s.spread()
    if spread is None:
        return "-"
    return f"{statistics.fmean(s.window):.3f} ({spread[0]:.3f}-{spread[1]:.3f})"


def _off(table: float | None, s: Series) -> str:
    m = s.mean()
    if table is None or m is None or not s.fits:
        return "-"
    return pct(table / m - 1)


def _has_drained(series: dict[str, Series]) -> bool:
    return "on_demand_drained" in series and "prefetch_drained" in series


def _counts(rows: list[dict[str, Series]], drained: bool) -> str:
    counts: dict[str, int] = {}
    for series in rows:
        v = verdict(series, drained).split(" in step")[0]
        counts[v] = counts.get(v, 0) + 1
    return ", ".join(f"{v}: {k}" for v, k in sorted(counts.items(), key=lambda x: -x[1]))


def _ratio(od: Series, pf: Series) -> str:
    od_m, pf_m = od.mean(), pf.mean()
    if not od_m or pf_m is None or not (od.fits and pf.fits):
        return "-"
    return f"{pf_m / od_m:.3f}"


def markdown(measured: list[tuple[Point, dict[str, Series]]]) -> str:
    settle = PREFETCH_SETTLE_STEPS
    lines = [
        STEADINESS_MARKER,
        "# How steady the planner's step times are",
        "",
        "docs/results.md reports the mean step of a window: on demand steps 2-"
        f"{TIMED_STEPS}, with prefetch steps {settle + 1}-{PREFETCH_MIN_STEPS} (its first steps "
        "learn the order and settle the plan). Here every point of it is replayed longer: on "
        f"demand {ON_DEMAND_STEPS} steps, measured from step 2 (the tables' own window); "
        f"prefetch {PREFETCH_STEPS} steps, measured from step {settle + 1}. Each cell gives the "
        "mean step of that window in seconds (from a drain of the GPU's queues to the next), "
        "with the fastest and the slowest of its steps but the first and the last, which "
        "the drains at its ends make look short and long where the host runs ahead of the "
        "GPU; *table* "
        "is how far the figure docs/results.md reports lies from that mean. *Verdict* compares "
        f"the means, with a margin of {MARGIN:.0%}. Like the tables, these are the planner's "
        "predictions for the modelled machines (the real engine on a modelled device), not "
        "measurements. Regenerate with `make steadiness` after `make results`.",
        "",
        "The tables' replays, like these first columns, let the host run ahead of the GPU "
        "into the next step (bounded by the launch queue), as a loop that never reads a "
        "result does. A Keras fit with a callback that has a batch-end hook (tflms's "
        "statistics callbacks have one) reads the loss after every step, and so does a "
        "loop that prints it: the host waits for the GPU at every step's end. *Drained "
        "every step* replays both modes that way, over the same windows.",
        "",
    ]
    drained_too = bool(measured) and all(_has_drained(s) for _, s in measured)
    for kind, title in (
        ("overhead", "at 2x, 4x and 6x the batch"),
        ("largest", "at the largest batch or size"),
    ):
        rows = [series for p, series in measured if p.kind == kind]
        if not rows:
            continue
        line = f"- Points {title}: {len(rows)}; {_counts(rows, False)}"
        if drained_too:
            line += f"; drained every step: {_counts(rows, True)}"
        lines.append(line + ".")
    lines.append("")
    for kind, title in (
        ("overhead", "Points at 2x, 4x and 6x the batch (the tables of docs/results.md)"),
        ("largest", "The largest batch or size with LMS (what the searches report)"),
    ):
        rows = [(p, s) for p, s in measured if p.kind == kind]
        if not rows:
            continue
        header = (
            "| point | on demand: mean (fastest-slowest) | table | prefetch: mean "
            "(fastest-slowest) | table | prefetch / on demand | verdict |"
        )
        rule = "|---|---|---|---|---|---|---|"
        if drained_too:
            header += " drained every step: on demand | prefetch | verdict |"
            rule += "---|---|---|"
        lines += [f"## {title}", "", header, rule]
        for p, series in rows:
            od, pf = series["on_demand"], series["prefetch"]
            line = (
                f"| {p.label()} | {_spread(od)} | {_off(p.table_on_demand_s, od)} | "
                f"{_spread(pf)} | {_off(p.table_prefetch_s, pf)} | {_ratio(od, pf)} | "
                f"{verdict(series)} |"
            )
            if drained_too:
                odd, pfd = series["on_demand_drained"], series["prefetch_drained"]
                line += f" {_spread(odd)} | {_spread(pfd)} | {verdict(series, drained=True)} |"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)
