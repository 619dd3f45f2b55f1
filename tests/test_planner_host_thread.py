"""The planner's host thread: how far it runs ahead of the GPU, and where it blocks.

On a GPU the host thread that runs TensorFlow's executor enqueues kernels without waiting
for them, until CUDA's launch queue is full; and it blocks wherever the engine synchronizes
(a page-out under pressure waits for its copy). These tests pin down the modelled host:
the launch queue bounds the run-ahead, a bounded host pays for a page-out's wait that an
unbounded one hides behind queued work, and the engine's polls of events (EventDone) see
the modelled clock rather than the inline streams' instant completion.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import tflms
from tests.test_planner import chain_trace
from tflms.planner.gpu import GPUS
from tflms.planner.replay import (
    LAUNCH_QUEUE_DEPTH,
    PATCH_RUN_AHEAD_EPOCHS,
    EngineConfig,
    StepPlan,
    replay,
)
from tflms.planner.yardsticks import ideal
from tflms.trace.format import save_trace

MIB = 1 << 20


def _engine(depth: int, link_gbps: float = 1.0, link_latency_us: float = 10.0) -> tflms.Engine:
    return tflms.Engine(
        device_memory=256 * MIB,
        host_memory=1 << 30,
        store_data=False,
        link_gbps=link_gbps,
        link_latency_us=link_latency_us,
        allow_growth=False,
        launch_queue_depth=depth,
    )


def test_launch_queue_bounds_how_far_the_host_runs_ahead() -> None:
    launch, kernel, n, depth = 5e-6, 1e-3, 50, 8
    free = _engine(0)
    bounded = _engine(depth)
    for eng in (free, bounded):
        for _ in range(n):
            eng.host_advance(launch)
            eng.compute(kernel)
    unbounded_tl = free.timeline()
    tl = bounded.timeline()
    # Unbounded, the host launches everything at its own pace.
    assert unbounded_tl["host_time"] == pytest.approx(n * launch)
    assert unbounded_tl["host_launch_wait"] == 0.0
    # Bounded, launching op n - 1 had to wait for op n - 1 - depth to end.
    assert tl["host_time"] == pytest.approx(launch + (n - depth) * kernel)
    assert tl["host_launch_wait"] > 0.0
    # The GPU's work is the same either way: the host is still ahead of it.
    assert tl["compute_time"] == pytest.approx(unbounded_tl["compute_time"])
    assert tl["compute_time"] - tl["host_time"] == pytest.approx(depth * kernel)


def test_event_polls_follow_the_modelled_clock() -> None:
    # A page-in's host copy is released once the copy has landed. With inline streams the
    # copy "completes" at once; a GPU has not finished it until the modelled clock says so,
    # so a poll earlier than that must keep the host copy.
    eng = _engine(0, link_gbps=1.0)
    a = eng.allocate(64 * MIB)
    b = eng.allocate(MIB)
    assert eng.reclaim_inactive() >= 64 * MIB
    assert eng.stats()["host_bytes_in_use"] >= 64 * MIB
    eng.pin(a)  # pages in: about 67 ms of copy, enqueued, not waited for
    eng.unpin(a)
    eng.pin(b)  # polls the page-in's event at a modelled time before it lands
    eng.unpin(b)
    assert eng.stats()["host_bytes_in_use"] >= 64 * MIB
    eng.host_advance(1.0)  # long after the copy ended
    eng.pin(b)
    eng.unpin(b)
    assert eng.stats()["host_bytes_in_use"] < 64 * MIB


BIG = 400 * MIB
DEVICE = 2 * BIG  # X, then the small tensors, leave a little less than BIG for Y


def _pressure_plan(ops: int, kernel_s: float) -> StepPlan:
    """X (BIG) is made first and read last; Y (BIG) needs X's room in between.

    Between them `ops` small kernels keep the GPU busy. An unbounded host reaches Y's
    allocation long before the GPU does, so the page-out of X that makes room hides behind
    the queued kernels; a host that runs only a few ops ahead blocks on that copy while the
    GPU runs dry.
    """
    return _x_y_plan(ops, kernel_s, y_bytes=BIG, y_first=False)


def _x_y_plan(ops: int, kernel_s: float, y_bytes: int, y_first: bool) -> StepPlan:
    """X (BIG) made first and read by the last op, Y (`y_bytes`, dead at once) made right
    after X (`y_first`) or after the `ops` small kernels between them."""
    x, y = 1, 2
    small = list(range(10, 10 + ops))
    inputs: list[tuple[int, ...]] = [()]
    outputs: list[tuple[tuple[int, int], ...]] = [((x, BIG),)]
    frees: list[tuple[int, ...]] = [()]
    if y_first:
        inputs.append(())
        outputs.append(((y, y_bytes),))
        frees.append((y,))
    prev = None
    for t in small:
        inputs.append((prev,) if prev is not None else ())
        outputs.append(((t, MIB),))
        frees.append((prev,) if prev is not None else ())
        prev = t
    if y_first:
        inputs.append((prev, x))
        outputs.append(())
        frees.append((prev, x))
    else:
        inputs.append((prev,))
        outputs.append(((y, y_bytes),))
        frees.append((prev, y))
        inputs.append((x,))
        outputs.append(())
        frees.append((x,))
    n = len(inputs)
    return StepPlan(
        persistent=[],
        step_inputs=[],
        inputs=inputs,
        outputs=outputs,
        frees=frees,
        kernel_s=[kernel_s] * n,
        names=[f"op{i}" for i in range(n)],
        free_at_start=(),
        forwards=[()] * n,
        sizes={x: BIG, y: y_bytes, **dict.fromkeys(small, MIB)},
        slice_pins=[()] * n,
        slice_unpins=[()] * n,
    )


def test_bounded_host_pays_for_a_page_out_the_unbounded_one_hides() -> None:
    gpu = GPUS["v100-16gb"]
    plan = _pressure_plan(ops=40, kernel_s=10e-3)  # 0.4 s of kernels between X and Y
    copy_s = BIG / 10e9

    def run(depth: int) -> float:
        config = EngineConfig(
            device_memory=DEVICE,
            host_memory=1 << 30,
            link_gbps=10.0,
            launch_queue_depth=depth,
        )
        result = replay(plan, gpu, config)
        assert result.fits
        assert result.step_stats["bytes_reclaimed"] == BIG
        return result.step_time_s

    unbounded = run(0)
    bounded = run(1)
    # Both page X out and back in once; only the bounded host's page-out shows.
    assert bounded > unbounded + 0.5 * copy_s
    assert bounded - unbounded < 1.5 * copy_s


def test_replay_reports_the_host_waits() -> None:
    gpu = GPUS["v100-16gb"]
    plan = _pressure_plan(ops=40, kernel_s=10e-3)
    config = EngineConfig(device_memory=DEVICE, host_memory=1 << 30, link_gbps=10.0)
    assert config.launch_queue_depth == LAUNCH_QUEUE_DEPTH
    result = replay(plan, gpu, dataclasses.replace(config, launch_queue_depth=1))
    # The page-out's wait on the host and the full queue are both counted.
    assert result.host_sync_wait_s > 0.0
    assert result.host_launch_wait_s > 0.0
    assert result.to_json()["host_sync_wait_s"] == result.host_sync_wait_s


def test_ideal_launches_under_the_same_queue() -> None:
    # A long kernel, then short ones. Unbounded, the host launched the short ones while the
    # long one ran, and they follow it back to back. With a queue of one op the host waits
    # for the long kernel before it launches the next, then needs a launch time per op.
    launch, long_s, short_s = 5e-6, 100e-6, 1e-6
    plan = _pressure_plan(ops=10, kernel_s=short_s)
    plan.kernel_s[0] = long_s
    n = len(plan.kernel_s)
    free = ideal(plan, 1 << 30, 12.0, launch_s=launch, steps=1)
    queued = ideal(plan, 1 << 30, 12.0, launch_s=launch, steps=1, launch_queue_depth=1)
    assert free.step_time_s == pytest.approx(launch + long_s + (n - 1) * short_s)
    assert queued.step_time_s == pytest.approx(launch + long_s + short_s + (n - 2) * launch)
    # The queue only ever delays: with one deep enough it changes nothing.
    deep = ideal(plan, 1 << 30, 12.0, launch_s=launch, steps=1, launch_queue_depth=n)
    assert deep.step_time_s == pytest.approx(free.step_time_s)


def test_simulate_takes_the_launch_queue_depth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tflms.cli import main

    path = save_trace(chain_trace(layers=8, batch=4), tmp_path / "chain.json")
    argv = ["simulate", str(path), "--memory", "2MiB", "--no-compare", "--json", "--no-progress"]
    assert main([*argv, "--launch-queue", "7"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["config"]["launch_queue_depth"] for r in out["lms"]] == [7]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lms"][0]["config"]["launch_queue_depth"] == LAUNCH_QUEUE_DEPTH
    assert main([*argv, "--launch-queue", "-1"]) == 2
    assert "--launch-queue" in capsys.readouterr().err


def test_the_device_records_each_host_copy_on_the_gpus_clock() -> None:
    # A buffer used by a 10 ms kernel, paged out while the host is far ahead of the GPU,
    # then paged back in: the copy out runs only once the kernel is done, the copy in only
    # once the copy out landed, each for its bytes over the link plus the latency.
    nbytes, gbps, latency_us, kernel = 64 * MIB, 1.0, 20.0, 10e-3
    eng = _engine(0, gbps, latency_us)
    b = eng.allocate(nbytes, pinned=True)
    eng.record_copies(True)
    eng.compute(kernel)
    eng.unpin(b)
    assert eng.reclaim_inactive() >= nbytes
    with eng.pinned(b):
        pass
    copies = eng.take_copies()
    assert [(kind, size) for kind, _, _, size in copies] == [("d2h", nbytes), ("h2d", nbytes)]
    (_, out_start, out_end, _), (_, in_start, in_end, _) = copies
    one_way = latency_us * 1e-6 + nbytes / (gbps * 1e9)
    assert out_start == pytest.approx(kernel)
    assert out_end - out_start == pytest.approx(one_way)
    assert in_start >= out_end
    assert in_end - in_start == pytest.approx(one_way)
    # Taken means gone; and nothing is kept once recording stops.
    assert eng.take_copies() == []
    eng.record_copies(False)
    eng.unpin(eng.allocate(nbytes, pinned=True))
    eng.reclaim_inactive()
    assert eng.take_copies() == []


def _on_host_plan(ops: int, kernel_s: float) -> StepPlan:
    """X (BIG) is made, Y (most of the device) pushes it out, `ops` small kernels run, and the
    last op reads X: X is on the host while the host could run far ahead of the GPU."""
    return _x_y_plan(ops, kernel_s, y_bytes=DEVICE - BIG // 2, y_first=True)


def test_the_run_ahead_limit_holds_the_host_with_prefetch_only() -> None:
    # 400 kernels of 1 ms while X is on the host. The engine's throttle
    # (EngineOptions::run_ahead_epochs) makes the host wait for the GPU at every epoch close
    # with prefetch; paging on demand, and with the throttle off, the host runs ahead.
    gpu = GPUS["v100-16gb"]
    plan = _on_host_plan(ops=400, kernel_s=1e-3)
    runs = {}
    for prefetch in (False, True):
        for epochs in (0, 2):
            config = EngineConfig(
                device_memory=DEVICE,
                host_memory=1 << 30,
                link_gbps=10.0,
                prefetch=prefetch,
                run_ahead_epochs=epochs,
            )
            result = replay(plan, gpu, config, steps=6)
            assert result.fits
            assert result.step_stats["bytes_reclaimed"] == BIG
            runs[prefetch, epochs] = result
    assert runs[True, 2].host_sync_wait_s > runs[True, 0].host_sync_wait_s + 0.15
    # The GPU keeps two epochs of kernels queued: the step is not longer.
    assert runs[True, 2].step_time_s == pytest.approx(runs[True, 0].step_time_s, rel=1e-3)
    assert runs[False, 2].host_sync_wait_s == runs[False, 0].host_sync_wait_s
    assert runs[False, 2].step_time_s == runs[False, 0].step_time_s
    throttled = runs[True, 2].config
    assert "host within 2 epochs" in throttled.label()
    assert not throttled.patch_default


def test_simulate_takes_the_run_ahead_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tflms.cli import main

    path = save_trace(chain_trace(layers=8, batch=4), tmp_path / "chain.json")
    argv = ["simulate", str(path), "--memory", "2MiB", "--no-compare", "--json", "--no-progress"]
    assert main([*argv, "--prefetch", "--run-ahead-epochs", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["config"]["run_ahead_epochs"] for r in out["lms"]] == [5]
    # Without the flag, the patch's default.
    assert main([*argv, "--prefetch"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["config"]["run_ahead_epochs"] for r in out["lms"]] == [PATCH_RUN_AHEAD_EPOCHS]
    # The bound is the engine's (tflms::kMaxRunAheadEpochs), named where it is refused.
    top = tflms.engine.MAX_RUN_AHEAD_EPOCHS
    assert main([*argv, "--run-ahead-epochs", str(top + 1)]) == 2
    assert f"0 (off) to {top}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"1 to {top}"):
        tflms.Engine(device_memory=256 * MIB, run_ahead_epochs=top + 1)
    # The bound itself passes the C++ engine's own check (Init).
    tflms.Engine(device_memory=256 * MIB, run_ahead_epochs=top, prefetch=True)
