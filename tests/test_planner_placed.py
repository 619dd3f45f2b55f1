"""The in-order Ideal placed with addresses (tflms/planner/placed.py): on hand-made plans whose
layout is worked out by hand, on the chain trace, and through `tflms simulate --placed`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_planner import GPU, MIB, chain_trace
from tflms.planner.placed import format_placed, placed_ideal
from tflms.planner.replay import StepPlan, build_plan
from tflms.planner.yardsticks import ideal

KB = 1024
# Copy rates of 1 KiB per second: a KiB moved or copied costs a second.
KIB_PER_S = KB / 1e9


def fragmenting_plan(second_reader_later: bool) -> StepPlan:
    """A, B, C, D of 1 KiB fill a 4 KiB device in that order (best fit puts them at 0, 1, 2
    and 3 KiB); A and C die after op3, so 2 KiB are free in two 1 KiB holes when op4 makes E
    of 2 KiB. op4 reads D, and B too unless `second_reader_later` (then op5 reads B).

    Without addresses nothing ever leaves the device (at most 4 KiB live): the in-order Ideal
    is the kernels alone.
    """
    a, b, c, d, e = range(5)
    inputs: list[tuple[int, ...]] = [(), (), (), (a, c)]
    outputs = [((a, KB),), ((b, KB),), ((c, KB),), ((d, KB),), ((e, 2 * KB),)]
    frees: list[tuple[int, ...]] = [(), (), (), (a, c)]
    if second_reader_later:
        inputs += [(d,), (b,)]
        outputs.append(())
        frees += [(d, e), (b,)]
    else:
        inputs.append((b, d))
        frees.append((b, d, e))
    ops = len(inputs)
    return StepPlan(
        persistent=[],
        step_inputs=[],
        inputs=inputs,
        outputs=outputs,
        frees=frees,
        kernel_s=[0.5] * ops,
        names=[f"op{i}" for i in range(ops)],
        free_at_start=(),
        forwards=[()] * ops,
        sizes={a: KB, b: KB, c: KB, d: KB, e: 2 * KB},
        slice_pins=[()] * ops,
        slice_unpins=[()] * ops,
    )


def test_a_request_split_by_its_own_inputs_moves_one_of_them() -> None:
    plan = fragmenting_plan(second_reader_later=False)
    assert ideal(plan, 4 * KB, KIB_PER_S, in_order=True).step_time_s == pytest.approx(2.5)
    res = placed_ideal(plan, 4 * KB, KIB_PER_S, KIB_PER_S, slacks=(0.0,))
    assert res.in_order_s == pytest.approx(2.5)
    (run,) = res.runs
    # Every 2 KiB window holds B or D, both op4's inputs: B (1 KiB) moves into C's old hole,
    # 1 s before op4 starts. Per step: the measured (second) step starts with an empty
    # device again, as the first did.
    assert run.fits and run.failed_placements == 1 and run.needs_kernel_inputs == 1
    assert run.moved_bytes == KB and run.compactions == 0
    assert run.step_time_s == pytest.approx(3.5)
    assert res.best == run


def test_a_tensor_no_kernel_holds_is_moved_rather_than_an_input() -> None:
    plan = fragmenting_plan(second_reader_later=True)
    res = placed_ideal(plan, 4 * KB, KIB_PER_S, KIB_PER_S, slacks=(0.0,))
    (run,) = res.runs
    # [0, 2) holds B, which op4 does not read; [2, 4) holds D, which it does. B moves.
    assert run.failed_placements == 1 and run.needs_kernel_inputs == 0
    assert run.moved_bytes == KB
    assert run.step_time_s == pytest.approx(res.in_order_s + 1.0) == pytest.approx(4.0)


def test_a_plan_with_slack_that_cannot_hold_an_op_does_not_fit_and_the_rest_are_kept() -> None:
    plan = fragmenting_plan(second_reader_later=False)
    # op4 pins 4 KiB: with a quarter of the device kept free, no plan exists.
    res = placed_ideal(plan, 4 * KB, KIB_PER_S, KIB_PER_S, slacks=(0.0, 0.25))
    assert [r.fits for r in res.runs] == [True, False]
    assert res.best == res.runs[0]
    text = format_placed(res.to_json())
    assert "does not fit" in text and "1.400x" in text  # 3.5 s over the in-order Ideal's 2.5 s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device_copy_gbps": 0.0}, "device_copy_gbps must be positive"),
        ({"slacks": (1.0,)}, "[0, 1)"),
    ],
)
def test_bad_parameters_are_named(kwargs: dict, message: str) -> None:
    args = {"device_copy_gbps": KIB_PER_S, "slacks": (0.0,), **kwargs}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        placed_ideal(fragmenting_plan(False), 4 * KB, KIB_PER_S, **args)


@pytest.mark.parametrize("mem_mib", [5, 6, 8])
def test_placing_never_beats_the_in_order_ideal_it_places(mem_mib: int) -> None:
    plan = build_plan(chain_trace(), GPU)
    res = placed_ideal(plan, mem_mib * MIB, 12.0, GPU.device_copy_gbps, slacks=(0.0, 0.05))
    exact = ideal(plan, mem_mib * MIB, 12.0, in_order=True, steps=2)
    assert res.in_order_s == pytest.approx(exact.step_time_s)
    run = res.runs[0]
    assert run.fits
    # Moves only delay ops; with none the schedule is the in-order Ideal itself.
    assert run.step_time_s >= res.in_order_s - 1e-9
    if run.moved_bytes == 0:
        assert run.step_time_s == pytest.approx(res.in_order_s)
    assert run.needs_kernel_inputs <= run.failed_placements


def test_simulate_reports_the_placed_ideal_when_asked() -> None:
    from tests.test_planner import machine
    from tflms.planner.simulate import simulate_step

    m = machine(6 * MIB, link="pcie3")
    report, _ = simulate_step(chain_trace(), m, compare=False)
    assert "placed_ideal" not in report
    report, _ = simulate_step(chain_trace(), m, compare=False, placed=True)
    placed = report["placed_ideal"]
    assert placed["in_order_s"] == pytest.approx(report["lms"][0]["ideal_in_order_s"])
    assert placed["step_time_s"] == min(r["step_time_s"] for r in placed["runs"] if r["fits"])
    assert "In-order Ideal without addresses" in " ".join(format_placed(placed).split())


def test_the_cli_flag_prints_the_table_and_puts_it_in_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tflms.cli import main
    from tflms.trace.format import save_trace

    path = save_trace(chain_trace(), tmp_path / "chain.json")
    argv = ["simulate", str(path), "--memory", "6MiB", "--no-progress", "--no-compare", "--placed"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "The in-order Ideal placed with addresses" in out and "vs in order" in out
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["slack"] for r in report["placed_ideal"]["runs"]] == [0.0, 0.01, 0.02, 0.05]
    assert main([*argv[:-1], "--json"]) == 0
    assert "placed_ideal" not in json.loads(capsys.readouterr().out)


def test_a_plan_no_device_holds_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="some op pins more than the device"):
        placed_ideal(fragmenting_plan(False), 3 * KB, KIB_PER_S, KIB_PER_S)


def test_a_plan_without_ops_places_nothing() -> None:
    empty = StepPlan([], [], [], [], [], [], [], ())
    res = placed_ideal(empty, 4 * KB, KIB_PER_S, KIB_PER_S, slacks=(0.0, 0.05))
    assert res.in_order_s == 0.0
    assert [(r.fits, r.step_time_s, r.moved_bytes) for r in res.runs] == [(True, 0.0, 0)] * 2
    assert "-" in format_placed(res.to_json())
