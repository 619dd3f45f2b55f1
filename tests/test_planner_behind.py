"""`tflms simulate --behind`: where in the step the engine falls behind the Ideal schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_planner import MIB, chain_trace, machine
from tflms.planner.behind import behind_ideal, format_behind
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
