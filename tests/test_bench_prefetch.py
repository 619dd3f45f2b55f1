"""bench/prefetch_fit.py's figures and table (the runs themselves are `make bench-prefetch`)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from tests.bench_scripts import load_bench


def bench() -> ModuleType:
    return load_bench("prefetch_fit.py")


def result(wait_ms: float, mb_in: float, mb_on_demand: float) -> dict[str, Any]:
    return {
        "wall_s": 2.0,
        "kernel_wait_ns": wait_ms * 1e6,
        "stats": {
            "page_out_wait_ns": 0,
            "bytes_paged_in": mb_in * 1e6,
            "bytes_paged_in_on_demand": mb_on_demand * 1e6,
            "prefetch_hits": 0,
            "prefetch_hits_in_flight": 0,
            "prefetch_pins": 0,
            "prefetch_pins_in_order": 0,
        },
    }


def test_the_wait_per_mb_compares_modes_across_the_two_traffic_regimes() -> None:
    # One low-traffic and one high-traffic run per mode, as the executor's op order
    # gives them: prefetch waits 0.5 ms per MB, on-demand 1 ms, whatever the traffic.
    b = bench()
    runs = {
        "lms": [b.figures_of(result(100, 100, 100)), b.figures_of(result(300, 300, 300))],
        "prefetch": [b.figures_of(result(150, 300, 50)), b.figures_of(result(160, 320, 60))],
    }
    assert runs["prefetch"][0]["wait_per_mb"] == pytest.approx(0.5)
    table = b.format_table(runs)
    # The medians of the wait mislead (155 ms against 200 ms, 0.78x); per MB says 0.5x.
    assert "kernels waited 0.78x" in table, table
    assert "waited per MB in 0.50x" in table, table
    assert "| prefetch | 2.00 s [2.00 s - 2.00 s] | 155 ms [150 ms - 160 ms]" in table, table


def test_a_run_that_paged_nothing_in_waits_zero_per_mb() -> None:
    assert bench().figures_of(result(0, 0, 0))["wait_per_mb"] == 0.0


def test_bad_arguments_are_named() -> None:
    b = bench()
    with pytest.raises(SystemExit):
        b._parse_args(["--runs", "0"])  # noqa: SLF001
    with pytest.raises(SystemExit):
        b._parse_args(["--case", "cnn"])  # noqa: SLF001
    args = b._parse_args(["--device-memory", "4736KiB"])  # noqa: SLF001
    assert args.device_memory == "4736KiB"
    assert args.case == "keras_fit" and not args.guard
    args = b._parse_args(["--case", "keras_fit_deep", "--guard"])  # noqa: SLF001
    assert args.case == "keras_fit_deep" and args.guard


def test_each_mode_beside_on_demand_gets_its_ratios() -> None:
    b = bench()
    runs = {
        "lms": [b.figures_of(result(200, 100, 100))],
        "prefetch": [b.figures_of(result(50, 100, 20))],
        "guarded": [b.figures_of(result(100, 100, 60))],
    }
    table = b.format_table(runs)
    assert "| prefetch + guard | 2.00 s" in table, table
    assert "prefetch / on-demand (medians): fit wall 1.00x, kernels waited 0.25x" in table, table
    assert "prefetch + guard / on-demand (medians): fit wall 1.00x, kernels waited 0.50x" in (
        table
    ), table


def test_the_unheld_mode_is_prefetch_with_the_host_throttle_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `--unheld` measures, beside the default, prefetch without the engine holding the host
    # near the compute stream: the same tfcpu_cases mode with TF_LMS_RUN_AHEAD_EPOCHS=0.
    import json
    import subprocess

    b = bench()
    assert b._parse_args(["--unheld"]).unheld  # noqa: SLF001
    assert not b._parse_args([]).unheld  # noqa: SLF001
    monkeypatch.delenv("TF_LMS_RUN_AHEAD_EPOCHS", raising=False)
    seen: list[tuple[list[str], str | None]] = []

    def run(cmd: list[str], env: dict[str, str], **_: object) -> subprocess.CompletedProcess:
        seen.append((cmd[-2:], env.get("TF_LMS_RUN_AHEAD_EPOCHS")))
        out = "RESULT " + json.dumps(result(10, 10, 1)) + "\n"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(b.subprocess, "run", run)
    b.run_fit("unheld", 2.0, case="keras_fit_deep")
    b.run_fit("prefetch", 2.0, case="keras_fit_deep")
    assert seen == [(["keras_fit_deep", "prefetch"], "0"), (["keras_fit_deep", "prefetch"], None)]
    table = b.format_table(
        {"lms": [b.figures_of(result(20, 10, 10))], "unheld": [b.figures_of(result(10, 10, 1))]}
    )
    assert "| prefetch, host unheld | 2.00 s" in table, table
