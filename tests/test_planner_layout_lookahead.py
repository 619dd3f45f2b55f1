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
    # them, and the step is no slower for it (at 8 MiB a quarter faster). The looks' host
    # time is left free here: what they cost is the next test's.
    steps: dict[tuple[int, bool], float] = {}
    misses: dict[tuple[int, bool], int] = {}
    for mem in (4, 8):
        m = machine(mem * MIB, link="pcie3")
        plan = build_plan(chain_trace(), m.gpu)
        for look in (False, True):
            cfg = dataclasses.replace(
                m.config(prefetch=True),
                layout_lookahead=look,
                layout_look_ns_per_event=0,
                layout_look_ns_per_range=0,
            )
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


def test_the_looks_host_time_is_charged_to_the_modelled_host() -> None:
    # The engine counts each look's work (events modelled, free ranges scanned) and the
    # modelled device charges it to the host clock at the configured rates: free, the
    # chain at 8 MiB steps as it always did; at the planner's measured rates no faster;
    # at a rate a thousand times that, the looks hold back every kernel launched after
    # them and the step is far slower. The work is counted either way.
    m = machine(8 * MIB, link="pcie3")
    plan = build_plan(chain_trace(), m.gpu)
    base = dataclasses.replace(m.config(prefetch=True), layout_lookahead=True)
    assert base.layout_look_ns_per_event > 0 and base.layout_look_ns_per_range > 0
    steps: dict[float, float] = {}
    for scale in (0.0, 1.0, 1000.0):
        cfg = dataclasses.replace(
            base,
            layout_look_ns_per_event=base.layout_look_ns_per_event * scale,
            layout_look_ns_per_range=base.layout_look_ns_per_range * scale,
        )
        r = replay(plan, m.gpu, cfg, steps=6, timed=True)
        assert r.fits and r.stats
        assert r.stats["num_layout_looks"] > 0
        assert r.stats["layout_look_events"] > 0 and r.stats["layout_look_ranges_scanned"] > 0
        assert r.stats["num_layout_looks_refused"] <= r.stats["num_layout_looks"]
        steps[scale] = r.step_time_s
    assert steps[0.0] <= steps[1.0] < steps[1000.0]
    assert steps[1000.0] > 1.5 * steps[0.0]


def test_simulate_prices_the_looks_only_with_the_look_ahead() -> None:
    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tflms", "simulate", "--model", "ResNet50", *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = run("--prefetch", "--look-cost", "2")
    assert r.returncode != 0 and "add it" in r.stderr and "--layout-lookahead" in r.stderr
    r = run("--prefetch", "--layout-lookahead", "--look-cost", "-1")
    assert r.returncode != 0 and "0 or more" in r.stderr
