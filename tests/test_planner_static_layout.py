"""A layout planned ahead for the in-order Ideal (tflms/planner/static_layout.py): offsets worked
out by hand, a property check on random intervals, and through `placed_ideal`."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_planner import GPU, MIB, chain_trace
from tests.test_planner_placed import KB, KIB_PER_S, fragmenting_plan
from tflms.planner.placed import format_placed, placed_ideal
from tflms.planner.replay import build_plan
from tflms.planner.static_layout import Intervals, _best_gap, assign_offsets, layout_peak


def intervals(*spans: tuple[int, int, int]) -> Intervals:
    start, end, nbytes = zip(*spans, strict=True)
    return Intervals(np.array(start), np.array(end), np.array(nbytes))


def test_largest_first_each_in_the_smallest_gap_that_holds_it() -> None:
    iv = intervals(
        (0, 10, 4),  # the largest: at 0
        (0, 2, 1),  # overlaps it: above it, at 4
        (3, 10, 2),  # overlaps the largest only: at 4 too, its stay after the small one's
        (2, 5, 1),  # overlaps the largest and the 2: at 6 ([4, 6) taken)
        (11, 12, 3),  # overlaps nothing: at 0
    )
    assert assign_offsets(iv).tolist() == [0, 4, 4, 6, 0]
    assert iv.live_peak() == 7 and layout_peak(iv, assign_offsets(iv)) == 7


def test_the_smallest_gap_that_holds_it_wins_over_the_first() -> None:
    # Taken: [0, 2), [5, 8), [9, 12); free: [2, 5) (3 bytes), [8, 9) (1 byte), 12 and up.
    lo, hi = np.array([9, 0, 5]), np.array([12, 2, 8])
    assert _best_gap(lo, hi, 1) == 8
    assert _best_gap(lo, hi, 3) == 2
    assert _best_gap(lo, hi, 4) == 12
    # A range inside another leaves no gap below its end.
    assert _best_gap(np.array([0, 1]), np.array([6, 2]), 2) == 6
    assert _best_gap(np.array([], dtype=int), np.array([], dtype=int), 5) == 0


def test_no_two_stays_at_once_share_an_address_and_none_beats_the_live_peak() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = int(rng.integers(1, 60))
        start = rng.integers(0, 100, n)
        end = start + rng.integers(1, 40, n)
        iv = Intervals(start, end, rng.integers(1, 1000, n))
        off = assign_offsets(iv)
        assert (off >= 0).all()
        for i in range(n):
            for j in range(i + 1, n):
                at_once = iv.start[i] < iv.end[j] and iv.start[j] < iv.end[i]
                apart = off[i] + iv.nbytes[i] <= off[j] or off[j] + iv.nbytes[j] <= off[i]
                assert not at_once or apart, (i, j)
        assert layout_peak(iv, off) >= iv.live_peak()


def test_a_layout_known_ahead_needs_no_move_where_best_fit_one_at_a_time_does() -> None:
    # Best fit one request at a time leaves op4's 2 KiB output two 1 KiB holes and moves one
    # tensor (test_planner_placed); knowing E is coming, the layout keeps room for it.
    res = placed_ideal(fragmenting_plan(False), 4 * KB, KIB_PER_S, KIB_PER_S, slacks=(0.0,))
    (run,) = res.runs
    assert run.failed_placements == 1 and run.moved_bytes == KB
    assert run.live_peak == run.layout_peak == 4 * KB and run.layout_fits
    assert run.unmoved_step_s == pytest.approx(res.in_order_s) == pytest.approx(2.5)
    report = res.to_json()
    assert report["laid_out_step_s"] == pytest.approx(2.5) and report["laid_out_slack"] == 0.0
    text = " ".join(format_placed(report).split())
    assert "fits the device at 0% slack and steps in 2.500 s" in text
    assert "1.000x" in text  # the layout's peak over the device


@pytest.mark.parametrize("mem_mib", [5, 6, 8])
def test_a_paging_schedule_laid_out_ahead_is_measured_not_assumed(mem_mib: int) -> None:
    plan = build_plan(chain_trace(), GPU)
    res = placed_ideal(plan, mem_mib * MIB, 12.0, GPU.device_copy_gbps, slacks=(0.0, 0.05))
    for run in res.runs:
        assert run.live_peak <= mem_mib * MIB * (1 - run.slack) + 1
        assert run.layout_peak >= run.live_peak
        assert run.layout_fits == (run.layout_peak <= mem_mib * MIB)
    laid_out = res.best_laid_out
    if laid_out is None:
        assert "at no slack tried" in format_placed(res.to_json())
    else:
        assert laid_out.unmoved_step_s >= res.in_order_s - 1e-9
