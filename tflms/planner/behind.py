"""Where a replayed step falls behind the Ideal schedule (`tflms simulate --behind`).

The step-time ratio to the Ideal says how far the engine is from it, not where. Both the
replay (its recorded samples: the compute stream's clock after each op) and the Ideal
(yardsticks.IdealResult.op_end_s) know when each op of the measured step ends, counted from
the step's start; the engine's lag behind the Ideal at an op is the difference. Op by op the
lag swings both ways by whole copies (the two wait for their copies out at different ops),
so the step is cut into stretches of equal Ideal time and each stretch says how much the lag
grew over it and how much of that the engine's compute stream spent waiting for page-ins;
the rest is ops starting late for another reason (the host had not launched them yet,
blocked on a copy out, a settle or the run-ahead throttle), less what the Ideal waited
there itself. The stretches' changes add up to the lag at the last op.

Where both sides say how busy each host link was up to each op's end (the replay's samples,
the Ideal's busy_to_op arrays, both on the GPU's clock), each stretch also says what share of
its own time each link was busy on either side: a stretch where the engine falls behind with
its host-to-device link idle while the Ideal's is busy is one where copies in started late.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any

from tflms.planner.report import table

# Stretches of the Ideal's step (each a twentieth of its time).
DEFAULT_STRETCHES = 20


@dataclasses.dataclass(frozen=True)
class Stretch:
    """The ops whose Ideal end falls in one stretch of the Ideal's step."""

    first_op: int
    last_op: int
    last_name: str
    ideal_end_s: float  # of its last op
    engine_end_s: float
    lag_change_s: float  # how much the engine's lag behind the Ideal grew over it
    stall_s: float  # the engine's compute stream waiting for page-ins in it
    # Seconds each link was busy during the stretch, on each side's own clock (0 where the
    # busy times were not given).
    d2h_busy_s: float = 0.0
    h2d_busy_s: float = 0.0
    ideal_d2h_busy_s: float = 0.0
    ideal_h2d_busy_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def behind_ideal(
    engine_end_s: Sequence[float],
    engine_stall_s: Sequence[float],
    ideal_end_s: Sequence[float],
    names: Sequence[str],
    stretches: int = DEFAULT_STRETCHES,
    engine_links: tuple[Sequence[float], Sequence[float]] | None = None,
    ideal_links: tuple[Sequence[float], Sequence[float]] | None = None,
) -> list[Stretch]:
    """The engine's lag behind the Ideal, stretch by stretch of the Ideal's step.

    `engine_end_s` and `engine_stall_s` are per op of the measured step (the replay's
    samples: op end and the compute stream's cumulative wait for page-ins), `ideal_end_s`
    the Ideal's op ends, all from the step's start. `engine_links` and `ideal_links`, where
    given, are (device-to-host, host-to-device) seconds busy from the step's start to each
    op's end. Stretches holding no op are left out.
    """
    n = len(names)
    if not (len(engine_end_s) == len(engine_stall_s) == len(ideal_end_s) == n):
        raise ValueError(
            f"one value per op is needed: {n} ops, {len(engine_end_s)} engine ends, "
            f"{len(engine_stall_s)} stalls, {len(ideal_end_s)} Ideal ends"
        )
    zeros = [0.0] * n
    links = []
    for side, given in (("engine", engine_links), ("Ideal", ideal_links)):
        d2h, h2d = given if given is not None else (zeros, zeros)
        if len(d2h) != n or len(h2d) != n:
            raise ValueError(
                f"one value per op is needed: {n} ops, {len(d2h)} and {len(h2d)} {side} "
                "link busy times"
            )
        links.append((d2h, h2d))
    (e_out, e_in), (i_out, i_in) = links
    if stretches < 1:
        raise ValueError("stretches must be at least 1")
    if n == 0:
        return []
    step = ideal_end_s[-1]
    out: list[Stretch] = []
    lag = stall = 0.0
    before = (0.0, 0.0, 0.0, 0.0)  # links busy up to the stretch: engine out, in; Ideal's
    first = 0
    which = [_stretch_of(t, step, stretches) for t in ideal_end_s]
    for i in range(n):
        # Op i closes its stretch where the next op's Ideal end falls in a later one.
        if i + 1 < n and which[i + 1] == which[i]:
            continue
        now = engine_end_s[i] - ideal_end_s[i]
        busy = (e_out[i], e_in[i], i_out[i], i_in[i])
        out.append(
            Stretch(
                first_op=first,
                last_op=i,
                last_name=names[i],
                ideal_end_s=ideal_end_s[i],
                engine_end_s=engine_end_s[i],
                lag_change_s=now - lag,
                stall_s=engine_stall_s[i] - stall,
                d2h_busy_s=busy[0] - before[0],
                h2d_busy_s=busy[1] - before[1],
                ideal_d2h_busy_s=busy[2] - before[2],
                ideal_h2d_busy_s=busy[3] - before[3],
            )
        )
        lag, stall, first, before = now, engine_stall_s[i], i + 1, busy
    return out


def _stretch_of(t: float, step: float, stretches: int) -> int:
    if step <= 0:
        return 0
    return min(stretches - 1, int(t / step * stretches))


def behind_json(parts: Sequence[Stretch], label: str) -> dict[str, Any]:
    return {
        "label": label,
        "stretches": [p.to_json() for p in parts],
        "lag_s": parts[-1].engine_end_s - parts[-1].ideal_end_s if parts else 0.0,
    }


def format_behind(behind: dict[str, Any]) -> str:
    """The stretches as a table (from the JSON form `tflms simulate --json` prints)."""
    head = (
        f"Where {behind['label']} falls behind the ideal schedule (the step in stretches of "
        f"equal ideal time; its lag at the last op {behind['lag_s'] * 1e3:+.1f} ms):"
    )
    parts = behind["stretches"]
    with_links = any(
        p.get(k)
        for p in parts
        for k in ("d2h_busy_s", "h2d_busy_s", "ideal_d2h_busy_s", "ideal_h2d_busy_s")
    )
    rows = []
    engine_from = ideal_from = 0.0
    for p in parts:
        row = [
            f"{p['first_op']}-{p['last_op']}",
            p["last_name"][:56],
            f"{p['ideal_end_s']:.3f} s",
            f"{p['engine_end_s']:.3f} s",
            f"{p['lag_change_s'] * 1e3:+.1f} ms",
            f"{p['stall_s'] * 1e3:.1f} ms",
        ]
        if with_links:
            engine_span = p["engine_end_s"] - engine_from
            ideal_span = p["ideal_end_s"] - ideal_from
            for key in ("h2d_busy_s", "d2h_busy_s"):
                row.append(
                    f"{_share(p[key], engine_span)} / {_share(p['ideal_' + key], ideal_span)}"
                )
        engine_from, ideal_from = p["engine_end_s"], p["ideal_end_s"]
        rows.append(row)
    header = ["ops", "last op", "ideal ends", "engine ends", "lag change", "page-in wait"]
    notes = [
        "  page-in wait: the engine's compute stream waiting for copies in; the rest of the",
        "  change is ops starting late for another reason (the host had not launched them",
        "  yet), less what the ideal schedule waited there itself.",
    ]
    if with_links:
        header += ["in busy", "out busy"]
        notes += [
            "  in busy, out busy: the share of the stretch's time the host-to-device and the",
            "  device-to-host link were busy, engine / ideal schedule, each on its own clock.",
        ]
    return "\n".join([head, textwrap.indent(table(header, rows), "  "), *notes])


def _share(busy: float, span: float) -> str:
    if span <= 0:
        return "-"
    return f"{min(1.0, max(0.0, busy / span)):.0%}"
