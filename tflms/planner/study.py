"""The planner's fixed studies: `tflms demo`, `tflms results` and the GPU calibration."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tflms.planner.gpu import CALIBRATION, GIB, LINKS, GpuModel, get_gpu
from tflms.planner.replay import build_plan, replay_unlimited
from tflms.planner.simulate import (
    SIZE_STEP,
    Machine,
    max_batch,
    max_size,
    overhead_points,
    trace_json,
)

if TYPE_CHECKING:
    from tflms.trace.format import Trace

DEMO_MODEL = "ResNet50"
DEMO_BATCH = 32
DEMO_GPU = "v100-16gb"
DEMO_HOST_MEMORY = 128 * GIB  # TensorFlow's default TF_GPU_HOST_MEM_LIMIT_IN_MB
OVERHEAD_LINKS = ("pcie4", "pcie5")


@dataclasses.dataclass(frozen=True)
class StudyModel:
    name: str
    base_batch: int  # batch the trace is taken at (rescaled from there)
    input_size: int | None = None  # None: the model's default input
    searches_size: bool = False  # search the input size (3D models) instead of the batch


RESULT_MODELS = (
    StudyModel("ResNet50", 32),
    StudyModel("ResNet152", 16),
    StudyModel("DenseNet201", 16),
    StudyModel("InceptionV3", 32),
    StudyModel("UNet3D", 1, input_size=64, searches_size=True),
)

# (GPU model, host memory limit): TensorFlow's default host limit of 128 GiB for both.
RESULT_MACHINES = (("v100-16gb", 128 * GIB), ("a100-80gb", 128 * GIB))
BATCH_MULTIPLES = (2, 4, 6)


def links(names: tuple[str, ...] = OVERHEAD_LINKS) -> list[tuple[str, float]]:
    return [(n, LINKS[n]) for n in names]


def get_trace(model: str, batch: int, input_size: int | None = None) -> Trace:
    from tflms.trace.cache import cached_trace

    return cached_trace(model, batch, input_size=input_size)


def run_demo(base_batch: int = DEMO_BATCH, progress: bool = True, steps: int = 2) -> dict[str, Any]:
    """ResNet50 on a modelled 16 GiB GPU: largest batch without and with LMS, overhead at 4x."""
    start = time.monotonic()
    trace = get_trace(DEMO_MODEL, base_batch)
    machine = Machine(get_gpu(DEMO_GPU), "pcie4", LINKS["pcie4"], DEMO_HOST_MEMORY)
    mb = max_batch(trace, machine, steps=steps, rel_tol=0.01, progress=progress)
    batches = sorted({min(m * mb["without_lms"], mb["with_lms"]) for m in (4,)} - {0})
    rows = overhead_points(trace, machine, batches, links(), steps=steps, progress=progress)
    return {
        "model": DEMO_MODEL,
        "trace": trace_json(trace),
        "machine": machine.to_json(),
        "max_batch": mb,
        "overhead": rows,
        "wall_s": time.monotonic() - start,
    }


def study_batch_model(
    sm: StudyModel, machine: Machine, progress: bool, steps: int
) -> dict[str, Any]:
    trace = get_trace(sm.name, sm.base_batch, sm.input_size)
    mb = max_batch(trace, machine, steps=steps, rel_tol=0.01, progress=progress)
    batches = [
        m * mb["without_lms"] for m in BATCH_MULTIPLES if m * mb["without_lms"] <= mb["with_lms"]
    ]
    batches = [b for b in batches if b > 0]
    if not batches and mb["with_lms"] > mb["without_lms"] > 0:
        batches = [mb["with_lms"]]  # not even 2x fits: measure the largest that does
    rows = overhead_points(trace, machine, batches, links(), steps=steps, progress=progress)
    return {"trace": trace_json(trace), "max_batch": mb, "overhead": rows}


def study_size_model(
    sm: StudyModel, machine: Machine, progress: bool, steps: int
) -> dict[str, Any]:
    def trace_at(size: int) -> Trace:
        return get_trace(sm.name, sm.base_batch, size)

    ms = max_size(
        trace_at,
        machine,
        start_size=sm.input_size or 4 * SIZE_STEP,
        steps=steps,
        progress=progress,
    )
    rows: list[dict[str, Any]] = []
    if ms["with_lms"] > ms["without_lms"] > 0:
        rows = overhead_points(
            trace_at(ms["with_lms"]),
            machine,
            [sm.base_batch],
            links(),
            steps=steps,
            progress=progress,
        )
        for r in rows:
            r["input_size"] = ms["with_lms"]
    return {"max_size": ms, "overhead": rows}


def merge_results(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`old` with the studies of `new` replacing those of the same model and GPU."""
    fresh = {(s["model"], s["machine"]["gpu"]) for s in new["studies"]}
    kept = [s for s in old.get("studies", []) if (s["model"], s["machine"]["gpu"]) not in fresh]
    gpu_order = {g: i for i, (g, _) in enumerate(RESULT_MACHINES)}
    model_order = {m.name: i for i, m in enumerate(RESULT_MODELS)}

    def key(s: dict[str, Any]) -> tuple[int, int]:
        return gpu_order.get(s["machine"]["gpu"], 99), model_order.get(s["model"], 99)

    studies = sorted(kept + new["studies"], key=key)
    return {**new, "studies": studies, "wall_s": old.get("wall_s", 0.0) + new["wall_s"]}


