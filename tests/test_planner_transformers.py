"""`tflms transformers`: a real keras-hub trace through the study and onto the generated page.

The study runs GPT2-tiny (two layers) on a modelled GPU that holds half of its step, so the
engine must move tensors, variables and Adam slots included, for batch 1 to train.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.test_planner import GPU, MIB, run_cli
from tflms.planner import transformers as study
from tflms.planner.gpu import GPUS
from tflms.planner.host import fixed_host
from tflms.planner.replay import build_plan, peak_live_bytes
from tflms.planner.simulate import Machine, simulate_step
from tflms.trace.format import Trace


def test_mixed_precision_ops_run_on_the_tensor_cores() -> None:
    v100 = GPUS["v100-16gb"]
    flops, traffic = 1e12, 1e6  # compute-bound
    fp32 = v100.op_seconds(flops, traffic)
    half = v100.op_seconds(flops, traffic, half=True)
    assert half < fp32 / 3  # 125 TFLOPS of fp16 tensor cores at 40% against 15.7 at 80%
    # A memory-bound op gains nothing from the tensor cores.
    assert v100.op_seconds(1e3, 1e9, half=True) == v100.op_seconds(1e3, 1e9)
    # A what-if compute rate applies to every op.
    flat = v100.with_tflops(10.0)
    assert flat.op_seconds(flops, traffic, half=True) == flat.op_seconds(flops, traffic)


@pytest.fixture(scope="module")
def tiny() -> Trace:
    pytest.importorskip("keras_hub", reason="keras-hub is installed by `make install`")
    from tflms.trace.capture import trace_model

    return trace_model("GPT2-tiny", study.TRACE_BATCH, 128, progress=False)


@pytest.mark.tf
def test_study_point_trains_a_transformer_larger_than_the_gpu(
    tiny: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(study, "_trace", lambda point: tiny)
    peak = peak_live_bytes(build_plan(tiny, GPU))
    persistent = sum(t.bytes for t in tiny.tensors if t.persistent)
    memory = peak // 2
    assert persistent > memory // 2  # weights and slots alone fill half of the GPU
    host = 64 * MIB
    machine = dataclasses.replace(
        Machine(GPU.with_memory(memory), "pcie3", 12.0, host, host_side=fixed_host(host)),
        pairing="dgx1-v100",
        what_if=("memory: half the step",),
    )
    point = study.Point("GPT2-tiny", 128, "fp32")
    row = study.study_point(point, [machine], steps=2, progress=False)
    m = row["machines"]["dgx1-v100"]
    assert m["without_lms"] == 0 and not m["batch1_fits_without_lms"]
    assert m["with_lms"] >= 2 and m["batch1_lms_fits"]
    assert m["batch1_lms_s"] > m["batch1_unlimited_s"]
    # The largest batch really fits with LMS and one more does not.
    rep, _ = simulate_step(tiny.rescaled(m["with_lms"]), machine, compare=False)
    assert rep["lms"][0]["fits"]
    assert row["persistent_bytes"] == persistent
    assert row["parameters"] == tiny.metadata["parameters"]

    res = {
        "machines": {"dgx1-v100": {"description": "half a step", "host_memory_bytes": host}},
        "scaling": [row],
        "sequence": [],
        "goal": [],
        "steps": 2,
        "seconds": 1.0,
    }
    page = study.transformers_markdown(res)
    assert page.splitlines()[0] == study.TRANSFORMERS_MARKER
    table_row = next(line for line in page.splitlines() if line.startswith("| GPT2-tiny"))
    cells = [c.strip() for c in table_row.strip("|").split("|")]
    assert cells[0] == "GPT2-tiny" and cells[6] == "does not fit"  # largest batch without LMS
    assert cells[7].split()[0] == str(m["with_lms"])
    # Samples per second at the largest batch with LMS, and what LMS costs there.
    assert float(cells[10]) == pytest.approx(m["with_lms_samples_per_s"], abs=0.01)
    assert m["with_lms_overhead"] > 0 and cells[9] == "-"


@pytest.mark.tf
def test_cli_keeps_a_page_it_did_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "transformers.md"
    mine.write_text("my notes\n")
    assert run_cli("transformers", "--output", str(mine), "--quick") == 2
    assert "--force" in capsys.readouterr().err
    assert mine.read_text() == "my notes\n"
