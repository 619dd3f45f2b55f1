"""Step-pattern prefetch on the modelled clock: it hides page-in time behind compute."""

from __future__ import annotations

import tflms

MiB = 1 << 20


def run_steps(prefetch: bool, steps: int = 3) -> tuple[dict[str, float], dict[str, int]]:
    """A toy training step: forward keeps 24 activations, backward reads them in reverse."""
    eng = tflms.Engine(
        device_memory=64 * MiB,
        host_memory=1 << 30,
        prefetch=prefetch,
        prefetch_budget=32 * MiB,
        prefetch_lookahead=8,
        store_data=False,
        link_gbps=24.0,
    )
    act = 8 * MiB
    per_op = act / 24e9 * 1.5  # compute a little longer than one copy
    start: dict[str, float] = {}
    for step in range(steps):
        eng.step_begin()
        if step == steps - 1:
            eng.synchronize()
            start = eng.timeline()
        acts = []
        for _ in range(24):
            a = eng.allocate(act, pinned=True)
            eng.compute(per_op)
            eng.unpin(a)
            acts.append(a)
        for a in reversed(acts):
            eng.pin(a)
            eng.compute(per_op)
            eng.unpin(a)
            eng.free(a)
    eng.synchronize()
    end = eng.timeline()
    delta = {k: end[k] - start[k] for k in end}
    return delta, eng.stats()


def test_prefetch_hits_and_cuts_the_stall() -> None:
    base, base_stats = run_steps(prefetch=False)
    pre, pre_stats = run_steps(prefetch=True)
    assert base_stats["num_page_ins"] > 0 and base["compute_stall"] > 0
    assert pre_stats["num_prefetches"] > 0 and pre_stats["prefetch_hits"] > 0
    assert pre["compute_stall"] < 0.5 * base["compute_stall"]
    assert pre["compute_time"] < base["compute_time"]


def test_without_pressure_nothing_moves_and_no_stall() -> None:
    eng = tflms.Engine(device_memory=1 << 30, host_memory=1 << 30, store_data=False)
    bufs = [eng.allocate(8 * MiB, pinned=True) for _ in range(16)]
    for b in bufs:
        eng.compute(1e-3)
        eng.unpin(b)
    eng.synchronize()
    t = eng.timeline()
    assert t["compute_stall"] == 0 and t["d2h_bytes"] == 0
    assert abs(t["compute_time"] - 16e-3) < 1e-9