def run_results(
    models: tuple[StudyModel, ...] = RESULT_MODELS,
    machines: tuple[tuple[str, int], ...] = RESULT_MACHINES,
    progress: bool = True,
    steps: int = 2,
    log: Callable[[str], None] = print,
    on_study: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every model on every machine. on_study(results so far) runs after each study."""
    start = time.monotonic()
    out: dict[str, Any] = {"studies": [], "calibration": run_calibration()}
    for gpu_name, host in machines:
        machine = Machine(get_gpu(gpu_name), "pcie4", LINKS["pcie4"], host)
        for sm in models:
            t0 = time.monotonic()
            log(f"{sm.name} on {gpu_name} ...")
            study = (
                study_size_model(sm, machine, progress, steps)
                if sm.searches_size
                else study_batch_model(sm, machine, progress, steps)
            )
            study.update(model=sm.name, machine=machine.to_json(), wall_s=time.monotonic() - t0)
            out["studies"].append(study)
            out["wall_s"] = time.monotonic() - start
            log(f"{sm.name} on {gpu_name}: {time.monotonic() - t0:.0f} s")
            if on_study is not None:
                on_study(out)
    out["wall_s"] = time.monotonic() - start
    return out


def modelled_throughput(trace: Trace, gpu: GpuModel) -> float:
    """Samples per second of the unlimited-memory step on `gpu`."""
    plan = build_plan(trace, gpu)
    r = replay_unlimited(plan, gpu, 24.0, steps=2)
    return trace.batch_size / r.step_time_s


def _bisect(f: Callable[[float], float], lo: float, hi: float, target: float) -> float:
    """x in [lo, hi] with f(x) == target for f increasing in x."""
    for _ in range(50):
        mid = (lo + hi) / 2
        if f(mid) > target:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def kernel_seconds(trace: Trace, gpu: GpuModel) -> float:
    return sum(gpu.op_seconds(op.flops, op.bytes_accessed) for op in trace.ops)


def fit_memory_traffic(trace: Trace, gpu: GpuModel, target_per_s: float) -> float:
    """The memory-traffic share at which the modelled kernel time gives `target_per_s`.

    Kernel time alone is fitted: launch costs overlap with kernels at these batch sizes.
    """
    target_s = trace.batch_size / target_per_s
    return _bisect(
        lambda x: kernel_seconds(trace, dataclasses.replace(gpu, memory_traffic=x)),
        1e-3,
        4.0,
        target_s,
    )


def fit_compute_efficiency(trace: Trace, gpu: GpuModel, target_per_s: float) -> float:
    """The compute efficiency at which the modelled kernel time gives `target_per_s`."""
    target_s = trace.batch_size / target_per_s
    # Kernel time falls as efficiency rises: bisect on its negative.
    return _bisect(
        lambda x: -kernel_seconds(trace, dataclasses.replace(gpu, compute_efficiency=x)),
        1e-3,
        1.0,
        -target_s,
    )


def run_calibration(fit: bool = False) -> list[dict[str, Any]]:
    """Modelled vs published ResNet50 throughput per calibrated GPU.

    fit: also fit, in order, the memory-traffic share on the first GPU (its compute
    efficiency assumed) and then the compute efficiency of the others.
    """
    rows = []
    base = get_trace(DEMO_MODEL, DEMO_BATCH)
    for i, (name, cal) in enumerate(CALIBRATION.items()):
        gpu = get_gpu(name)
        trace = base.rescaled(cal.batch_size)
        row: dict[str, Any] = {
            "gpu": name,
            "model": cal.model,
            "batch_size": cal.batch_size,
            "published_per_s": cal.images_per_s,
            "precision": cal.precision,
            "source": cal.source,
            "peak_tflops": gpu.peak_tflops,
            "mem_gbps": gpu.mem_gbps,
            "compute_efficiency": gpu.compute_efficiency,
            "memory_efficiency": gpu.memory_efficiency,
            "memory_traffic": gpu.memory_traffic,
            "modelled_per_s": modelled_throughput(trace, gpu),
            "flops_per_sample": sum(op.flops for op in trace.ops) / trace.batch_size,
            "bytes_per_sample": sum(op.bytes_accessed for op in trace.ops) / trace.batch_size,
        }
        if fit and i == 0:
            row["fitted_memory_traffic"] = fit_memory_traffic(trace, gpu, cal.images_per_s)
        elif fit:
            row["fitted_compute_efficiency"] = fit_compute_efficiency(trace, gpu, cal.images_per_s)
        rows.append(row)
    return rows
