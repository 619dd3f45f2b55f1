"""Which prefetch lookahead to set for one model on one machine (`tflms simulate --tune-lookahead`).

The lookahead (TensorFlow: `set_lms_prefetch_lookahead`, the engine's `prefetch_lookahead`)
is how many tensor uses ahead prefetch pages tensors in. Its default, 128, beats paging on
demand wherever prefetch runs at docs/results.md's points, but the fastest lookahead differs
by model and machine (docs/lookahead.md): at the 3D U-Net's 400^3 on the A100-40, whose
tensors are a fifth to two fifths of the GPU, 32 steps 11% faster than the default (7.84 s
against 8.83 s), and where tensors are small 256 is often 1-2% faster. Only replaying the
steps tells, so this replays them: paging on demand, and prefetch at each lookahead, each
from a fresh engine over the same windows as docs/steadiness.md (on demand steps 2-6,
prefetch steps 11-30), and recommends the fastest lookahead that beats paging on demand by
more than steadiness.MARGIN, or prefetch off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tflms.planner.replay import DEFAULT_LOOKAHEAD
from tflms.planner.report import pct

if TYPE_CHECKING:
    from tflms.planner.replay import StepPlan
    from tflms.planner.simulate import Machine
    from tflms.planner.steadiness import Series
    from tflms.trace.format import Trace

# Light at import (`tflms --help` reads LOOKAHEADS): the replay modules load when used.

LOOKAHEADS = (32, 64, 128, 256, 512)


@dataclasses.dataclass
class Run:
    """One mode's replay: lookahead None is paging on demand."""

    lookahead: int | None
    series: Series

    def to_json(self) -> dict[str, Any]:
        return {"lookahead": self.lookahead, "mean_s": self.series.mean(), **self.series.to_json()}


@dataclasses.dataclass
class Tuning:
    runs: list[Run]  # on demand first, then each lookahead in the order asked
    recommended: int | None  # None: keep prefetch off

    @property
    def on_demand(self) -> Run:
        return self.runs[0]

    def to_json(self) -> dict[str, Any]:
        from tflms.planner.steadiness import MARGIN

        return {
            "runs": [r.to_json() for r in self.runs],
            "recommended_lookahead": self.recommended,
            "margin": MARGIN,
        }


