"""The planner's questions, answered by replays: does it fit, how much slower, how far can it go.

Everything here returns plain dicts ready for JSON; report.py formats them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tflms.planner.gpu import GpuModel
from tflms.planner.replay import (
    EngineConfig,
    ReplayResult,
    StepPlan,
    build_plan,
    peak_live_bytes,
    replay,
    replay_unlimited,
    swap_bound_s,
)
from tflms.planner.search import SearchResult, largest_fitting

if TYPE_CHECKING:
    from tflms.trace.format import Trace

# Input sizes of 3D models are searched in multiples of this (U-Net pooling depth).
SIZE_STEP = 16


@dataclasses.dataclass(frozen=True)
class Machine:
    """A modelled GPU on a host link, with a host memory limit for reclaimed bytes.

    prefetch_lookahead / prefetch_budget: the engine's prefetch knobs (0 budget: the
    engine's default of 1/8 of the GPU memory).
    """

    gpu: GpuModel
    link_name: str
    link_gbps: float
    host_memory: int
    prefetch_lookahead: int = 256
    prefetch_budget: int = 0

    def config(
        self, *, lms: bool = True, prefetch: bool = True, defrag: bool = False
    ) -> EngineConfig:
        return EngineConfig(
            device_memory=self.gpu.memory_bytes,
            host_memory=self.host_memory,
            link_gbps=self.link_gbps,
            lms=lms,
            prefetch=prefetch,
            defrag=defrag,
            prefetch_lookahead=self.prefetch_lookahead,
            prefetch_budget=self.prefetch_budget,
        )

    def on_link(self, link_name: str, link_gbps: float) -> Machine:
        return dataclasses.replace(self, link_name=link_name, link_gbps=link_gbps)

    def to_json(self) -> dict[str, Any]:
        g = self.gpu
        return {
            "gpu": g.name,
            "memory_bytes": g.memory_bytes,
            "effective_tflops": g.flops_per_s / 1e12,
            "effective_mem_gbps": g.bytes_per_s / 1e9,
            "launch_overhead_us": g.launch_overhead_us,
            "link": self.link_name,
            "link_gbps": self.link_gbps,
            "host_memory_bytes": self.host_memory,
        }


class NullBar:
    """Stands in for a tqdm bar when progress is off."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(desc: str, total: int | None, enabled: bool, unit: str = "op") -> Any:
    if not enabled:
        return NullBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False, dynamic_ncols=True)


def trace_json(trace: Trace) -> dict[str, Any]:
    return {
        "model": trace.model,
        "batch_size": trace.batch_size,
        "input_shape": list(trace.input_shape),
        "dtype": trace.dtype,
        "ops": len(trace.ops),
        "tensors": len(trace.tensors),
        "tensorflow_version": trace.tensorflow_version,
    }


def lms_json(result: ReplayResult, unlimited_s: float, plan: StepPlan) -> dict[str, Any]:
    out = result.to_json()
    out["label"] = result.config.label()
    if result.fits:
        roof = result.roofline_s(unlimited_s)
        cfg = result.config
        # The bound is computed on kernel time; launch costs come on top of both.
        bound = swap_bound_s(plan, cfg.device_memory, cfg.link_gbps) + max(
            0.0, unlimited_s - plan.compute_s
        )
        out["overhead"] = result.step_time_s / unlimited_s - 1 if unlimited_s > 0 else 0.0
        out["roofline_s"] = roof
        out["roofline_ratio"] = result.step_time_s / roof if roof > 0 else 1.0
        out["swap_bound_s"] = bound
        out["swap_bound_ratio"] = result.step_time_s / bound if bound > 0 else 1.0
        out["page_in_stall_s"] = result.step_stats.get("page_in_stall_ns", 0) * 1e-9
    return out


