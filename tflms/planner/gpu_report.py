"""docs/results.md's "Measured on a GPU": the CUDA benchmark's figures beside the planner's.

`make bench-cuda` (bench/cuda_bench.cu) writes a flat JSON of what it measured on a real GPU:
the card's pinned copy bandwidth, the engine's copy streams, overlap, CUDA virtual memory
costs, and the training workload's step times with the planner's prediction of the same
workload next to each. `tflms results --from-json docs/results.json --gpu-bench FILE` keeps
that JSON (and optionally a run of the same benchmark over an earlier engine,
`--gpu-baseline`) under the results' `gpu_measured` key, and this module renders it.

Invariant: every figure printed here is read from the benchmark's JSON; nothing is computed
beyond ratios of two measured figures (or of a measured and a predicted one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tflms.planner.replay import LAUNCH_QUEUE_DEPTH
from tflms.planner.report import table
from tflms.planner.simulate import ASSUMED_MAP_US, ASSUMED_UNMAP_US

# The goal for the engine's copy streams against the card's pinned bandwidth.
COPY_GOAL = 0.85
SIZES = ("4MiB", "64MiB", "256MiB")
# Workload tables: JSON key prefix, title.
WORKLOADS = (
    ("bal_", "balanced (kernels 2/4 ms per layer), 3.2x"),
    ("link_", "link-bound (kernels 0.25/0.5 ms per layer), 3.2x"),
    ("sweep2x_", "balanced, 2x"),
    ("sweep4x_", "balanced, 4x"),
    ("sweep6x_", "balanced, 6x"),
    ("fine3x_", "fine-grained (128 layers of 64 MiB), 3x"),
)
MODES = (
    ("free_ondemand", "no pressure"),
    ("free_prefetch", "no pressure, prefetch on"),
    ("ondemand", "on demand"),
    ("prefetch", "prefetch"),
    ("fixed_ondemand", "fixed addresses, on demand"),
    ("fixed_prefetch", "fixed addresses, prefetch"),
)


def load_bench(path: Path) -> dict[str, Any]:
    """The benchmark's JSON, with the nvidia-smi line of its `-machine.txt` sibling and the
    test results of its `-tests.txt` and `-memcheck.txt` siblings, where they exist."""
    figures = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(figures, dict) or "device" not in figures:
        raise ValueError(f"{path} is not a cuda_bench JSON (no 'device')")
    out: dict[str, Any] = {"file": str(path), "figures": figures}
    machine = _sibling(path, "-machine.txt")
    if machine is not None:
        lines = machine.read_text(encoding="utf-8").splitlines()
        heads = [i for i, line in enumerate(lines) if line.startswith("name,")]
        if heads and heads[0] + 1 < len(lines):
            out["nvidia_smi"] = dict(
                zip(
                    [h.strip() for h in lines[heads[0]].split(",")],
                    [v.strip() for v in lines[heads[0] + 1].split(",")],
                    strict=False,
                )
            )
    tests = _sibling(path, "-tests.txt")
    if tests is not None:
        out["tests"] = read_test_log(tests, _sibling(path, "-memcheck.txt"))
    return out


def _sibling(path: Path, suffix: str) -> Path | None:
    other = path.with_name(path.name.replace("-bench.json", suffix))
    return other if other != path and other.exists() else None


def read_test_log(tests: Path, memcheck: Path | None) -> dict[str, Any]:
    """What `cuda_engine_test` printed: the names of the tests that passed and failed, and
    compute-sanitizer's error count where the same tests ran under memcheck."""
    passed: list[str] = []
    failed: list[str] = []
    for line in tests.read_text(encoding="utf-8").splitlines():
        name = line.split("]", 1)[-1].split(":", 1)[0].strip()
        if line.startswith("[ OK ]"):
            passed.append(name)
        elif line.startswith("[FAIL]"):
            failed.append(name)
    log: dict[str, Any] = {"passed": passed, "failed": failed, "memcheck_errors": None}
    if memcheck is not None:
        for line in memcheck.read_text(encoding="utf-8").splitlines():
            if "ERROR SUMMARY:" in line:
                log["memcheck_errors"] = int(line.split("ERROR SUMMARY:", 1)[1].split()[0])
    return log


