"""bench/copy_order.py: the Ideal's step under each order of copies, and its table, on the
hand-made plan whose times tests/test_planner_yardsticks.py works out by hand."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench_scripts import load_bench
from tests.test_planner_yardsticks import KB, KIB_PER_S, crossing_outs_plan


def bench() -> ModuleType:
    return load_bench("copy_order.py")


SCHEDULE = {
    "device_memory": 5 * KB,
    "link_gbps": KIB_PER_S,
    "launch_s": 0.0,
    "latency_s": 0.0,
    "launch_queue_depth": 0,
}


def test_each_order_of_the_crossing_copies_out() -> None:
    co = bench()
    row = co.order_row(crossing_outs_plan(), SCHEDULE, steps=1)
    assert row["ideal_s"] == pytest.approx(13.5)
    assert row["in_order_s"] == pytest.approx(14.0)
    assert row["out_in_order_s"] == pytest.approx(14.0)
    assert row["in_in_order_s"] == pytest.approx(13.5)
    # One op of hold is enough here, so every hold wins the order back.
    for key in [f"held_{n}_s" for n in co.HOLDS] + ["held_all_s"]:
        assert row[key] == pytest.approx(13.5)


def test_the_table_gives_each_order_over_the_ideal_and_their_geometric_means() -> None:
    co = bench()
    row = co.order_row(crossing_outs_plan(), SCHEDULE, steps=1)
    text = co.report(["hand plan", "too big"], [row, {"ideal_s": None}])
    lines = text.splitlines()
    hand = next(line for line in lines if line.startswith("| hand plan |"))
    assert hand.split(" | ")[1:5] == ["13.500 s", "1.037x", "1.037x", "1.000x"]
    assert "| too big | does not fit |" in text
    assert "both in order 1.037x, out in order 1.037x, in in order 1.000x" in text
    assert "held all 1.000x." in text


def test_it_says_what_to_change_when_the_results_or_the_points_are_wrong(
    tmp_path: Path,
) -> None:
    co = bench()
    with pytest.raises(SystemExit, match="give --results a saved"):
        co.main(["--results", str(tmp_path / "missing.json"), "--no-progress"])
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"studies": []}))
    with pytest.raises(SystemExit, match="no prefetch point"):
        co.main(["--results", str(saved), "--only", "nothing", "--no-progress"])