def simulate_step(
    trace: Trace,
    machine: Machine,
    *,
    steps: int = 2,
    prefetch: bool = True,
    defrag: bool = False,
    compare: bool = True,
    record: bool = False,
    progress: bool = False,
) -> tuple[dict[str, Any], ReplayResult | None]:
    """Fit and step time at the trace's batch. Returns the report and the recorded LMS replay.

    compare: also replay the other LMS variants (on-demand paging, prefetch,
    prefetch + defragmentation) so the report shows what each buys.
    """
    plan = build_plan(trace, machine.gpu)
    variants = [(prefetch, defrag)]
    if compare:
        for v in ((False, False), (True, False), (True, True)):
            if v not in variants:
                variants.append(v)
    bar = progress_bar(
        f"simulate {trace.model} batch {trace.batch_size}",
        total=(2 + len(variants)) * steps * len(plan.inputs),
        enabled=progress,
    )
    try:
        unlimited = replay_unlimited(plan, machine.gpu, machine.link_gbps, steps=steps)
        bar.update(steps * len(plan.inputs))
        no_lms = replay(plan, machine.gpu, machine.config(lms=False), steps=steps)
        bar.update(steps * len(plan.inputs))
        runs: list[ReplayResult] = []
        recorded: ReplayResult | None = None
        for i, (pf, df) in enumerate(variants):
            r = replay(
                plan,
                machine.gpu,
                machine.config(prefetch=pf, defrag=df),
                steps=steps,
                record=record and i == 0,
                on_op=None,
            )
            bar.update(steps * len(plan.inputs))
            runs.append(r)
            if i == 0:
                recorded = r
    finally:
        bar.close()
    unlimited_s = unlimited.step_time_s
    report: dict[str, Any] = {
        "trace": trace_json(trace),
        "batch_size": trace.batch_size,
        "machine": machine.to_json(),
        "steps": steps,
        "without_lms": {
            "peak_bytes_in_use": unlimited.stats.get("peak_bytes_in_use", 0),
            "peak_live_bytes": peak_live_bytes(plan),
            "fits": no_lms.fits,
            "oom_message": no_lms.oom_message,
            "step_time_s": no_lms.step_time_s if no_lms.fits else None,
        },
        "unlimited": {
            "step_time_s": unlimited_s,
            "compute_time_s": plan.compute_s,
            "samples_per_s": trace.batch_size / unlimited_s if unlimited_s > 0 else 0.0,
        },
        "lms": [lms_json(r, unlimited_s, plan) for r in runs],
    }
    return report, recorded


def _fits(
    plan: StepPlan, machine: Machine, lms: bool, prefetch: bool, defrag: bool, steps: int
) -> bool:
    return replay(
        plan, machine.gpu, machine.config(lms=lms, prefetch=prefetch, defrag=defrag), steps=steps
    ).fits


def search_monotone(probes: list[list[Any]]) -> bool:
    """False when a probe fit above one that did not (fragmentation makes fitting uneven)."""
    smallest_fail = min((n for n, ok in probes if not ok), default=None)
    return smallest_fail is None or all(n < smallest_fail for n, ok in probes if ok)


def search_json(r: SearchResult) -> dict[str, Any]:
    return {
        "largest": r.largest,
        "probes": [[n, ok] for n, ok in r.probes],
        "hit_limit": r.hit_limit,
    }


