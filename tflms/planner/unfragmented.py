"""The engine with its addresses taken out (`tflms simulate --unfragmented`).

The Ideal schedules (yardsticks.py) know bytes, not addresses; the engine knows both, and
its step against the Ideal mixes two costs: what its eviction and prefetch choose, and what
addresses add (a request whose bytes are free but in pieces pages out or moves something).
This replays the engine itself with the second taken out (EngineOptions::unfragmented: its
arena has four times the device's addresses, the LMS limit holds the device's bytes, every
chunk is cut to its request, and what only addresses call for is left out), so the step
splits in two: the unfragmented step against the Ideal is the schedule's share, the step as
it runs against the unfragmented one is the addresses' share.

A yardstick, not a mode the patch runs: a GPU has the addresses it has. The unfragmented
engine is not a bound either: its choices differ where they look at addresses (a prefetch
judged by the hole it leaves is judged by the bytes it leaves here), and at some points it
steps slower than the engine as it runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tflms.planner.gpu import GpuModel
from tflms.planner.replay import ReplayResult, StepPlan, replay
from tflms.planner.yardsticks import Yardsticks


@dataclasses.dataclass(frozen=True)
class Unfragmented:
    """One LMS mode replayed both ways, with the Ideal's steps for scale (None: no fit)."""

    label: str
    step_time_s: float | None
    engine_step_s: float | None
    d2h_bytes: int
    engine_d2h_bytes: int
    ideal_s: float | None
    ideal_in_order_s: float | None
    oom_message: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def unfragmented_run(
    plan: StepPlan,
    gpu: GpuModel,
    engine: ReplayResult,
    ys: Yardsticks,
    steps: int,
) -> Unfragmented:
    """Replays `engine`'s configuration unfragmented, over the same steps."""
    if engine.config.fixed_addresses:
        raise ValueError(
            "--unfragmented applies to the patch's mode: fixed addresses have no "
            "fragmentation to take out"
        )
    if not engine.config.lms:
        raise ValueError("--unfragmented needs LMS on")
    config = dataclasses.replace(engine.config, unfragmented=True)
    r = replay(plan, gpu, config, steps=steps, timed=True)
    return Unfragmented(
        label=engine.config.label(),
        step_time_s=r.step_time_s if r.fits else None,
        engine_step_s=engine.step_time_s if engine.fits else None,
        d2h_bytes=r.d2h_bytes if r.fits else 0,
        engine_d2h_bytes=engine.d2h_bytes if engine.fits else 0,
        ideal_s=ys.ideal.step_time_s if ys.ideal.fits else None,
        ideal_in_order_s=ys.ideal_in_order.step_time_s if ys.ideal_in_order.fits else None,
        oom_message=r.oom_message if not r.fits else "",
    )


def format_unfragmented(d: dict[str, Any]) -> str:
    """The report's "unfragmented" entry, in words."""
    head = f"Without fragmentation ({d['label']}, addresses taken out; a yardstick, not a mode):"
    step = d["step_time_s"]
    if step is None:
        return f"{head} does not fit: {d['oom_message']}"
    gib = 1 << 30
    parts = [f"{step:.3f} s, {d['d2h_bytes'] / gib:.2f} GiB out per step"]
    for key, what in (("ideal_s", "the ideal"), ("ideal_in_order_s", "the ideal in issue order")):
        if d[key]:
            parts.append(f"{step / d[key]:.3f}x {what}")
    lines = [f"{head} {'; '.join(parts)}."]
    engine = d["engine_step_s"]
    if engine is None:
        lines.append("As it runs, the engine does not fit: addresses cost it the fit.")
    else:
        lines.append(
            f"As it runs: {engine:.3f} s, {d['engine_d2h_bytes'] / gib:.2f} GiB out per step; "
            f"addresses cost the engine {engine / step - 1:+.1%} here."
        )
    return "\n".join(lines)
