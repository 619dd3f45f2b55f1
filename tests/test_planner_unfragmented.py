"""The engine with its addresses taken out (EngineOptions::unfragmented,
tflms/planner/unfragmented.py), replayed through the real engine on plans whose costs are
known: what addresses cost, and that the device's bytes still bound it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import tflms
from tests.test_planner import GPU, chain_trace
from tests.test_planner_placed import KB, fragmenting_plan
from tflms.planner.replay import EngineConfig, ReplayResult, StepPlan, replay
from tflms.planner.simulate import Machine, simulate_step
from tflms.planner.unfragmented import format_unfragmented, unfragmented_run
from tflms.planner.yardsticks import yardsticks

# A link this slow makes every byte paged out cost seconds, so a page-out shows in the step.
SLOW_LINK_GBPS = 1e-6


def run(plan: StepPlan, device: int, unfragmented: bool) -> ReplayResult:
    gpu = dataclasses.replace(GPU, memory_bytes=device)
    cfg = EngineConfig(
        device_memory=device,
        host_memory=1 << 20,
        link_gbps=SLOW_LINK_GBPS,
        prefetch=True,
        unfragmented=unfragmented,
    )
    return replay(plan, gpu, cfg, steps=2, timed=True)


def test_addresses_taken_out_page_nothing_where_only_holes_did() -> None:
    # 2 KiB free in two 1 KiB holes for E: as it runs, the engine pages B out (op5 reads it
    # again) and waits for it; unfragmented, E takes free addresses and the step is its
    # kernels alone.
    plan = fragmenting_plan(second_reader_later=True)
    kernels = sum(plan.kernel_s)
    as_is, free = run(plan, 4 * KB, False), run(plan, 4 * KB, True)
    assert as_is.fits and free.fits
    assert as_is.d2h_bytes == KB and as_is.step_time_s > kernels + 1
    assert free.d2h_bytes == 0 and free.step_time_s == pytest.approx(kernels)
    assert free.stats["peak_bytes_in_use"] <= 4 * KB


def test_the_device_still_bounds_the_bytes() -> None:
    # 3 KiB hold at most three of the four 1 KiB tensors: unfragmented or not, something
    # pages out, and the bytes in use never pass the device although the arena has four
    # times its addresses.
    plan = fragmenting_plan(second_reader_later=True)
    free = run(plan, 3 * KB, True)
    assert free.fits and free.d2h_bytes > 0
    assert free.stats["peak_bytes_in_use"] <= 3 * KB
    assert free.stats["bytes_limit"] == 3 * KB


def test_a_step_that_addresses_stop_fits_unfragmented_and_the_report_says_so() -> None:
    # E's room is split by its own inputs: as it runs the step is out of memory; without
    # fragmentation it is its kernels.
    plan = fragmenting_plan(second_reader_later=False)
    as_is = run(plan, 4 * KB, False)
    assert not as_is.fits
    ys = yardsticks(plan, 4 * KB, SLOW_LINK_GBPS, launch_s=0.0, latency_s=0.0)
    gpu = dataclasses.replace(GPU, memory_bytes=4 * KB)
    u = unfragmented_run(plan, gpu, as_is, ys, steps=2)
    assert u.engine_step_s is None
    assert u.step_time_s == pytest.approx(sum(plan.kernel_s))
    text = format_unfragmented(u.to_json())
    assert "does not fit: addresses cost it the fit" in text
    assert "1.000x the ideal" in text


def test_simulate_reports_both_steps_and_what_addresses_cost() -> None:
    machine = Machine(gpu=GPU, link_name="PCIe 3", link_gbps=12.0, host_memory=64 << 30)
    trace = chain_trace(layers=8, batch=4)
    report, _ = simulate_step(trace, machine, compare=False, prefetch=True, unfragmented=True)
    u = report["unfragmented"]
    assert u["label"] == report["lms"][0]["label"]
    assert u["engine_step_s"] == pytest.approx(report["lms"][0]["step_time_s"])
    assert u["step_time_s"] is not None and u["step_time_s"] > 0
    text = format_unfragmented(u)
    assert "addresses cost the engine" in text


def test_unfragmented_is_refused_where_it_means_nothing() -> None:
    with pytest.raises(ValueError, match="fixed_addresses"):
        tflms.Engine(1 << 20, unfragmented=True, fixed_addresses=True, page_size=64 << 10)
    with pytest.raises(ValueError, match="lms_enabled"):
        tflms.Engine(1 << 20, lms=False, unfragmented=True)
    plan = fragmenting_plan(second_reader_later=True)
    gpu = dataclasses.replace(GPU, memory_bytes=4 * KB)
    fixed = EngineConfig(
        device_memory=4 * KB, host_memory=1 << 20, link_gbps=1.0, fixed_addresses=True
    )
    ys = yardsticks(plan, 4 * KB, 1.0, launch_s=0.0, latency_s=0.0)
    with pytest.raises(ValueError, match="fixed addresses"):
        unfragmented_run(plan, gpu, ReplayResult(config=fixed, fits=True, steps=2), ys, 2)
    cmd = [sys.executable, "-m", "tflms", "simulate", "--model", "ResNet50"]
    r = subprocess.run(
        [*cmd, "--fixed-addresses", "--unfragmented"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0
    assert "--fixed-addresses has none to take out" in r.stderr
