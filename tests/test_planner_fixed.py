"""The planner models the add-on's fixed-address mode: pages behind fixed addresses."""

from __future__ import annotations

import dataclasses

from tests.test_planner import GPU, MIB
from tests.test_planner import machine as make_machine
from tests.test_planner_rules import Builder
from tflms.planner.replay import build_plan, replay
from tflms.planner.simulate import FixedPages

KIB = 1 << 10


def weights_trace() -> Builder:
    # Eight 1 MiB weights read in turn on a 3 MiB GPU: they must leave and come back.
    b = Builder()
    weights = [b.tensor(MIB, persistent=True) for _ in range(8)]
    x = b.tensor(64 * KIB)
    b.op("Fill", [], [x])
    for w in weights:
        y = b.tensor(64 * KIB)
        b.op("MatMul", [x, w], [y])
        x = y
    return b


def test_fixed_mode_replays_with_pages_and_charges_their_driver_calls() -> None:
    plan = build_plan(weights_trace().trace(), GPU)
    base = make_machine(3 * MIB, host=64 * MIB)
    free = dataclasses.replace(
        base, fixed=FixedPages(page_size=64 * KIB, map_us_per_page=0, unmap_us_per_page=0)
    )
    costly = dataclasses.replace(
        base, fixed=FixedPages(page_size=64 * KIB, map_us_per_page=50, unmap_us_per_page=50)
    )
    config = costly.config()
    assert config.fixed_addresses and config.page_size == 64 * KIB
    assert not config.patch_default and "fixed addresses" in config.label()
    r_free = replay(plan, GPU, free.config())
    r_costly = replay(plan, GPU, costly.config())
    assert r_free.fits and r_costly.fits
    # Same pages move either way; only the assumed driver time differs.
    assert r_free.h2d_bytes == r_costly.h2d_bytes >= 4 * MIB
    assert r_costly.step_time_s > r_free.step_time_s


def test_without_lms_the_add_on_is_tensorflows_own_allocator() -> None:
    # The add-on with LMS off hands TensorFlow its own BFC allocator (docs/addon.md), so
    # the fixed-address machine's "without LMS" replay is the stock one, with TensorFlow's
    # split rule and no pages; with LMS it is the fixed-address engine.
    base = make_machine(3 * MIB, host=64 * MIB)
    fixed = dataclasses.replace(base, fixed=FixedPages(page_size=64 * KIB))
    assert fixed.config(lms=False) == base.config(lms=False)
    assert not fixed.config(lms=False).fixed_addresses
    assert fixed.config().fixed_addresses and not base.config().fixed_addresses
