"""`tflms steadiness`: every point of docs/results.md replayed for more steps, on the real engine.

The replays use the synthetic chain of test_planner (a deep forward pass whose activations the
backward pass reads again); the points come from small results documents written here, and from
the saved docs/results.json, whose page docs/steadiness.md must match its own JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.test_planner import GPU, chain_trace, machine, run_cli
from tflms.planner import steadiness
from tflms.planner.replay import (
    PREFETCH_SETTLE_STEPS,
    TIMED_STEPS,
    StepPlan,
    build_plan,
    first_measured_step,
    peak_live_bytes,
    replay,
)
from tflms.planner.simulate import Machine
from tflms.planner.steadiness import Point, Series

ROOT = Path(__file__).resolve().parents[1]


def _chain() -> tuple[StepPlan, Machine]:
    """The synthetic chain on a device a third of its peak: every step pages."""
    plan = build_plan(chain_trace(layers=12, batch=8), GPU)
    return plan, machine(peak_live_bytes(plan) // 3)


def test_a_replay_times_every_step_and_its_last_is_the_measured_step() -> None:
    plan, m = _chain()
    for prefetch, steps in ((False, 5), (True, 21)):
        r = replay(plan, GPU, m.config(prefetch=prefetch), steps=steps)
        assert r.fits, r.oom_message
        assert len(r.host_step_s) == steps
        assert all(t > 0 for t in r.host_step_s)
        assert r.host_step_s[-1] == pytest.approx(r.step_time_s, rel=1e-12)


def test_a_timed_replay_reports_the_mean_of_its_window() -> None:
    plan, m = _chain()
    for prefetch in (False, True):
        cfg = m.config(prefetch=prefetch)
        r = replay(plan, GPU, cfg, steps=2, timed=True)
        assert r.fits, r.oom_message
        assert r.steps == len(r.host_step_s) >= TIMED_STEPS
        first = first_measured_step(cfg, r.steps, timed=True)
        assert first == (PREFETCH_SETTLE_STEPS + 1 if prefetch else 2)
        assert r.measured_steps == r.steps - first + 1
        window = r.host_step_s[first - 1 :]
        assert r.step_time_s == pytest.approx(sum(window) / len(window), rel=1e-9)
        # Bytes are per measured step too: the window's total over its steps.
        assert r.d2h_bytes > 0 and r.d2h_bytes * r.measured_steps <= r.stats["bytes_reclaimed"]
    # A search probe measures its last step, as before the window.
    r = replay(plan, GPU, m.config(), steps=2)
    assert (r.steps, r.measured_steps) == (2, 1)
    assert r.step_time_s == pytest.approx(r.host_step_s[-1], rel=1e-12)


def test_a_drained_replay_waits_for_the_gpu_at_the_end_of_every_step() -> None:
    plan, m = _chain()
    for prefetch in (False, True):
        cfg = m.config(prefetch=prefetch)
        ahead = replay(plan, GPU, cfg, steps=2, timed=True)
        drained = replay(plan, GPU, cfg, steps=2, timed=True, drained=True)
        assert ahead.fits and drained.fits, drained.oom_message
        assert len(drained.host_step_s) == drained.steps == ahead.steps
        # From one drain to the next a step takes at least its kernels' time; running
        # ahead, the step after the window's drain is timed while the GPU still has the
        # kernels the host launched ahead of it.
        assert min(drained.host_step_s) >= plan.compute_s * (1 - 1e-9)
        assert drained.host_step_s != pytest.approx(ahead.host_step_s, rel=1e-6)
    # On demand, waiting at every step's end can only add time: nothing of one step's
    # copies overlaps the next step's kernels.
    cfg = m.config()
    ahead = replay(plan, GPU, cfg, steps=2, timed=True)
    drained = replay(plan, GPU, cfg, steps=2, timed=True, drained=True)
    assert drained.step_time_s >= ahead.step_time_s * (1 - 1e-9)


def test_a_replay_that_runs_out_of_memory_times_only_the_steps_it_finished() -> None:
    plan = build_plan(chain_trace(layers=12, batch=8), GPU)
    # Less device memory than one backward op's inputs and outputs: LMS cannot run it.
    r = replay(plan, GPU, machine(4 * 2**20).config(), steps=4)
    assert not r.fits
    assert len(r.host_step_s) < 4


def test_both_modes_are_replayed_over_their_windows_on_the_real_engine() -> None:
    plan, m = _chain()
    series = steadiness.replay_modes(plan, m)
    assert list(series) == [name for name, *_ in steadiness.MODES]
    od, pf = series["on_demand"], series["prefetch"]
    assert all(s.fits for s in series.values())
    assert len(od.steps) == len(series["on_demand_drained"].steps) == steadiness.ON_DEMAND_STEPS
    assert len(pf.steps) == len(series["prefetch_drained"].steps) == steadiness.PREFETCH_STEPS
    # Drained, no step is shorter than its kernels: the host waited for the GPU.
    assert min(series["prefetch_drained"].steps) >= plan.compute_s * (1 - 1e-9)
    assert len(pf.window) == steadiness.PREFETCH_STEPS - PREFETCH_SETTLE_STEPS
    # The same replay from a fresh engine takes the same steps: the series is the engine's.
    again = replay(plan, GPU, m.config(prefetch=False), steps=2, timed=True)
    assert od.steps == pytest.approx(again.host_step_s, rel=1e-12)
    assert od.mean() == pytest.approx(again.step_time_s, rel=1e-9)
    mean = pf.mean()
    assert mean is not None and min(pf.window) <= mean <= max(pf.window)

    tiny = steadiness.replay_modes(plan, machine(4 * 2**20))
    assert not tiny["on_demand"].fits and tiny["on_demand"].oom_op
    assert steadiness.verdict(tiny) == "on demand out of memory"


def _series(steps: list[float], wanted: int, first: int = 1) -> Series:
    return Series(steps, wanted, first)


def test_the_verdict_compares_the_means_of_the_windows_not_one_step() -> None:
    od = _series([9.0, 10.0, 10.0], 3, first=2)
    # The last prefetch step is the fastest of all, but the window's mean is slower.
    pf = _series([20.0, 12.0, 11.0, 9.0], 4, first=2)
    assert pf.mean() == pytest.approx(32.0 / 3)
    assert steadiness.verdict({"on_demand": od, "prefetch": pf}) == "prefetch slower"
    pf = _series([20.0, 9.5, 9.6, 9.7], 4, first=2)
    assert steadiness.verdict({"on_demand": od, "prefetch": pf}) == "prefetch faster"
    pf = _series([20.0, 10.05, 9.95, 10.0], 4, first=2)
    assert steadiness.verdict({"on_demand": od, "prefetch": pf}) == "as fast"
    pf = _series([20.0, 9.0], 4, first=2)
    assert not pf.fits
    assert steadiness.verdict({"on_demand": od, "prefetch": pf}) == (
        "prefetch out of memory in step 3"
    )
    # The drained verdict reads the drained series only.
    both = {
        "on_demand": od,
        "prefetch": _series([20.0, 9.0, 9.0], 3, first=2),
        "on_demand_drained": od,
        "prefetch_drained": pf,
    }
    assert steadiness.verdict(both) == "prefetch faster"
    assert steadiness.verdict(both, drained=True) == "prefetch out of memory in step 3"


def _study(model: str, pairing: str, size: bool, rows: list[tuple[int, bool, float]]) -> Any:
    key = "input_size" if size else "batch_size"
    return {
        "model": model,
        "machine": {"pairing": pairing},
        **({} if size else {"trace": {"batch_size": 32}}),
        "overhead": [
            {key: n, "fits": True, "config": {"prefetch": pf}, "step_time_s": t}
            for n, pf, t in rows
        ],
        ("max_size" if size else "max_batch"): {
            "with_lms": 1500 if not size else 480,
            "more_host": {"with_lms": 2000} if not size else None,
        },
    }


def test_points_are_every_row_pair_and_every_largest_batch_of_the_saved_results() -> None:
    results = {
        "studies": [
            _study("ResNet50", "dgx1-v100", False, [(400, False, 3.5), (400, True, 3.25)]),
            _study("UNet3D", "gh200", True, [(480, False, 1.875), (480, True, 1.5)]),
            {"model": "ResNet50", "machine": {"name": "what-if"}, "overhead": []},
        ]
    }
    points = steadiness.points_of(results)
    assert [(p.label(), p.kind) for p in points] == [
        ("ResNet50 400 on dgx1-v100", "overhead"),
        ("ResNet50 1500 on dgx1-v100", "largest"),
        ("ResNet50 2000 on dgx1-v100, twice the host", "largest"),
        ("UNet3D 480^3 on gh200", "overhead"),
        ("UNet3D 480^3 on gh200", "largest"),
    ]
    assert (points[0].table_on_demand_s, points[0].table_prefetch_s) == (3.5, 3.25)
    assert points[0].trace_batch == 32 and points[3].trace_batch == 1
    assert points[2].more_host and not points[1].more_host


def test_the_saved_page_is_rendered_from_its_own_json_and_covers_every_point() -> None:
    saved = json.loads((ROOT / "docs/steadiness.json").read_text())
    measured = steadiness.from_json(saved)
    page = (ROOT / "docs/steadiness.md").read_text()
    assert page == steadiness.markdown(measured)
    results = json.loads((ROOT / "docs/results.json").read_text())
    assert [p for p, _ in measured] == steadiness.points_of(results)
    for p, _ in measured:
        assert f"| {p.label()} |" in page


def test_the_command_rewrites_from_json_and_refuses_what_it_must_not_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "steadiness.md"
    out.write_text("my notes\n")
    assert run_cli("steadiness", "--output", str(out)) == 2
    assert "--force" in capsys.readouterr().err
    assert out.read_text() == "my notes\n"

    saved = tmp_path / "saved.json"
    od = Series([1.0, 2.0, 2.0], 3, 2)
    pf = Series([1.5] * 4, 4, 2)
    point = Point("ResNet50", "dgx1-v100", 400, False, False, "overhead", 32, 2.0, 1.5)
    saved.write_text(json.dumps(steadiness.to_json([(point, {"on_demand": od, "prefetch": pf})])))
    assert run_cli("steadiness", "--from-json", str(saved), "--output", str(out), "--force") == 0
    text = out.read_text()
    assert text.startswith(steadiness.STEADINESS_MARKER)
    assert "| ResNet50 400 on dgx1-v100 | 2.000 (2.000-2.000) | +0.0% |" in text
    assert "| 0.750 | prefetch faster |" in text
    # A page saved before the drained modes has no columns for them.
    assert "drained every step: on demand" not in text
    # The page it wrote may be written again without --force.
    assert run_cli("steadiness", "--from-json", str(saved), "--output", str(out)) == 0
    pf_drained = Series([1.5, 2.5], 4, 2)
    series = {"on_demand": od, "prefetch": pf, "on_demand_drained": od}
    saved.write_text(
        json.dumps(steadiness.to_json([(point, {**series, "prefetch_drained": pf_drained})]))
    )
    assert run_cli("steadiness", "--from-json", str(saved), "--output", str(out)) == 0
    text = out.read_text()
    assert "drained every step: prefetch out of memory: 1" in text
    assert (
        "| 0.750 | prefetch faster | 2.000 (2.000-2.000) | 2.500 (2.500-2.500) | "
        "prefetch out of memory in step 3 |"
    ) in text

    assert (
        run_cli(
            "steadiness",
            "--results",
            str(tmp_path / "none.json"),
            "--output",
            str(tmp_path / "x.md"),
        )
        == 2
    )
    assert "make results" in capsys.readouterr().err
    results = str(ROOT / "docs/results.json")
    assert (
        run_cli(
            "steadiness",
            "--results",
            results,
            "--only",
            "NoSuchModel",
            "--output",
            str(tmp_path / "y.md"),
        )
        == 2
    )
    assert "matches --only" in capsys.readouterr().err