def parse_lookaheads(text: str) -> list[int]:
    """'64,128,256' -> [64, 128, 256]; a clear error for anything else."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"--lookaheads takes comma-separated whole numbers (e.g. 64,128,256), not {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--lookaheads needs one or more lookaheads of at least 1, not {text!r}")
    return sorted(set(values))


def replay_lookahead(plan: StepPlan, machine: Machine, lookahead: int | None) -> Series:
    """One mode from a fresh engine: paging on demand (None) or prefetch at `lookahead`."""
    from tflms.planner.replay import first_measured_step, replay
    from tflms.planner.steadiness import ON_DEMAND_STEPS, PREFETCH_STEPS, Series

    prefetch = lookahead is not None
    config = machine.config(prefetch=prefetch)
    if lookahead is not None:
        config = dataclasses.replace(config, prefetch_lookahead=lookahead)
    steps = PREFETCH_STEPS if prefetch else ON_DEMAND_STEPS
    r = replay(plan, machine.gpu, config, steps=steps, timed=True)
    first = first_measured_step(config, steps, timed=True)
    return Series(list(r.host_step_s), steps, first, r.oom_op)


def tune_lookahead(
    trace: Trace,
    machine: Machine,
    lookaheads: Sequence[int] = LOOKAHEADS,
    progress: bool = False,
) -> Tuning:
    """Replays paging on demand and prefetch at each lookahead; recommends one or none."""
    from tflms.planner.simulate import build_plan, progress_bar
    from tflms.planner.steadiness import ON_DEMAND_STEPS, PREFETCH_STEPS

    plan = build_plan(trace, machine.gpu)
    total = (ON_DEMAND_STEPS + PREFETCH_STEPS * len(lookaheads)) * len(plan.inputs)
    bar = progress_bar(f"lookahead {trace.model} batch {trace.batch_size}", total, progress)
    runs: list[Run] = []
    try:
        for lookahead in [None, *lookaheads]:
            runs.append(Run(lookahead, replay_lookahead(plan, machine, lookahead)))
            steps = ON_DEMAND_STEPS if lookahead is None else PREFETCH_STEPS
            bar.update(steps * len(plan.inputs))
    finally:
        bar.close()
    return Tuning(runs, recommend(runs))


def rank(lookahead: int, mean: float) -> tuple[float, bool, int]:
    """Orders lookaheads by their mean step; ties go to the default, then to the shorter one
    (less held ahead of use)."""
    return (round(mean, 6), lookahead != DEFAULT_LOOKAHEAD, lookahead)


def beats_on_demand(mean: float, on_demand: float | None) -> bool:
    """Faster than paging on demand by more than steadiness.MARGIN; any step time beats an
    on-demand replay that ran out of memory (None)."""
    from tflms.planner.steadiness import MARGIN

    return on_demand is None or mean < on_demand * (1 - MARGIN)


def recommend(runs: Sequence[Run]) -> int | None:
    """The best-ranked lookahead that beats paging on demand (runs[0]), else None."""
    od = runs[0].series
    od_mean = od.mean() if od.fits else None
    winners = {}
    for r in runs[1:]:
        assert r.lookahead is not None
        m = r.series.mean() if r.series.fits else None
        if m is not None and beats_on_demand(m, od_mean):
            winners[r.lookahead] = m
    return min(winners, key=lambda la: rank(la, winners[la]), default=None)


def format_tuning(t: Tuning) -> str:
    from tflms.planner.steadiness import MARGIN, ON_DEMAND_STEPS, PREFETCH_STEPS

    od = t.on_demand.series
    od_mean = od.mean() if od.fits else None
    pf_first = t.runs[1].series.first if len(t.runs) > 1 else PREFETCH_STEPS
    lines = [
        f"Prefetch lookahead: the mean step of steps {pf_first}-{PREFETCH_STEPS} with prefetch "
        f"and of steps {od.first}-{ON_DEMAND_STEPS} paging on demand, each mode from a fresh "
        "engine",
        "",
        "| mode | mean step | vs on demand | steps (fastest-slowest) |",
        "|---|---|---|---|",
    ]
    for r in t.runs:
        s = r.series
        if r.lookahead is None:
            name = "on demand"
        else:
            name = f"prefetch, lookahead {r.lookahead}"
            if r.lookahead == DEFAULT_LOOKAHEAD:
                name += " (default)"
        if not s.fits:
            lines.append(
                f"| {name} | out of memory in step {len(s.steps) + 1} ({s.oom_op or '?'}) | - | - |"
            )
            continue
        m = s.mean()
        assert m is not None
        vs = "-" if r.lookahead is None or od_mean is None else pct(m / od_mean - 1)
        fastest, slowest = s.spread() or (m, m)
        lines.append(f"| {name} | {m:.3f} s | {vs} | {fastest:.3f}-{slowest:.3f} s |")
    lines.append("")
    if t.recommended is None:
        lines.append(
            "Recommendation: prefetch off (no lookahead tried beats paging on demand by "
            f"more than {100 * MARGIN:.0f}%): "
            "tf.config.experimental.set_lms_prefetch_enabled(False)."
        )
    else:
        run = next(r for r in t.runs if r.lookahead == t.recommended)
        m = run.series.mean()
        assert m is not None
        gain = (
            f", {100 * (1 - m / od_mean):.1f}% faster than paging on demand"
            if od_mean is not None
            else " (paging on demand runs out of memory)"
        )
        setting = (
            "the default"
            if t.recommended == DEFAULT_LOOKAHEAD
            else f"tf.config.experimental.set_lms_prefetch_lookahead({t.recommended})"
        )
        lines.append(
            f"Recommendation: prefetch on, lookahead {t.recommended} ({setting}): {m:.3f} s"
            f"{gain}. Prefetch is LMS's default; "
            "tf.config.experimental.set_lms_prefetch_enabled(True) keeps it on whatever the "
            "default."
        )
    return "\n".join(lines)