def _tests_sentence(measured: dict[str, Any]) -> str:
    log = measured.get("tests")
    if not log or not (log["passed"] or log["failed"]):
        return ""
    total = len(log["passed"]) + len(log["failed"])
    verdict = (
        f"all {total} passed there"
        if not log["failed"]
        else f"{len(log['failed'])} of {total} FAILED there ({', '.join(log['failed'])})"
    )
    errors = log["memcheck_errors"]
    memcheck = (
        ""
        if errors is None
        else f", also under compute-sanitizer's memcheck ({errors} errors; the "
        "`-memcheck.txt` file beside it)"
    )
    return (
        f" The CUDA engine tests (`make cuda-test`: {'; '.join(log['passed'] + log['failed'])}; "
        f"every word checked): {verdict}{memcheck}."
    )


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _copy_rows(g: dict[str, Any]) -> tuple[list[list[str]], bool | None]:
    rows = []
    ok: bool | None = None
    for size in SIZES:
        out = g.get(f"engine_page_out_of_raw_{size}")
        into = g.get(f"engine_page_in_of_raw_{size}")
        if out is not None and into is not None:
            ok = (ok is not False) and min(out, into) >= COPY_GOAL
        rows.append(
            [
                size.replace("MiB", " MiB"),
                _f(g.get(f"raw_d2h_gbps_{size}"), "{:.1f}"),
                _f(g.get(f"raw_h2d_gbps_{size}"), "{:.1f}"),
                _f(g.get(f"raw_both_gbps_{size}"), "{:.1f}"),
                f"{_f(g.get(f'engine_page_out_gbps_{size}'), '{:.1f}')} ({_pct(out)})",
                f"{_f(g.get(f'engine_page_in_gbps_{size}'), '{:.1f}')} ({_pct(into)})",
                _f(g.get(f"engine_copy_wrong_words_{size}"), "{:.0f}"),
            ]
        )
    return rows, ok


def _workload_rows(g: dict[str, Any], base: dict[str, Any] | None, prefix: str) -> list[list[str]]:
    rows = []
    free = g.get(f"{prefix}free_ondemand_step_s")
    for key, name in MODES:
        step = g.get(f"{prefix}{key}_step_s")
        if step is None:
            continue
        planner = g.get(f"{prefix}{key}_planner_s")
        bound = g.get(f"{prefix}{key}_bound_s")
        row = [
            name,
            _f(step),
            _f(step / free if free else None, "{:.2f}x"),
            _f(planner),
            _f(planner / step - 1 if planner and step else None, "{:+.1%}"),
            _f(bound),
            _f(step / bound if bound and not key.startswith("free") else None, "{:.2f}x"),
            _f(g.get(f"{prefix}{key}_wrong"), "{:.0f}"),
        ]
        if base is not None:
            row.append(_f(base.get(f"{prefix}{key}_step_s")))
        rows.append(row)
    return rows


