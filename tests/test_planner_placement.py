"""Prefetch at ResNet50's largest batches, where nearly every op pages out (core/src/placement.cc).

Before its pin, a buffer of a quarter of the device or more that lies in the middle of a gap
moves to one of the gap's ends, so that what the kernel allocates next finds room. Done at
every such pin, the moves paged out what lay at their destinations and waited for the GPU's
last uses, and prefetch stepped slower than paging on demand at these points (ResNet50 1342
on the AC922: 10.37 s against 9.84 s; 1340 on the DGX-1 with twice the host: 45.4 s
against 41.0 s, 12 steps each). While a learned plan is followed, the engine now moves such
a buffer only where the step's next pins would otherwise find no gap for their largest
allocation and for the buffers that come back from the host for them. Counting the buffers
that come back matters: judged by the allocation alone, the DGX-1 point ran out of memory
at a batch norm gradient whose two 4.0 GiB inputs ended up 2.3 GiB apart.

The real engine replays the planner's real ResNet50 trace at the points docs/results.md
reports, with TensorFlow's default memory limit.
"""

from __future__ import annotations

import pytest

from tflms.planner.machines import get_pairing
from tflms.planner.replay import replay
from tflms.planner.simulate import Machine, build_plan
from tflms.planner.study import HOST_FACTOR, get_trace


@pytest.mark.parametrize(
    ("pairing", "batch", "more_host"),
    [("ac922-v100", 1342, False), ("dgx1-v100", 1340, True)],
)
def test_prefetch_beats_paging_on_demand_at_resnet50s_largest_batch(
    pairing: str, batch: int, more_host: bool
) -> None:
    machine = Machine.from_pairing(get_pairing(pairing))
    if more_host:
        machine = machine.with_host(machine.host_side.scaled(HOST_FACTOR))
    plan = build_plan(get_trace("ResNet50", 32).rescaled(batch), machine.gpu)
    on_demand = replay(plan, machine.gpu, machine.config(prefetch=False), steps=12, timed=True)
    prefetch = replay(plan, machine.gpu, machine.config(prefetch=True), steps=12, timed=True)
    assert on_demand.fits, on_demand.oom_message
    assert prefetch.fits, f"{prefetch.oom_op}: {prefetch.oom_message}"
    assert prefetch.stats["prefetch_hits"] > 0
    assert prefetch.step_time_s < on_demand.step_time_s
    # Fewer bytes cross the link with prefetch than without it (the moves' page-outs were
    # what made prefetch move more).
    assert prefetch.d2h_bytes < on_demand.d2h_bytes