def max_batch(
    trace: Trace,
    machine: Machine,
    *,
    prefetch: bool = True,
    defrag: bool = False,
    steps: int = 2,
    limit: int = 1 << 16,
    rel_tol: float = 0.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Largest batch without LMS and with LMS (at machine.host_memory), by rescaling the trace.

    rel_tol: accept an answer within this fraction of the true largest (fewer replays).
    """
    if not any(t.batch_scaled for t in trace.tensors):
        raise ValueError(
            f"the {trace.model} trace has no batch-scaled tensors: --max-batch needs a trace "
            "whose tensors record batch_scaled"
        )
    plans: dict[int, StepPlan] = {}

    def plan_for(batch: int) -> StepPlan:
        if batch not in plans:
            t = trace if batch == trace.batch_size else trace.rescaled(batch)
            plans.clear()  # one at a time: large traces are big
            plans[batch] = build_plan(t, machine.gpu)
        return plans[batch]

    # Live bytes grow linearly with the batch: two plans give the line, which gives a
    # first guess without LMS and, with LMS, a batch that cannot fit (device and host
    # together cannot hold what the step keeps alive).
    b1 = max(1, trace.batch_size)
    p1 = peak_live_bytes(plan_for(b1))
    p2 = peak_live_bytes(plan_for(2 * b1))
    per_sample = max(1.0, (p2 - p1) / b1)
    fixed = max(0.0, p1 - per_sample * b1)
    guess = max(1, int((machine.gpu.memory_bytes - fixed) / per_sample))
    total = machine.gpu.memory_bytes + machine.host_memory
    host_bound = max(2, int((total - fixed) / per_sample) + 1)

    out: dict[str, Any] = {}
    for key, lms in (("without_lms", False), ("with_lms", True)):
        bar = progress_bar(f"max batch {'with' if lms else 'without'} LMS", None, progress, "probe")

        def on_probe(n: int, ok: bool, bar: Any = bar) -> None:
            bar.update(1)
            bar.set_postfix_str(f"batch {n}: {'fits' if ok else 'OOM'}")

        def fits(n: int, lms: bool = lms) -> bool:
            return _fits(plan_for(n), machine, lms, prefetch, defrag, steps)

        known = out["without_lms"] if lms else 0
        fail: int | None = None
        start = guess
        if lms:
            fail = host_bound if host_bound > known + 1 else None
            start = (known + host_bound) // 2 if fail else 2 * max(1, known)
        try:
            r = largest_fitting(
                fits,
                max(1, start),
                known_fit=known,
                known_fail=fail,
                limit=limit,
                rel_tol=rel_tol,
                on_probe=on_probe,
            )
        finally:
            bar.close()
        out[key] = r.largest
        out.setdefault("search", {})[key] = search_json(r)
    out["ratio"] = out["with_lms"] / out["without_lms"] if out["without_lms"] else None
    out["monotone"] = all(
        search_monotone(out["search"][k]["probes"]) for k in ("without_lms", "with_lms")
    )
    out["host_memory_bytes"] = machine.host_memory
    out["lms_config"] = machine.config(prefetch=prefetch, defrag=defrag).label()
    out["rel_tol"] = rel_tol
    return out


def max_size(
    trace_at: Callable[[int], Trace],
    machine: Machine,
    *,
    start_size: int,
    prefetch: bool = True,
    defrag: bool = False,
    steps: int = 2,
    limit_size: int = 1024,
    progress: bool = False,
) -> dict[str, Any]:
    """Largest input size (cube edge, multiple of SIZE_STEP) without and with LMS.

    trace_at(size) traces the model at that input size (at the trace's batch).
    """

    def fits_at(lms: bool) -> Callable[[int], bool]:
        def fits(k: int) -> bool:
            plan = build_plan(trace_at(k * SIZE_STEP), machine.gpu)
            return _fits(plan, machine, lms, prefetch, defrag, steps)

        return fits

    out: dict[str, Any] = {"step": SIZE_STEP}
    start_k = max(1, start_size // SIZE_STEP)
    for key, lms in (("without_lms", False), ("with_lms", True)):
        bar = progress_bar(f"max size {'with' if lms else 'without'} LMS", None, progress, "probe")

        def on_probe(k: int, ok: bool, bar: Any = bar) -> None:
            bar.update(1)
            bar.set_postfix_str(f"size {k * SIZE_STEP}: {'fits' if ok else 'OOM'}")

        known = out["without_lms"] // SIZE_STEP if lms else 0
        try:
            r = largest_fitting(
                fits_at(lms),
                start_k if not known else known + 1,
                known_fit=known,
                limit=max(1, limit_size // SIZE_STEP),
                on_probe=on_probe,
            )
        finally:
            bar.close()
        out[key] = r.largest * SIZE_STEP
        s = search_json(r)
        s["probes"] = [[n * SIZE_STEP, ok] for n, ok in r.probes]
        out.setdefault("search", {})[key] = s
    w, m = out["without_lms"], out["with_lms"]
    out["voxel_ratio"] = (m / w) ** 3 if w else None
    out["host_memory_bytes"] = machine.host_memory
    return out


def overhead_points(
    trace: Trace,
    machine: Machine,
    batches: Sequence[int],
    links: Sequence[tuple[str, float]],
    *,
    steps: int = 2,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Step-time overhead of LMS (on-demand and prefetch) at each batch on each link."""
    rows: list[dict[str, Any]] = []
    total = len(batches) * (1 + 2 * len(links))
    bar = progress_bar("overhead", total, progress, "replay")
    try:
        for batch in batches:
            t = trace if batch == trace.batch_size else trace.rescaled(batch)
            plan = build_plan(t, machine.gpu)
            unlimited = replay_unlimited(plan, machine.gpu, machine.link_gbps, steps=steps)
            bar.update(1)
            for link_name, gbps in links:
                m = machine.on_link(link_name, gbps)
                for prefetch in (False, True):
                    bar.set_postfix_str(f"batch {batch} {link_name} prefetch={prefetch}")
                    r = replay(plan, m.gpu, m.config(prefetch=prefetch), steps=steps)
                    bar.update(1)
                    row = lms_json(r, unlimited.step_time_s, plan)
                    row.update(
                        batch_size=batch,
                        link=link_name,
                        link_gbps=gbps,
                        prefetch=prefetch,
                        unlimited_step_time_s=unlimited.step_time_s,
                    )
                    rows.append(row)
    finally:
        bar.close()
    return rows
