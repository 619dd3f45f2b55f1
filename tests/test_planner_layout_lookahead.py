"""The layout look-ahead (EngineOptions::layout_lookahead), replayed by the real engine."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from tests.test_planner import machine
from tests.test_planner_yardsticks import MIB, chain_trace
from tflms.planner.replay import build_plan, replay


def test_the_look_ahead_starts_the_copies_in_the_slack_held_back() -> None:
    # The chain's plan keeps twice its largest tensor free of planned copies in, which on
    # these devices holds every one of them back to the look-ahead's own prefetch. Asked
    # per copy whether what its stretch allocates still finds room, the engine starts
    # them, and the step is no slower for it (at 8 MiB a quarter faster).
    steps: dict[tuple[int, bool], float] = {}
    misses: dict[tuple[int, bool], int] = {}
    for mem in (4, 8):
        m = machine(mem * MIB, link="pcie3")
        plan = build_plan(chain_trace(), m.gpu)
        for look in (False, True):
            cfg = dataclasses.replace(m.config(prefetch=True), layout_lookahead=look)
            r = replay(plan, m.gpu, cfg, steps=6, timed=True)
            assert r.fits and r.stats
            assert (r.stats["num_planned_prefetches"] > 0) == look
            steps[mem, look] = r.step_time_s
            misses[mem, look] = r.stats["prefetch_misses"]
            assert cfg.patch_default is not look
            assert ("layout look-ahead" in cfg.label()) == look
    assert steps[4, True] <= steps[4, False] * (1 + 1e-9)
    assert steps[8, True] < 0.8 * steps[8, False]
    assert misses[4, True] <= misses[4, False] and misses[8, True] <= misses[8, False]


def test_simulate_refuses_the_look_ahead_without_prefetch() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tflms", "simulate", "--model", "ResNet50", "--layout-lookahead"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "add --prefetch" in r.stderr
