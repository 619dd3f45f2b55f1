"""Prefetch at the largest batches paging on demand reaches (core/src/due_group.cc).

Following the learned step, prefetch pages a kernel's inputs in wherever a hole is free,
and once pinned none may move. Before the engine placed a kernel's inputs at the first
one's pin, these points ran out of memory with prefetch (InceptionV3 at step 5, an AddN
input's page-in; ResNet50 at step 11, MaxPoolGrad's output) with the memory free but
split by the kernel's own inputs, while paging on demand fit. InceptionV3 also needs the
AddN's two inputs on the host paged in together where they fit: one pin at a time they
left the third no gap. The real engine replays the planner's real traces here, on the
card's whole 16 GiB where these points were found (TensorFlow's default limit is less).
The 3D U-Net's concat, whose inputs had to slide together, is replayed at TensorFlow's
own limit, where it was found.
"""

from __future__ import annotations

import pytest

from tflms.planner.machines import get_pairing
from tflms.planner.replay import replay
from tflms.planner.simulate import Machine, build_plan
from tflms.planner.steadiness import Point, point_plan
from tflms.planner.study import get_trace


@pytest.mark.parametrize(
    ("model", "pairing", "batch"),
    # InceptionV3 at 692 no longer reaches the split (next test), nor at 680 since the
    # engine pages out less and slides (TopUpAndSlideLocked): 684 still does.
    [("InceptionV3", "dgx1-v100", 684), ("ResNet50", "ac922-v100", 1497)],
)
def test_prefetch_fits_where_its_inputs_would_have_split_the_memory(
    model: str, pairing: str, batch: int
) -> None:
    machine = Machine.from_pairing(get_pairing(pairing)).with_card_memory()
    plan = build_plan(get_trace(model, 32).rescaled(batch), machine.gpu)
    result = replay(plan, machine.gpu, machine.config(prefetch=True), steps=20)
    assert result.fits, f"{result.oom_op}: {result.oom_message}"
    assert result.steps == 20
    # The placement is what made room, and the bytes it moved or brought back are
    # counted as the engine's own statistics say.
    assert result.stats["num_due_group_placements"] > 0
    assert result.stats["bytes_due_group_placed"] > 0


def test_a_slide_before_a_reclaim_keeps_the_addn_inputs_from_splitting_the_memory() -> None:
    # InceptionV3 at 692, where the AddN's inputs once split the memory: since the engine
    # slides rather than pages out a large victim pinned again within a few pins
    # (SlideRatherThanReclaimLocked), it fits with no group to place at its first pin,
    # the slides counted as the engine's moves.
    machine = Machine.from_pairing(get_pairing("dgx1-v100")).with_card_memory()
    plan = build_plan(get_trace("InceptionV3", 32).rescaled(692), machine.gpu)
    result = replay(plan, machine.gpu, machine.config(prefetch=True), steps=20)
    assert result.fits, f"{result.oom_op}: {result.oom_message}"
    assert result.steps == 20
    assert result.stats["num_defragmentations"] > 0
    assert result.stats["num_due_group_placements"] == 0


@pytest.mark.tf
def test_prefetch_slides_a_concats_inputs_together_for_its_output() -> None:
    # UNet3D at 304^3 on a V100 (TensorFlow's 14.34 GiB), where paging on demand runs: with
    # prefetch its up0 concat ran out of memory in step 7 with its two 3.35 GiB inputs side
    # by side 0.75 GiB above the lowest usable address and the 6.70 GiB output 16 MiB short
    # of a gap. No window clears by moving whole members elsewhere there, so the members
    # slide down against each other and the output goes above them (PackDueGroupLocked).
    machine = Machine.from_pairing(get_pairing("dgx1-v100"))
    plan = build_plan(get_trace("UNet3D", 1, 304), machine.gpu)
    result = replay(plan, machine.gpu, machine.config(prefetch=True), steps=12, timed=True)
    assert result.fits, f"{result.oom_op}: {result.oom_message}"
    assert result.stats["num_due_group_placements"] > 0
    assert result.stats["bytes_due_group_placed"] > 0


def test_a_lone_input_on_the_host_lands_where_the_output_still_fits() -> None:
    # ResNet152 at 1339 on the AC922 with twice the host, a largest batch: a batch-norm
    # gradient's Mul pins two 4.29 GB inputs, one resident and one on the host, then
    # allocates a 4.29 GB output. Both inputs and the output fit in the 8.3 GiB gap below
    # the resident one, filled from its low end. But the lone input's pin paged it in by
    # cluster placement, which counted an early page-out still in flight at the gap's low
    # end as a wall: the input landed 2.0 GiB into the gap, and in step 10 the output
    # found gaps of 2.0 and 2.3 GiB with 6.8 GB free. Now where the output would find no
    # gap beside the input landed as its pin would land it, the input is paged in where
    # the fit put it. Over 30 steps, as docs/steadiness.md replays a largest batch.
    point = Point(
        model="ResNet152",
        pairing="ac922-v100",
        n=1339,
        size_model=False,
        more_host=True,
        kind="largest",
        trace_batch=16,
    )
    plan, machine = point_plan(point)
    result = replay(plan, machine.gpu, machine.config(prefetch=True), steps=30, timed=True)
    assert result.fits, f"{result.oom_op}: {result.oom_message}"
    assert result.steps == 30
    assert result.stats["num_due_group_placements"] > 0
