"""bench/run_bench.py's speed table (the runs themselves are `make bench`)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from tests.bench_scripts import load_bench


def run_bench() -> ModuleType:
    return load_bench("run_bench.py")  # it imports harness_build beside it


def trace(tf: list[float], buffer: list[float]) -> dict[str, Any]:
    return {
        "name": "random",
        "allocs": 1000,
        "max_live_bytes": 2**20,
        "rows": [
            {"name": "tf_bfc", "ns_per_pair": tf},
            {"name": "engine_lms_on_buffer", "ns_per_pair": buffer},
        ],
    }


def row(table: str, label: str) -> list[str]:
    (line,) = [ln for ln in table.splitlines() if label in ln]
    return line.split()


def test_ratios_pair_each_repetition_with_tensorflows_and_show_their_middle_half() -> None:
    rb = run_bench()
    # The machine slows down in repetitions 3-5: both sides slow together, so each
    # repetition's ratio stays 0.9 or 1.1 while the ratio of the two medians would not.
    tf = [100.0, 100.0, 300.0, 300.0, 300.0, 100.0, 100.0, 100.0]
    buffer = [90.0, 110.0, 270.0, 330.0, 270.0, 90.0, 90.0, 110.0]
    table, met = rb.format_speed_table({"traces": [trace(tf, buffer)]})
    fields = row(table, "(AllocateBuffer)")
    assert fields[-5:] == ["0.90x", "0.90-1.10", "<=", "1.00x", "met"]
    assert met["engine_lms_on_buffer"]
    # The medians alone (110 ns against 100) would say 1.10x and MISSED.
    assert fields[-6] == "110.0"

    slower = [r * 1.2 for r in buffer]
    table, met = rb.format_speed_table({"traces": [trace(tf, slower)]})
    assert row(table, "(AllocateBuffer)")[-5:] == ["1.08x", "1.08-1.32", "<=", "1.00x", "MISSED"]
    assert not met["engine_lms_on_buffer"]


def test_fewer_than_four_repetitions_show_their_whole_range() -> None:
    rb = run_bench()
    table, _ = rb.format_speed_table({"traces": [trace([100.0, 100.0], [80.0, 120.0])]})
    assert row(table, "(AllocateBuffer)")[-5:-3] == ["1.00x", "0.80-1.20"]