def gpu_markdown(measured: dict[str, Any]) -> list[str]:
    """The "Measured on a GPU" section of docs/results.md."""
    g: dict[str, Any] = measured["figures"]
    base: dict[str, Any] | None = (measured.get("baseline") or {}).get("figures")
    smi = measured.get("nvidia_smi", {})
    link = ""
    if smi.get("pcie.link.gen.current"):
        link = (
            f", PCIe gen {smi['pcie.link.gen.current']} x{smi.get('pcie.link.width.current', '?')}"
        )
    driver = f", driver {smi['driver_version']}" if smi.get("driver_version") else ""
    engine = f", running the engine at {measured['engine']}" if measured.get("engine") else ""
    lines = [
        "## Measured on a GPU",
        "",
        f"One {g['device']}{link}{driver}, lent for a few minutes{engine} "
        f"(`make bench-cuda`; the raw output is [{Path(measured['file']).name}]"
        f"(gpu/{Path(measured['file']).name}) and its neighbours in docs/gpu/). "
        f"These are measurements, not predictions.{_tests_sentence(measured)}",
        "",
        "### Copy bandwidth: the engine's copy streams against the card",
        "",
        "Raw: `cudaMemcpyAsync` between pinned host memory and the GPU on fresh streams, each "
        "direction alone and both at once (GB/s per direction). Engine: `ReclaimInactive` over "
        "4 GiB of buffers of that size (page-out) and pins that page them back in, through the "
        "engine's own streams; every word checked afterwards (*wrong*).",
        "",
    ]
    rows, copy_ok = _copy_rows(g)
    lines += [
        table(
            [
                "buffer",
                "raw D2H",
                "raw H2D",
                "raw both at once",
                "engine page-out (of raw)",
                "engine page-in (of raw)",
                "wrong",
            ],
            rows,
            markdown=True,
        ),
        "",
    ]
    all_s, longest = g.get("overlap_all_s"), g.get("overlap_all_over_longest")
    serial = sum(g.get(k, 0.0) for k in ("overlap_kernel_s", "overlap_d2h_s", "overlap_h2d_s"))
    lines += [
        "### Overlap",
        "",
        f"A {1000 * g.get('overlap_kernel_s', 0):.0f} ms kernel on the compute stream with "
        "2 GiB copied each way on the engine's two copy streams: kernel alone "
        f"{_f(g.get('overlap_kernel_s'))} s, device-to-host alone {_f(g.get('overlap_d2h_s'))} s, "
        f"host-to-device alone {_f(g.get('overlap_h2d_s'))} s, both copies at once "
        f"{_f(g.get('overlap_both_copies_s'))} s, all three at once {_f(all_s)} s "
        f"({_f(longest, '{:.2f}x')} the longest alone; {serial:.3f} s if serial).",
        "",
        "### CUDA virtual memory (the add-on's fixed-address mode)",
        "",
        f"Host time per {g.get('vmm_page_mib', 2):.0f} MiB page: map a new physical page "
        f"{_f(g.get('vmm_map_new_us'), '{:.1f}')} us, unmap {_f(g.get('vmm_unmap_us'), '{:.1f}')}"
        f" us, map a pooled page again {_f(g.get('vmm_remap_us'), '{:.1f}')} us (512 in one call: "
        f"{_f(g.get('vmm_bulk_map_us'), '{:.1f}')} us each). The planner's defaults for "
        f"`--fixed-addresses` are {ASSUMED_MAP_US:.0f} and {ASSUMED_UNMAP_US:.0f} us, this "
        "card's map and unmap as its first run measured them (23.6 and 16.8 us).",
        "",
    ]
    if g.get("launch_us") is not None:
        depth = g.get("launch_queue_depth", -1)
        blocked = (
            f"the host first blocked at launch {depth:.0f}"
            if depth and depth > 0
            else "the host never blocked"
        )
        lines += [
            "### Launch queue",
            "",
            f"Kernels of 200 us launched back to back: {g['launch_us']:.1f} us of host time per "
            f"launch while the queue filled, and {blocked}. The planner charges 5 us per op and "
            f"lets the host run {LAUNCH_QUEUE_DEPTH} kernels ahead.",
            "",
        ]
    lines += [
        "### Training workload: measured step time beside the planner's prediction",
        "",
        "core/tests/training_workload.h: 32 layers of 256 MiB activations and 32 MiB weights "
        "(9.5 GiB at the peak); forward ops read their weights and the previous activation, "
        "backward ops read the activation, the incoming gradient and the weights, write the "
        "gradient and update the weights in place; inputs stay pinned while the output is "
        "allocated and are freed once their last op was launched, as TensorFlow's executor "
        "does; kernels spin for the stated time and check every word they read. The device "
        "is the engine's memory limit, the factor is the peak over it. Step: median of steps "
        "3-6. *Planner*: the same workload replayed by the engine over the simulated device "
        "with this card's measured bandwidths, kernel times and map costs. *LB2*: the "
        "planner's lower bound for any swapping schedule of this workload.",
        "",
    ]
    headers = [
        "mode",
        "step s",
        "x no pressure",
        "planner s",
        "planner error",
        "LB2 s",
        "x LB2",
        "wrong",
    ]
    if base is not None:
        headers.append("engine before s")
    for prefix, title in WORKLOADS:
        rows = _workload_rows(g, base, prefix)
        if rows:
            lines += [f"**{title}**", "", table(headers, rows, markdown=True), ""]
    if g.get("long3x_prefetch_late_s") is not None:
        lines += [
            "**A long run** (balanced, 3x, 24 steps; median of steps 3-6 and of 21-24):",
            "",
        ]
        long_rows = []
        for key, name in (("ondemand", "on demand"), ("prefetch", "prefetch")):
            row = [
                name,
                _f(g.get(f"long3x_{key}_early_s")),
                _f(g.get(f"long3x_{key}_late_s")),
                _f(g.get(f"long3x_{key}_planner_late_s")),
            ]
            if base is not None:
                row += [
                    _f(base.get(f"long3x_{key}_early_s")),
                    _f(base.get(f"long3x_{key}_late_s")),
                ]
            long_rows.append(row)
        long_headers = ["mode", "steps 3-6 s", "steps 21-24 s", "planner 21-24 s"]
        if base is not None:
            long_headers += ["engine before: 3-6 s", "21-24 s"]
        lines += [table(long_headers, long_rows, markdown=True), ""]
    if base is not None:
        before = measured["baseline"].get("engine") or "an earlier engine"
        lines += [
            f"*engine before*: the same benchmark, in the same session, over {before} "
            f"([{Path(measured['baseline']['file']).name}]"
            f"(gpu/{Path(measured['baseline']['file']).name})).",
            "",
        ]
    goal = "met" if copy_ok else ("not met" if copy_ok is False else "-")
    lines += [
        f"Goal: the engine's copy streams at {COPY_GOAL:.0%} or more of the card's pinned "
        f"bandwidth in both directions: {goal}. Compute and both copy directions overlap: "
        f"{'yes' if longest is not None and longest <= 1.05 else 'no'}.",
        "",
    ]
    return lines


def attach(
    res: dict[str, Any],
    bench: Path,
    baseline: Path | None,
    engine: str | None = None,
    baseline_engine: str | None = None,
) -> dict[str, Any]:
    """`res` with the benchmark (and the baseline run) kept under `gpu_measured`.

    `engine` and `baseline_engine` say which engine each run measured (a commit, and why
    it is the one compared); the page prints them as given.
    """
    measured = load_bench(bench)
    if engine:
        measured["engine"] = engine
    if baseline is not None:
        measured["baseline"] = load_bench(baseline)
        if baseline_engine:
            measured["baseline"]["engine"] = baseline_engine
    res = dict(res)
    res["gpu_measured"] = measured
    return res


def section_if_measured(res: dict[str, Any]) -> Sequence[str]:
    return gpu_markdown(res["gpu_measured"]) if res.get("gpu_measured") else []
