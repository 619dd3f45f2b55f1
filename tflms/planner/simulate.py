"""The planner's questions, answered by replays: does it fit, how much slower, how far can it go.

Everything here returns plain dicts ready for JSON; report.py formats them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tflms.planner.behind import behind_ideal, behind_json
from tflms.planner.gpu import GpuModel
from tflms.planner.host import HostSide
from tflms.planner.machines import Pairing, get_pairing, real_pairing
from tflms.planner.placed import DEFAULT_SLACKS, PlacedIdeal, placed_ideal
from tflms.planner.replay import (
    DEFAULT_LOOKAHEAD,
    LAUNCH_QUEUE_DEPTH,
    LAYOUT_LOOK_NS_PER_EVENT,
    LAYOUT_LOOK_NS_PER_RANGE,
    PATCH_RUN_AHEAD_EPOCHS,
    EngineConfig,
    ReplayResult,
    StepPlan,
    build_plan,
    peak_live_bytes,
    replay,
    replay_unlimited,
    swap_bound_s,
)
from tflms.planner.search import SearchResult, largest_fitting, largest_without_holes
from tflms.planner.unfragmented import unfragmented_run
from tflms.planner.yardsticks import Yardsticks, annotate, yardsticks

if TYPE_CHECKING:
    from tflms.trace.format import Trace

# Input sizes of 3D models are searched in multiples of this (U-Net pooling depth).
SIZE_STEP = 16
# Host time per 2 MiB page of the add-on's fixed-address mode: one map is a cuMemMap
# (of a pooled physical page) plus its share of one cuMemSetAccess per run of pages, one
# unmap a cuMemUnmap. Measured on an H200 with driver 580.159 (bench/cuda_bench.cu, table 4;
# docs/gpu/h200-2026-11-26-bench.txt): 23.6 us and 16.8 us.
ASSUMED_MAP_US = 24.0
ASSUMED_UNMAP_US = 17.0


@dataclasses.dataclass(frozen=True)
class FixedPages:
    """Fixed-address mode as the add-on runs it: pages behind fixed addresses.

    The map and unmap costs are assumptions (host time per page of driver calls:
    cuMemMap + cuMemSetAccess, cuMemUnmap) until a GPU measures them.
    """

    page_size: int = 2 << 20  # CUDA's mapping granularity
    map_us_per_page: float = ASSUMED_MAP_US
    unmap_us_per_page: float = ASSUMED_UNMAP_US


@dataclasses.dataclass(frozen=True)
class Machine:
    """A modelled GPU on a host link, with a host memory limit for reclaimed bytes.

    host_memory: the bytes LMS may fill on the host for this GPU (host_side.lms_bytes
    when the host side is modelled). pairing: the real machine this is (machines.py),
    None for a what-if; what_if: what was changed from a real machine, in words.
    prefetch_lookahead / prefetch_budget: the engine's prefetch knobs (0 budget: the
    engine's default of 1/8 of the GPU memory). launch_queue_depth: how far the host may
    run ahead of the GPU, in kernels (replay.LAUNCH_QUEUE_DEPTH; 0: without bound).
    """

    gpu: GpuModel
    link_name: str
    link_gbps: float
    host_memory: int
    prefetch_lookahead: int = DEFAULT_LOOKAHEAD
    prefetch_budget: int = 0
    launch_queue_depth: int = LAUNCH_QUEUE_DEPTH
    host_side: HostSide | None = None
    pairing: str | None = None
    what_if: tuple[str, ...] = ()
    # The add-on's fixed-address mode (None: the patch's mode, buffers move).
    fixed: FixedPages | None = None
    # The engine's host throttle with prefetch (EngineOptions::run_ahead_epochs,
    # TF_LMS_RUN_AHEAD_EPOCHS; 0: off).
    run_ahead_epochs: int = PATCH_RUN_AHEAD_EPOCHS
    # Experimental, not set by the patch (EngineOptions::layout_lookahead): with prefetch,
    # the step plan's copies in placed by a look-ahead over the learned step; its host
    # time charged at `layout_look_cost` times the rates measured on the planner's machine
    # (replay.LAYOUT_LOOK_NS_PER_EVENT / _PER_RANGE; 0: free).
    layout_lookahead: bool = False
    layout_look_cost: float = 1.0

    @classmethod
    def from_pairing(cls, pairing: Pairing, host: HostSide | None = None) -> Machine:
        side = host if host is not None else pairing.host()
        return cls(
            pairing.gpu_model,
            pairing.link,
            pairing.link_gbps,
            side.lms_bytes,
            host_side=side,
            pairing=pairing.name,
        )

    @property
    def hypothetical(self) -> bool:
        return self.pairing is None or bool(self.what_if)

    def with_card_memory(self) -> Machine:
        """The what-if where TensorFlow's allocator gets the card's whole memory."""
        gpu, what = self.gpu.whole_card()
        return dataclasses.replace(self, gpu=gpu, what_if=(*self.what_if, what))

    def config(
        self, *, lms: bool = True, prefetch: bool = False, defrag: bool = False
    ) -> EngineConfig:
        # Paging on demand unless prefetch is asked for: prefetch, the patch's default,
        # learns the step there (docs/planner.md). The add-on with LMS off hands TensorFlow
        # its own allocator (docs/addon.md), so fixed addresses apply with LMS only.
        return EngineConfig(
            device_memory=self.gpu.memory_bytes,
            host_memory=self.host_memory,
            link_gbps=self.link_gbps,
            lms=lms,
            prefetch=prefetch,
            defrag=defrag,
            prefetch_lookahead=self.prefetch_lookahead,
            prefetch_budget=self.prefetch_budget,
            launch_queue_depth=self.launch_queue_depth,
            run_ahead_epochs=self.run_ahead_epochs,
            layout_lookahead=self.layout_lookahead and prefetch,
            layout_look_ns_per_event=LAYOUT_LOOK_NS_PER_EVENT * self.layout_look_cost,
            layout_look_ns_per_range=LAYOUT_LOOK_NS_PER_RANGE * self.layout_look_cost,
            **(
                {
                    "fixed_addresses": True,
                    "page_size": self.fixed.page_size,
                    "map_us_per_page": self.fixed.map_us_per_page,
                    "unmap_us_per_page": self.fixed.unmap_us_per_page,
                }
                if self.fixed is not None and lms
                else {}
            ),
        )

    def on_link(self, link_name: str, link_gbps: float) -> Machine:
        pairing = real_pairing(self.gpu.name, link_name)
        return dataclasses.replace(
            self,
            link_name=link_name,
            link_gbps=link_gbps,
            pairing=pairing.name if pairing else None,
        )

    def with_host(self, host: HostSide) -> Machine:
        return dataclasses.replace(self, host_side=host, host_memory=host.lms_bytes)

    def to_json(self) -> dict[str, Any]:
        g = self.gpu
        out: dict[str, Any] = {
            "gpu": g.name,
            "memory_bytes": g.memory_bytes,
            "card_bytes": g.card_bytes,
            "effective_tflops": g.flops_per_s / 1e12,
            "effective_mem_gbps": g.bytes_per_s / 1e9,
            "launch_overhead_us": g.launch_overhead_us,
            "link": self.link_name,
            "link_gbps": self.link_gbps,
            "host_memory_bytes": self.host_memory,
            "pairing": self.pairing,
            "hypothetical": self.hypothetical,
            "what_if": list(self.what_if),
        }
        if self.pairing is not None:
            out["description"] = get_pairing(self.pairing).description
        if self.host_side is not None:
            out["host"] = self.host_side.to_json()
        return out


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


def lms_json(
    result: ReplayResult, unlimited_s: float, plan: StepPlan, ys: Yardsticks | None = None
) -> dict[str, Any]:
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
    if ys is not None:
        annotate(out, ys)
    return out


def _schedule_on(machine: Machine) -> dict[str, Any]:
    """What the offline schedules (yardsticks.py, placed.py) take of the machine."""
    cfg = machine.config()
    return {
        "device_memory": cfg.device_memory,
        "link_gbps": cfg.link_gbps,
        "launch_s": machine.gpu.launch_overhead_us * 1e-6,
        "latency_s": cfg.link_latency_us * 1e-6,
        "launch_queue_depth": cfg.launch_queue_depth,
    }


def machine_yardsticks(plan: StepPlan, machine: Machine, steps: int) -> Yardsticks:
    """LB2 and the Ideal schedule for this plan on this machine (yardsticks.py)."""
    return yardsticks(plan, steps=steps, host_limit=machine.host_memory, **_schedule_on(machine))


def machine_placed_ideal(
    plan: StepPlan, machine: Machine, steps: int, progress: bool = False
) -> PlacedIdeal:
    """The in-order Ideal placed with addresses on this machine (placed.py)."""
    bar = progress_bar("placing the ideal schedule", len(DEFAULT_SLACKS), progress, "slack")
    try:
        return placed_ideal(
            plan,
            device_copy_gbps=machine.gpu.device_copy_gbps,
            steps=steps,
            on_slack=lambda: bar.update(1),
            **_schedule_on(machine),
        )
    finally:
        bar.close()


def simulate_step(
    trace: Trace,
    machine: Machine,
    *,
    steps: int = 2,
    prefetch: bool = False,
    defrag: bool = False,
    compare: bool = True,
    record: bool = False,
    progress: bool = False,
    behind: bool = False,
    placed: bool = False,
    unfragmented: bool = False,
) -> tuple[dict[str, Any], ReplayResult | None]:
    """Fit and step time at the trace's batch. Returns the report and the recorded LMS replay.

    compare: also replay the other LMS variants (on-demand paging, as the patched
    TensorFlow runs with prefetch off, with defragmentation, and the engine's prefetch,
    TensorFlow's default with LMS on) so the report shows what each buys.
    behind: also say where in the step the chosen variant falls behind the Ideal schedule,
    stretch by stretch (behind.py; the report's "behind_ideal", absent where either does
    not fit).
    placed: also place the in-order Ideal with addresses (placed.py; the report's
    "placed_ideal", absent where the Ideal does not fit).
    unfragmented: also replay the chosen variant with the engine's addresses taken out
    (unfragmented.py; the report's "unfragmented").
    """
    record = record or behind
    plan = build_plan(trace, machine.gpu)
    variants = [(prefetch, defrag)]
    if compare:
        for v in ((False, False), (False, True), (True, False)):
            if v not in variants:
                variants.append(v)
    bar = progress_bar(
        f"simulate {trace.model} batch {trace.batch_size}",
        total=(2 + len(variants)) * steps * len(plan.inputs),
        enabled=progress,
    )
    try:
        unlimited = replay_unlimited(
            plan,
            machine.gpu,
            machine.link_gbps,
            steps=steps,
            launch_queue_depth=machine.launch_queue_depth,
        )
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
                timed=True,
            )
            bar.update(steps * len(plan.inputs))
            runs.append(r)
            if i == 0:
                recorded = r
    finally:
        bar.close()
    unlimited_s = unlimited.step_time_s
    ys = machine_yardsticks(plan, machine, steps)
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
        "lms": [lms_json(r, unlimited_s, plan, ys) for r in runs],
    }
    if unfragmented:
        report["unfragmented"] = unfragmented_run(plan, machine.gpu, runs[0], ys, steps).to_json()
    if placed and ys.ideal_in_order.fits:
        report["placed_ideal"] = machine_placed_ideal(plan, machine, steps, progress).to_json()
    if behind and recorded is not None and recorded.fits and ys.ideal.fits:
        samples = recorded.samples
        parts = behind_ideal(
            [s.t for s in samples],
            [s.stall for s in samples],
            ys.ideal.op_end_s,
            plan.names,
            engine_links=([s.d2h_busy for s in samples], [s.h2d_busy for s in samples]),
            ideal_links=(ys.ideal.d2h_busy_to_op_s, ys.ideal.h2d_busy_to_op_s),
        )
        report["behind_ideal"] = behind_json(parts, recorded.config.label())
    return report, recorded


def _fits(
    plan: StepPlan, machine: Machine, lms: bool, prefetch: bool, defrag: bool, steps: int
) -> bool:
    return _attempt(plan, machine, lms, prefetch, defrag, steps).fits


def _attempt(
    plan: StepPlan, machine: Machine, lms: bool, prefetch: bool, defrag: bool, steps: int
) -> ReplayResult:
    return replay(
        plan, machine.gpu, machine.config(lms=lms, prefetch=prefetch, defrag=defrag), steps=steps
    )


# The engine's message when the host pool, not the device, refused a page-out.
HOST_POOL_FULL = "host memory pool is full"


def limit_of(oom_message: str) -> str:
    """'host' when an out-of-memory error came from the pinned host pool, else 'gpu'."""
    return "host" if HOST_POOL_FULL in oom_message or "TF_GPU_HOST_MEM" in oom_message else "gpu"


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


# Steps a largest batch (or input size) with LMS must run before it is reported. The
# searches probe over two steps, but at the host's edge the layout the engine reaches
# can fill the host side later: InceptionV3 at 687 on the DGX-1 (two steps: fits) ran
# out of host memory in step 8 with on-demand paging, as a long training run would.
CONFIRM_STEPS = 20


def confirm_largest(
    fits_for: Callable[[int, int], ReplayResult],
    largest: int,
    floor: int,
    steps: int,
    next_down: Callable[[int], int],
) -> tuple[int, list[list[Any]]]:
    """The largest answer at or below `largest` that runs `steps` steps.

    fits_for(n, steps) replays n; next_down(n) is the next candidate below n. Returns the
    answer and the candidates that failed, each as [n, out-of-memory message]. `floor`
    (known to fit, e.g. the largest without LMS) is returned unreplayed if reached.

    Stepping down by next_down skips the candidates between the last one that failed and
    the first that runs; those are then bisected, so the answer is the largest that runs
    below the failure rather than up to one step short of it. Every answer has run `steps`
    steps (or is `floor`); above it only candidates that failed were tried.
    """
    failed: list[list[Any]] = []
    n = largest
    while n > floor:
        r = fits_for(n, steps)
        if r.fits:
            break
        failed.append([n, r.oom_message])
        n = max(floor, next_down(n))
    above = failed[-1][0] if failed else n + 1
    while above - n > 1:
        mid = (n + above) // 2
        r = fits_for(mid, steps)
        if r.fits:
            n = mid
        else:
            failed.append([mid, r.oom_message])
            above = mid
    return n, failed


def max_batch(
    trace: Trace,
    machine: Machine,
    *,
    prefetch: bool = False,
    defrag: bool = False,
    steps: int = 2,
    limit: int = 1 << 16,
    rel_tol: float = 0.0,
    progress: bool = False,
    without_lms: int | None = None,
    hole_grid: int = 10,
    confirm_steps: int = CONFIRM_STEPS,
) -> dict[str, Any]:
    """Largest batch without LMS and with LMS (at machine.host_memory), by rescaling the trace.

    rel_tol: accept an answer within this fraction of the true largest (fewer replays).
    hole_grid: batches probed below the bisected answer, 1% of it apart; the answer
    reported has no failing probe at or below it (search.largest_without_holes).
    without_lms: the largest batch without LMS when already known (it does not depend
    on the host), so that only the LMS search runs.
    confirm_steps: the batch reported with LMS runs this many steps (confirm_largest);
    the search's own probes run `steps`.
    `limited_by` says what stops the LMS batch: 'host' (the pinned pool is full) or 'gpu'.
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
    searches = (("without_lms", False), ("with_lms", True))
    if without_lms is not None:
        out["without_lms"] = without_lms
        out["search"] = {"without_lms": {"largest": without_lms, "probes": [], "hit_limit": False}}
        searches = (("with_lms", True),)
    lms_failures: dict[int, str] = {}  # batch -> out-of-memory message, with LMS
    for key, lms in searches:
        bar = progress_bar(f"max batch {'with' if lms else 'without'} LMS", None, progress, "probe")

        def on_probe(n: int, ok: bool, bar: Any = bar) -> None:
            bar.update(1)
            bar.set_postfix_str(f"batch {n}: {'fits' if ok else 'OOM'}")

        def fits(n: int, lms: bool = lms) -> bool:
            r = _attempt(plan_for(n), machine, lms, prefetch, defrag, steps)
            if lms and not r.fits:
                lms_failures[n] = r.oom_message
            return r.fits

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
            r = largest_without_holes(
                fits,
                r,
                floor=known,
                grid_points=hole_grid,
                rel_tol=rel_tol,
                on_probe=on_probe,
            )
        finally:
            bar.close()
        out[key] = r.largest
        out.setdefault("search", {})[key] = search_json(r)
        if lms and confirm_steps > steps:
            out[key], failed = confirm_largest(
                lambda n, st: _attempt(plan_for(n), machine, True, prefetch, defrag, st),
                r.largest,
                known,
                confirm_steps,
                lambda n: n - max(1, int(n * max(rel_tol, 0.01))),
            )
            for n, message in failed:
                lms_failures[n] = message
            out["search"][key]["confirm"] = {
                "steps": confirm_steps,
                "failed": [n for n, _ in failed],
                "largest": out[key],
            }
    out["ratio"] = out["with_lms"] / out["without_lms"] if out["without_lms"] else None
    out["monotone"] = all(
        search_monotone(out["search"][k]["probes"]) for k in ("without_lms", "with_lms")
    )
    # The smallest batch seen to fail says what stopped the search. A bound that was never
    # probed is the capacity bound: device and host together cannot hold the step.
    first_fail = min((n for n in lms_failures if n > out["with_lms"]), default=None)
    out["limited_by"] = limit_of(lms_failures[first_fail]) if first_fail else "host"
    if out["search"]["with_lms"]["hit_limit"]:
        out["limited_by"] = "search limit"
    out["host_memory_bytes"] = machine.host_memory
    out["lms_config"] = machine.config(prefetch=prefetch, defrag=defrag).label()
    out["rel_tol"] = rel_tol
    return out


def max_size(
    trace_at: Callable[[int], Trace],
    machine: Machine,
    *,
    start_size: int,
    prefetch: bool = False,
    defrag: bool = False,
    steps: int = 2,
    limit_size: int = 1024,
    progress: bool = False,
    confirm_steps: int = CONFIRM_STEPS,
) -> dict[str, Any]:
    """Largest input size (cube edge, multiple of SIZE_STEP) without and with LMS.

    trace_at(size) traces the model at that input size (at the trace's batch). The size
    reported with LMS runs confirm_steps steps (confirm_largest).
    """

    out: dict[str, Any] = {"step": SIZE_STEP}
    start_k = max(1, start_size // SIZE_STEP)
    lms_failures: dict[int, str] = {}  # size step -> out-of-memory message, with LMS

    def fits_at(lms: bool) -> Callable[[int], bool]:
        def fits(k: int) -> bool:
            plan = build_plan(trace_at(k * SIZE_STEP), machine.gpu)
            r = _attempt(plan, machine, lms, prefetch, defrag, steps)
            if lms and not r.fits:
                lms_failures[k] = r.oom_message
            return r.fits

        return fits

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
        if lms and confirm_steps > steps:

            def attempt(k: int, st: int) -> ReplayResult:
                plan = build_plan(trace_at(k * SIZE_STEP), machine.gpu)
                return _attempt(plan, machine, True, prefetch, defrag, st)

            largest_k, failed = confirm_largest(
                attempt, r.largest, known, confirm_steps, lambda k: k - 1
            )
            for k, message in failed:
                lms_failures[k] = message
            out[key] = largest_k * SIZE_STEP
            s["confirm"] = {
                "steps": confirm_steps,
                "failed": [k * SIZE_STEP for k, _ in failed],
                "largest": out[key],
            }
    w, m = out["without_lms"], out["with_lms"]
    out["voxel_ratio"] = (m / w) ** 3 if w else None
    first_fail = min((k for k in lms_failures if k * SIZE_STEP > m), default=None)
    out["limited_by"] = limit_of(lms_failures[first_fail]) if first_fail else "search limit"
    out["host_memory_bytes"] = machine.host_memory
    return out


def overhead_points(
    trace: Trace,
    machine: Machine,
    batches: Sequence[int],
    links: Sequence[tuple[str, float]] = (),
    *,
    machines: Sequence[Machine] = (),
    steps: int = 2,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Step-time overhead of LMS at each batch on each machine (same GPU, other links).

    machines: the machines to compare (real pairings); links: what-if links for
    `machine` instead. Each gets an on-demand row (as the patched TensorFlow runs with
    prefetch off) and a row with the engine's prefetch (LMS's default inside TensorFlow).
    """
    targets = list(machines) or [machine.on_link(n, g) for n, g in links] or [machine]
    rows: list[dict[str, Any]] = []
    total = len(batches) * (1 + 2 * len(targets))
    bar = progress_bar("overhead", total, progress, "replay")
    try:
        for batch in batches:
            t = trace if batch == trace.batch_size else trace.rescaled(batch)
            plan = build_plan(t, machine.gpu)
            unlimited = replay_unlimited(
                plan,
                machine.gpu,
                machine.link_gbps,
                steps=steps,
                launch_queue_depth=machine.launch_queue_depth,
            )
            bar.update(1)
            for m in targets:
                ys = machine_yardsticks(plan, m, steps)
                for prefetch in (False, True):
                    bar.set_postfix_str(f"batch {batch} {m.link_name} prefetch={prefetch}")
                    r = replay(plan, m.gpu, m.config(prefetch=prefetch), steps=steps, timed=True)
                    bar.update(1)
                    row = lms_json(r, unlimited.step_time_s, plan, ys)
                    row.update(
                        batch_size=batch,
                        link=m.link_name,
                        link_gbps=m.link_gbps,
                        machine=m.pairing or f"{m.gpu.name} on {m.link_name} (what-if)",
                        hypothetical=m.hypothetical,
                        host_memory_bytes=m.host_memory,
                        prefetch=prefetch,
                        unlimited_step_time_s=unlimited.step_time_s,
                    )
                    rows.append(row)
    finally:
        bar.close()
    return rows
