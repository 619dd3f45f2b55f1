"""docs/results.md's "Measured on a GPU": the CUDA benchmark's JSON kept and rendered.

The measured files are the ones committed in docs/gpu/ (an H200 run); the tests check that every
figure the page prints comes from them, and that bad input is refused with a clear message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tflms.cli import main
from tflms.planner.gpu_report import attach, gpu_markdown, load_bench
from tflms.planner.report import RESULTS_MARKER

GPU_DIR = Path(__file__).resolve().parents[1] / "docs" / "gpu"
BENCH = GPU_DIR / "h200-2026-11-26-run2-bench.json"
BASELINE = GPU_DIR / "h200-2026-11-26-run2-bench-baseline-engine.json"


def test_load_bench_reads_the_figures_and_the_nvidia_smi_line() -> None:
    m = load_bench(BENCH)
    assert m["figures"]["device"] == "NVIDIA H200"
    assert m["nvidia_smi"]["pcie.link.gen.current"] == "5"
    assert m["nvidia_smi"]["driver_version"].startswith("580.")


def test_section_prints_the_measured_figures_beside_the_planner() -> None:
    g = json.loads(BENCH.read_text())
    md = "\n".join(gpu_markdown(load_bench(BENCH)))
    assert md.startswith("## Measured on a GPU")
    assert "NVIDIA H200, PCIe gen 5 x16" in md
    # The copy table: raw and engine rates at 256 MiB, as measured.
    assert f"{g['raw_d2h_gbps_256MiB']:.1f}" in md
    assert (
        f"{g['engine_page_in_gbps_256MiB']:.1f} ({100 * g['engine_page_in_of_raw_256MiB']:.0f}%)"
        in md
    )
    # Every workload table, with its prefetch row's measured and predicted step.
    for title in ("balanced, 2x", "balanced, 4x", "balanced, 6x", "fine-grained"):
        assert title in md
    assert f"| prefetch | {g['sweep4x_prefetch_step_s']:.3f} |" in md
    assert f"{g['sweep4x_prefetch_planner_s']:.3f}" in md
    ok = min(
        g[f"engine_page_{d}_of_raw_{s}"] for d in ("out", "in") for s in ("4MiB", "64MiB", "256MiB")
    )
    assert f"in both directions: {'met' if ok >= 0.85 else 'not met'}." in md
    assert "engine before" not in md


def test_baseline_adds_a_column_and_the_long_run() -> None:
    md = "\n".join(gpu_markdown(attach({}, BENCH, BASELINE)["gpu_measured"]))
    base = json.loads(BASELINE.read_text())
    assert "engine before s" in md
    assert f"{base['long3x_prefetch_late_s']:.3f}" in md
    # Unnamed, the baseline is not described beyond what is known.
    assert "in the same session, over an earlier engine (" in md


def test_not_a_bench_json_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x-bench.json"
    bad.write_text(json.dumps({"steps": 3}))
    with pytest.raises(ValueError, match="not a cuda_bench JSON"):
        load_bench(bad)


def test_cli_keeps_the_measurements_and_renders_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"wall_s": 60.0, "calibration": [], "studies": []}))
    out = tmp_path / "results.md"
    assert main(["results", "--output", str(out), "--gpu-bench", str(BENCH)]) == 2
    assert "--from-json" in capsys.readouterr().err
    args = ["results", "--output", str(out), "--from-json", str(saved)]
    assert main([*args, "--gpu-baseline", str(BASELINE)]) == 2
    assert "needs --gpu-bench" in capsys.readouterr().err
    assert main([*args, "--gpu-engine", "commit abc"]) == 2
    assert "--gpu-engine needs --gpu-bench" in capsys.readouterr().err
    assert main([*args, "--gpu-bench", str(BENCH), "--gpu-baseline-engine", "commit abc"]) == 2
    assert "--gpu-baseline-engine needs --gpu-baseline" in capsys.readouterr().err
    named = ["--gpu-engine", "commit new1", "--gpu-baseline-engine", "commit old0 (run 1's)"]
    bench_args = ["--gpu-bench", str(BENCH), "--gpu-baseline", str(BASELINE)]
    assert main([*args, *bench_args, *named]) == 0
    kept = json.loads(saved.read_text())["gpu_measured"]
    assert kept["figures"]["device"] == "NVIDIA H200" and kept["baseline"]["figures"]
    assert kept["engine"] == "commit new1"
    md = out.read_text()
    assert md.startswith(RESULTS_MARKER) and "## Measured on a GPU" in md
    assert "lent for a few minutes, running the engine at commit new1 (" in md
    assert "in the same session, over commit old0 (run 1's) ([" in md
    # Rendering again from the saved JSON alone keeps the section.
    assert main(args) == 0
    assert "## Measured on a GPU" in out.read_text()


def test_a_rerun_of_the_results_keeps_what_the_gpu_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The replays themselves take an hour; here they return at once (the planner's own
    # study code is what is replaced, not TensorFlow), and the saving around them is real.
    from tflms.planner import study

    def quick(**kwargs: object) -> dict[str, object]:
        return {"wall_s": 1.0, "calibration": [], "studies": []}

    monkeypatch.setattr(study, "run_results", quick)
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"wall_s": 60.0, "calibration": [], "studies": []}))
    out = tmp_path / "results.md"
    base = ["results", "--output", str(out), "--force"]
    assert main([*base, "--from-json", str(saved), "--gpu-bench", str(BENCH)]) == 0
    assert main([*base, "--json-output", str(saved), "--no-progress"]) == 0
    assert json.loads(saved.read_text())["gpu_measured"]["figures"]["device"] == "NVIDIA H200"
    assert "## Measured on a GPU" in out.read_text()


def test_launch_queue_figures_are_rendered_when_measured() -> None:
    launch = GPU_DIR / "h200-2026-11-26-run3-launch.json"
    g = json.loads(launch.read_text())
    md = "\n".join(gpu_markdown(load_bench(launch)))
    assert f"{g['launch_us']:.1f} us of host time per launch" in md
    assert f"first blocked at launch {g['launch_queue_depth']:.0f}" in md
    assert "### Launch queue" not in "\n".join(gpu_markdown(load_bench(BENCH)))


def test_the_tests_sentence_is_read_from_the_run_s_own_logs(tmp_path: Path) -> None:
    run8 = GPU_DIR / "h200-2026-11-27-run8-bench.json"
    m = load_bench(run8)
    log = (GPU_DIR / "h200-2026-11-27-run8-tests.txt").read_text()
    assert m["tests"]["passed"] and len(m["tests"]["passed"]) == log.count("[ OK ]")
    assert "slide with the host full" in m["tests"]["passed"]
    assert m["tests"]["memcheck_errors"] == 0
    md = "\n".join(gpu_markdown(m))
    assert f"all {log.count('[ OK ]')} passed there, also under compute-sanitizer" in md
    # A failing test and a dirty memcheck are said, never rounded into a pass; without a
    # test log the page claims nothing about tests.
    (tmp_path / "x-bench.json").write_text(run8.read_text())
    tests = tmp_path / "x-tests.txt"
    tests.write_text(log + "[FAIL] slide again: 3 corrupt\nFAILED\n")
    (tmp_path / "x-memcheck.txt").write_text("========= ERROR SUMMARY: 2 errors\n")
    md = "\n".join(gpu_markdown(load_bench(tmp_path / "x-bench.json")))
    assert "1 of 11 FAILED there (slide again)" in md
    assert "memcheck (2 errors;" in md
    tests.unlink()
    md = "\n".join(gpu_markdown(load_bench(tmp_path / "x-bench.json")))
    assert "CUDA engine tests" not in md
