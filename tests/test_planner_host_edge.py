"""Prefetch where the live bytes fill the device and the host pool together.

The 3D U-Net at 480^3 keeps 217.8 GB live at its largest gradient ops; an 80 GB A100
(TensorFlow's 77.40 GiB) with TensorFlow's 128 GiB host pool holds 2.8 GB more than that.
Paging on demand fits there, yet prefetch, which leaves other tensors on each side, ran out
of memory in step 3: its 14.2 GB gradient found five inactive 14.2 GB tensors around 12.3
GB of free chunks and 4.6 GB free in the pool. The engine now brings reclaimed tensors back
into chunks the request cannot use so that the pool takes a victim (core/src/exchange.cc).
The real engine replays the planner's real trace here.

At lookahead 64 the same model met a second failure in step 5: the learned step placed its
up0 concat's two 14.2 GB inputs as a group (core/src/due_group.cc), but the destination it
planned for one of them lay, once the tensors around it had left, inside a free chunk rather
than at its end, where the arena refused it; pinned where they fell, the inputs left no
26.4 GiB gap for the output with 54.8 GB free.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from tflms.planner.machines import get_pairing
from tflms.planner.replay import replay
from tflms.planner.simulate import Machine, StepPlan, build_plan
from tflms.planner.study import get_trace

MACHINE = Machine.from_pairing(get_pairing("dgx-a100-80gb"))


@functools.cache
def unet_480() -> StepPlan:
    return build_plan(get_trace("UNet3D", 1, 480), MACHINE.gpu)


@pytest.mark.tf
def test_prefetch_fits_the_unet_at_the_edge_of_both_memories() -> None:
    result = replay(unet_480(), MACHINE.gpu, MACHINE.config(prefetch=True), steps=20)
    assert result.fits, f"{result.oom_op}: {result.oom_message}"
    assert result.steps == 20
    # The exchanges are what made room, and the engine counts what they brought back.
    assert result.stats["num_host_exchanges"] > 0
    assert result.stats["bytes_host_exchanged"] > 0


@pytest.mark.tf
def test_a_due_groups_destination_inside_a_free_chunk_is_taken() -> None:
    # Timed, as docs/lookahead.md replays it: the copies' durations decide what is in
    # flight when the group is placed. Untimed, the same replay still falls 336 KB short
    # of the output's gap at the concat: a stranded input is moved within a gap that
    # cannot hold the output either way (docs/how-it-works.md). With the host a launch
    # queue ahead of the GPU, as it was found: held within 8 epochs (the default since),
    # the group's planned destinations lie at the ends of their chunks and the step fits
    # without this path, which the test is here to run.
    machine = dataclasses.replace(MACHINE, prefetch_lookahead=64, run_ahead_epochs=0)
    result = replay(unet_480(), machine.gpu, machine.config(prefetch=True), steps=8, timed=True)
    assert result.fits, f"{result.oom_op}: {result.oom_message}"
    assert result.stats["num_due_group_placements"] > 0
