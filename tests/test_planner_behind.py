"""`tflms simulate --behind`: where in the step the engine falls behind the Ideal schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_planner import MIB, chain_trace, machine
from tflms.planner.behind import behind_ideal, behind_json, format_behind
from tflms.planner.replay import build_plan
from tflms.planner.simulate import machine_yardsticks, simulate_step
from tflms.trace.format import save_trace


def test_stretches_cut_the_step_by_ideal_time_and_their_changes_add_up_to_the_lag() -> None:
    # Six ops; the Ideal ends them at 1..6 s, the engine at 1, 2.5, 3.5, 4.5, 6, 7 s with
    # 0.5 s of page-in wait before op 1 and 1 s before op 4. Three stretches of 2 s: op 0
    # (ends at 1 s), ops 1-2 (2 and 3 s), ops 3-5 (4, 5 and 6 s, the last stretch
    # taking the step's end).
    parts = behind_ideal(
        [1.0, 2.5, 3.5, 4.5, 6.0, 7.0],
        [0.0, 0.5, 0.5, 0.5, 1.5, 1.5],
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        ["a", "b", "c", "d", "e", "f"],
        stretches=3,
    )
    assert [(p.first_op, p.last_op, p.last_name) for p in parts] == [
        (0, 0, "a"),
        (1, 2, "c"),
        (3, 5, "f"),
    ]
    assert [p.lag_change_s for p in parts] == pytest.approx([0.0, 0.5, 0.5])
    assert [p.stall_s for p in parts] == pytest.approx([0.0, 0.5, 1.0])
    assert sum(p.lag_change_s for p in parts) == pytest.approx(7.0 - 6.0)


def test_each_stretch_says_how_busy_each_link_was_on_either_side() -> None:
    # Cumulative busy seconds at each op's end: the engine's copies in run only during op 3,
    # the Ideal's during ops 1-2; copies out the other way round.
    parts = behind_ideal(
        [1.0, 2.5, 3.5, 4.5, 6.0, 7.0],
        [0.0] * 6,
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        list("abcdef"),
        stretches=3,
        engine_links=([0.5, 1.0, 1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.75, 0.75, 0.75]),
        ideal_links=([0.0, 0.0, 0.0, 0.5, 0.5, 0.5], [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]),
    )
    assert [p.h2d_busy_s for p in parts] == pytest.approx([0.0, 0.0, 0.75])
    assert [p.ideal_h2d_busy_s for p in parts] == pytest.approx([0.0, 2.0, 0.0])
    assert [p.d2h_busy_s for p in parts] == pytest.approx([0.5, 0.5, 0.0])
    assert [p.ideal_d2h_busy_s for p in parts] == pytest.approx([0.0, 0.0, 0.5])
    text = format_behind(behind_json(parts, "prefetch"))
    # The second stretch: the engine's 2.5 s of ops 1-2 with its copies in idle, the Ideal's
    # 2 s with them busy throughout; copies out 0.5 s of 2.5 s against none.
    assert "in busy" in text and "out busy" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("1-2"))
    assert "0% / 100%" in row and "20% / 0%" in row
    with pytest.raises(ValueError, match="6 ops, 6 and 5 Ideal link busy times"):
        behind_ideal(
            [1.0] * 6, [0.0] * 6, [1.0] * 6, list("abcdef"), ideal_links=([0.0] * 6, [0.0] * 5)
        )


def test_an_engine_ahead_of_the_ideal_shows_negative_changes() -> None:
    parts = behind_ideal([0.25, 1.5], [0.0, 0.0], [0.5, 2.0], ["a", "b"], stretches=2)
    assert [p.lag_change_s for p in parts] == pytest.approx([-0.25, -0.25])


def test_mismatched_lengths_are_refused_with_the_counts() -> None:
    with pytest.raises(ValueError, match="3 ops, 2 engine ends"):
        behind_ideal([1.0, 2.0], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0], ["a", "b", "c"])
    with pytest.raises(ValueError, match="stretches"):
        behind_ideal([1.0], [0.0], [1.0], ["a"], stretches=0)


def test_the_ideal_keeps_its_op_ends_out_of_the_json() -> None:
    m = machine(6 * MIB, link="pcie3")
    trace = chain_trace()
    plan = build_plan(trace, m.gpu)
    ideal = machine_yardsticks(plan, m, 2).ideal
    assert ideal.fits
    assert len(ideal.op_end_s) == len(plan.names)
    assert list(ideal.op_end_s) == sorted(ideal.op_end_s)  # one compute stream
    assert ideal.op_end_s[-1] <= ideal.step_time_s + 1e-12
    assert "op_end_s" not in ideal.to_json()
    # Each link's busy time up to each op's end: never decreasing, never more than the time
    # elapsed, and at most the copies' own time, bytes over the rate plus a latency each
    # (the step may end with copies after its last op; two latencies an op is a generous
    # allowance); the chain swaps under this memory, so both links work before the last op.
    rate = m.link_gbps * 1e9
    latency = m.config().link_latency_us * 1e-6 * 2 * len(plan.names)
    for busy, nbytes in (
        (ideal.d2h_busy_to_op_s, ideal.d2h_bytes),
        (ideal.h2d_busy_to_op_s, ideal.h2d_bytes),
    ):
        assert len(busy) == len(plan.names)
        assert list(busy) == sorted(busy)
        assert all(b <= t + 1e-12 for b, t in zip(busy, ideal.op_end_s, strict=True))
        assert 0 < busy[-1] <= nbytes / rate + latency
    assert "h2d_busy_to_op_s" not in ideal.to_json()


@pytest.mark.parametrize("prefetch", [False, True])
def test_simulate_says_where_the_replay_falls_behind_and_it_adds_up(prefetch: bool) -> None:
    # The chain under pressure on PCIe 3: the stretches cover every op once, add up to the
    # lag at the last op, and their page-in waits to the replay's (which waits for some).
    # Paging on demand there ends behind the Ideal; prefetch ends ahead of it (the Ideal
    # is achievable, not optimal).
    m = machine(4 * MIB, link="pcie3")
    trace = chain_trace()
    report, recorded = simulate_step(trace, m, prefetch=prefetch, compare=False, behind=True)
    assert recorded is not None and recorded.fits
    behind = report["behind_ideal"]
    assert behind["label"] == report["lms"][0]["label"]
    parts = behind["stretches"]
    ops = len(build_plan(trace, m.gpu).names)
    assert parts[0]["first_op"] == 0 and parts[-1]["last_op"] == ops - 1
    for a, b in zip(parts, parts[1:], strict=False):
        assert b["first_op"] == a["last_op"] + 1
    assert sum(p["lag_change_s"] for p in parts) == pytest.approx(behind["lag_s"])
    last = recorded.samples[-1].t
    assert behind["lag_s"] == pytest.approx(last - parts[-1]["ideal_end_s"])
    # The lag is the engine's: its op ends (the step itself adds the end-of-step drain).
    assert abs(behind["lag_s"]) <= report["lms"][0]["step_time_s"]
    assert sum(p["stall_s"] for p in parts) == pytest.approx(recorded.samples[-1].stall)
    # The links: each side's stretches add up to its busy time at the last op.
    ideal = machine_yardsticks(build_plan(trace, m.gpu), m, report["steps"]).ideal
    for key, engine_total, ideal_total in (
        ("d2h_busy_s", recorded.samples[-1].d2h_busy, ideal.d2h_busy_to_op_s[-1]),
        ("h2d_busy_s", recorded.samples[-1].h2d_busy, ideal.h2d_busy_to_op_s[-1]),
    ):
        assert sum(p[key] for p in parts) == pytest.approx(engine_total)
        assert sum(p["ideal_" + key] for p in parts) == pytest.approx(ideal_total)
        assert engine_total > 0 and ideal_total > 0
    assert recorded.samples[-1].stall > 0
    assert (behind["lag_s"] < 0) == prefetch
    text = format_behind(behind)
    assert "falls behind the ideal schedule" in text
    assert f"{behind['lag_s'] * 1e3:+.1f} ms" in text


def test_the_cli_flag_prints_the_table_and_puts_it_in_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tflms.cli import main

    path = save_trace(chain_trace(), tmp_path / "chain.json")
    argv = ["simulate", str(path), "--memory", "6MiB", "--no-progress", "--behind"]
    assert main([*argv, "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "falls behind the ideal schedule" in out and "page-in wait" in out
    assert main([*argv, "--no-compare", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["behind_ideal"]["stretches"]
    # Without memory pressure the step is the Ideal's: nothing to show but a zero lag.
    assert main(["simulate", str(path), "--no-progress", "--behind", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["behind_ideal"]["lag_s"] == pytest.approx(0.0, abs=1e-3)
