"""Replays a training-step trace through the LMS engine on a modelled GPU.

Each op, in trace order, does what TensorFlow's executor does with the patch's
pin rules (tf/common/files/tensorflow/core/common_runtime/lms/kernel_pins.cc and
framework/movable_tensor_buffer.cc):

- the op's inputs are pinned for the kernel's duration; a variable is pinned
  only while a kernel uses it (ReadVariableOp, the optimizer's update), so
  variables and optimizer slots move between uses like any other tensor;
- kernels that read no input bytes (Identity, Shape, ShapeN, ...) pin nothing;
- outputs are created pinned for their creator, and that creation pin ends
  when the creating kernel does: an output can be paged out before its first
  consumer runs;
- a dim-0 slice is a view of its root buffer, which stays in place (pinned)
  while the slice lives, and may move again once its slices are gone;
- the tensors whose last use this was are freed.

Persistent tensors (variables, optimizer slots) are allocated once before the
first step; tensors no op produces (the input batch) are allocated at the start
of each step, as the input pipeline's copy would. Raw allocations (cuDNN
workspaces, XLA) are not in traces and so not replayed (docs/planner.md).

Timing comes from the engine's sim backend: every page-out, page-in and
defragmentation move is a copy on a modelled stream, so stalls are the
engine's own. Steps after the first are measured.

The host thread is modelled as TensorFlow runs it on a GPU. One thread runs the
step's kernels in executor order (a GPU kernel is "inexpensive", so the executor
runs it inline, and its outputs are ready for the next op as soon as it is
enqueued: nothing waits for the GPU). Each op costs the host the GPU model's
launch time (launch_overhead_us), then its kernel is enqueued on the compute
stream. TensorFlow itself puts no bound on how far the host runs ahead (its
GPUKernelTracker, which would, is off unless GPUOptions.Experimental
kernel_tracker_max_interval / _bytes / _pending or timestamped_allocator are set;
all default to 0 / false); CUDA's launch queue does: LAUNCH_QUEUE_DEPTH kernels
unfinished on one stream, and the next launch blocks the host until the oldest
ends. The host also blocks wherever the engine does on a GPU (the sim device
answers SynchronizeEvent and EventDone by the modelled clock): a page-out under
pressure waits for its copy, a defragmentation for its moves, the settling of an
early page-out for its copy if it has not landed. A pin that pages in does not
block the host (the compute stream waits for the copy's event), unless making
room for it does.

Prefetch is LMS's default inside the patched TensorFlow, which learns steps from
the kernels' step ids; the replay pages in on demand unless prefetch is asked for,
and then marks each step's start exactly and learns the pin order during the first
step, so a prefetch figure is what prefetch gives when the step is learned exactly.
"""

from __future__ import annotations

import bisect
import dataclasses
import faulthandler
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tflms.planner.gpu import DEFAULT_LINK_LATENCY_US, GpuModel

if TYPE_CHECKING:
    from tflms.trace.format import OpInfo, TensorInfo, Trace

ALIGNMENT = 256  # BFC rounds every allocation up to this
# The engine's prefetch lookahead, in pins (tflms.engine.DEFAULT_PREFETCH_LOOKAHEAD; a test
# keeps them equal without loading the engine here).
DEFAULT_LOOKAHEAD = 128


def _rounded(nbytes: int) -> int:
    return max(ALIGNMENT, (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)


@dataclasses.dataclass
class StepPlan:
    """A trace turned into per-op engine actions (ids are tensor ids)."""

    persistent: list[tuple[int, int]]  # (id, bytes), allocated before the first step
    step_inputs: list[tuple[int, int]]  # (id, bytes), allocated at every step start
    inputs: list[tuple[int, ...]]  # per op, distinct tensors to pin
    outputs: list[tuple[tuple[int, int], ...]]  # per op, (id, bytes) to allocate pinned
    frees: list[tuple[int, ...]]  # per op, tensors dead after it
    kernel_s: list[float]  # per op, modelled kernel time
    names: list[str]
    free_at_start: tuple[int, ...]  # step inputs no op reads
    # per op, (output, input): the output takes over the input's buffer in place
    forwards: list[tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=list)
    sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    # per op, roots its slices pin (one pin per slicing op) ...
    slice_pins: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    # ... and per op, roots whose slices from one slicing op all died at that op
    slice_unpins: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    # per op, whether its output is as large as all its inputs (CONCAT_OPS): the patch
    # gathers them before pinning them (Engine::GatherForConcat)
    concats: list[bool] = dataclasses.field(default_factory=list)

    @property
    def compute_s(self) -> float:
        return sum(self.kernel_s)


# Kernels that write their output into an input's buffer when that input has no
# other user and the same size (TensorFlow's forward_input_or_allocate_output):
# elementwise ops without broadcasting, AddN, BiasAdd.
FORWARDING_OPS = frozenset(
    {
        "Abs", "Add", "AddN", "AddV2", "BiasAdd", "DivNoNan", "Elu", "EluGrad", "Exp",
        "FloorDiv", "Log", "Maximum", "Minimum", "Mul", "Neg", "Pow", "RealDiv", "Relu",
        "Relu6", "Relu6Grad", "ReluGrad", "Rsqrt", "RsqrtGrad", "Selu", "SeluGrad",
        "Sigmoid", "SigmoidGrad", "Softplus", "Sqrt", "Square", "SquaredDifference",
        "Sub", "Tanh", "TanhGrad",
    }
)  # fmt: skip


# Kernels that read no byte of their inputs: the patch's pin site pins nothing for them
# (KernelReadsNoInputBytes in tf/common/files/.../lms/kernel_pins.cc; keep in step). Their
# inputs stay alive until they run, as the executor keeps them, but a reclaimed input is
# not paged back in for them.
NO_PIN_OPS = frozenset(
    {
        "Identity", "IdentityN", "StopGradient", "PreventGradient", "Shape", "ShapeN", "Size",
        "Rank", "Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge", "NextIteration",
        "RefNextIteration", "LoopCond", "_Retval", "_DeviceRetval", "_Send", "_HostSend",
        "PartitionedCall", "StatefulPartitionedCall", "While", "StatelessWhile",
        "VarIsInitializedOp", "DestroyResourceOp", "VariableShape",
    }
)  # fmt: skip

# Kernels whose one output holds every byte of their inputs: the patch's pin site has the
# engine place their inputs so that the output finds a gap before pinning them
# (kConcatOps in tf/common/files/.../lms/kernel_pins.cc; keep in step).
CONCAT_OPS = frozenset({"ConcatV2", "Concat", "Pack", "ParallelConcat"})

# Kernels that return a dim-0 slice of an input as a view (Tensor::Slice) when the slice
# starts on an aligned row: the output shares the input's buffer, and the patch pins that
# root while the slice lives (PinRootForSlice / UnpinRootForSlice).
SLICING_OPS = frozenset({"Slice", "StridedSlice", "Split", "SplitV", "Unpack"})
# Eigen's largest alignment (EIGEN_MAX_ALIGN_BYTES): a row of a multiple of this size
# starts aligned wherever the slice begins, so the kernel takes the view path.
SLICE_ALIGNMENT = 64


def _slice_root(op: OpInfo, tensors: dict[int, TensorInfo], out: int) -> int | None:
    """The input whose buffer `out` is a view of, when `op` slices along dimension 0."""
    o = tensors[out]
    if op.type not in SLICING_OPS or o.shape is None:
        return None
    for tid in op.inputs:
        t = tensors[tid]
        if t.shape is None or len(t.shape) == 0 or t.bytes <= o.bytes or t.dtype != o.dtype:
            continue
        if op.type == "Unpack":
            same_rows = tuple(o.shape) == tuple(t.shape[1:])
        else:
            same_rows = len(o.shape) == len(t.shape) and tuple(o.shape[1:]) == tuple(t.shape[1:])
        row_bytes = t.bytes // t.shape[0] if t.shape[0] else 0
        if same_rows and row_bytes and row_bytes % SLICE_ALIGNMENT == 0:
            return tid
    return None


HALF_DTYPES = frozenset({"float16", "bfloat16"})


def _is_half(op: OpInfo, tensors: dict[int, TensorInfo]) -> bool:
    """A 16-bit op (mixed precision): its first output is float16 or bfloat16."""
    return bool(op.outputs) and tensors[op.outputs[0]].dtype in HALF_DTYPES


def _on_host(t: TensorInfo) -> bool:
    """Whether TensorFlow keeps the tensor in host memory on a GPU: an int32 constant.

    TensorFlow's GPU `Const` kernel for int32 is HostConstantOp, registered with
    HostMemory("output"): shapes, axes and permutations never reach the GPU's allocator.
    Allocated on the device they are a few kilobytes, but pinned mid-device with their
    kernels they split its free memory (docs/planner.md, "How a prediction is made").
    """
    return t.persistent and t.dtype == "int32" and t.name.startswith("const:")


def build_plan(trace: Trace, gpu: GpuModel, forwarding: bool = True) -> StepPlan:
    """Derives liveness, in-place forwarding, views, pins and kernel times.

    Tensors of 0 bytes take no memory and are skipped, and so are int32 constants, which
    TensorFlow keeps in host memory (_on_host). With `forwarding`, an op of
    FORWARDING_OPS whose input dies at that op and has its output's size writes the
    output in place, as TensorFlow's kernels do: no allocation, one buffer fewer.
    Ops of NO_PIN_OPS pin nothing; a dim-0 slice (SLICING_OPS) is a view of its root,
    which lives as long as its views and is pinned while they live.
    """
    sizes = {t.id: 0 if _on_host(t) else int(t.bytes) for t in trace.tensors}
    infos = {t.id: t for t in trace.tensors}
    persistent_ids = {t.id for t in trace.tensors if t.persistent}
    producer = {tid: i for i, op in enumerate(trace.ops) for tid in op.outputs}
    produced: set[int] = set()
    last_use: dict[int, int] = {}
    # view -> the tensor whose buffer it shares; view -> the op that made it
    view_of: dict[int, int] = {}
    sliced_at: dict[int, int] = {}
    for i, op in enumerate(trace.ops):
        for tid in op.inputs:
            if tid not in sizes:
                raise ValueError(
                    f"op {op.name!r} reads tensor {tid}, which the trace does not list"
                )
            if producer.get(tid, -1) >= i:
                raise ValueError(
                    f"op {op.name!r} reads tensor {tid} before it is produced: "
                    "the trace's ops are not in executor order"
                )
            last_use[tid] = i
        for tid in op.outputs:
            if tid not in sizes:
                raise ValueError(
                    f"op {op.name!r} writes tensor {tid}, which the trace does not list"
                )
            if tid in persistent_ids:
                raise ValueError(f"op {op.name!r} lists persistent tensor {tid} as an output")
            if tid in produced:
                raise ValueError(f"tensor {tid} is produced twice (again by op {op.name!r})")
            produced.add(tid)
            last_use.setdefault(tid, i)
            last_use[tid] = max(last_use[tid], i)
            root = _slice_root(op, infos, tid) if sizes[tid] > 0 else None
            if root is not None:
                root = view_of.get(root, root)
                view_of[tid] = root
                sliced_at[tid] = i
    # A root's buffer lives until its last view is done with it.
    for view, root in view_of.items():
        if root in last_use or root in persistent_ids:
            last_use[root] = max(last_use.get(root, 0), last_use.get(view, 0))

    frees: list[list[int]] = [[] for _ in trace.ops]
    step_inputs: list[tuple[int, int]] = []
    free_at_start: list[int] = []
    for t in trace.tensors:
        if t.persistent or sizes[t.id] <= 0 or t.id in view_of:
            continue
        if t.id not in produced:
            step_inputs.append((t.id, sizes[t.id]))
            if t.id not in last_use:
                free_at_start.append(t.id)
                continue
        frees[last_use[t.id]].append(t.id)

    inputs: list[tuple[int, ...]] = []
    outputs: list[tuple[tuple[int, int], ...]] = []
    forwards: list[tuple[tuple[int, int], ...]] = []
    kernel_s: list[float] = []
    # The patch pins a root while a slice of it lives (PinRootForSlice in SubBuffer's
    # constructor, unpinned in its destructor): one pin per slicing op here, from that op
    # to the last use of the views it made. Between and after slices the root may move.
    roots = set(view_of.values())
    pin_at: list[list[int]] = [[] for _ in trace.ops]
    unpin_at: list[list[int]] = [[] for _ in trace.ops]
    groups: dict[tuple[int, int], int] = {}  # (slicing op, root) -> last use of its views
    for view, root in view_of.items():
        key = (sliced_at[view], root)
        groups[key] = max(groups.get(key, 0), last_use.get(view, sliced_at[view]))
    for (i, root), end in groups.items():
        pin_at[i].append(root)
        unpin_at[end].append(root)
    for i, op in enumerate(trace.ops):
        pins = () if op.type in NO_PIN_OPS else op.inputs
        ins = tuple(dict.fromkeys(view_of.get(t, t) for t in pins if sizes[t] > 0))
        outs = [t for t in op.outputs if sizes[t] > 0 and t not in view_of]
        fwd: list[tuple[int, int]] = []
        if forwarding and op.type in FORWARDING_OPS and outs:
            out = outs[0]
            for t in ins:
                # Read once, by this op only: the buffer has no other reference.
                if (
                    t not in persistent_ids
                    and t not in roots
                    and last_use.get(t) == i
                    and sizes[t] == sizes[out]
                    and op.inputs.count(t) == 1
                ):
                    fwd.append((out, t))
                    outs.remove(out)
                    frees[i].remove(t)
                    break
        inputs.append(ins)
        outputs.append(tuple((t, sizes[t]) for t in outs))
        forwards.append(tuple(fwd))
        kernel_s.append(
            gpu.op_seconds(float(op.flops), float(op.bytes_accessed), _is_half(op, infos))
        )
    return StepPlan(
        persistent=[(t.id, sizes[t.id]) for t in trace.tensors if t.persistent and sizes[t.id] > 0],
        step_inputs=step_inputs,
        inputs=inputs,
        outputs=outputs,
        frees=[tuple(f) for f in frees],
        kernel_s=kernel_s,
        names=[op.name for op in trace.ops],
        free_at_start=tuple(free_at_start),
        forwards=forwards,
        sizes={t: b for t, b in sizes.items() if b > 0 and t not in view_of},
        slice_pins=[tuple(k) for k in pin_at],
        slice_unpins=[tuple(k) for k in unpin_at],
        concats=[op.type in CONCAT_OPS for op in trace.ops],
    )


def peak_live_bytes(plan: StepPlan) -> int:
    """Largest sum of live tensor bytes (BFC-rounded) at any op: a lower bound on peak use.

    A tensor is live from the start of its producing op to the end of its last
    consumer, so an op's inputs and outputs are live together.
    """
    return max(live_profile(plan), default=0)


def live_profile(plan: StepPlan) -> list[int]:
    """Live tensor bytes (BFC-rounded) while each op runs: its inputs and outputs included."""
    live = sum(_rounded(b) for _, b in plan.persistent)
    live += sum(_rounded(b) for _, b in plan.step_inputs)
    sizes = plan.sizes
    live -= sum(_rounded(sizes[t]) for t in plan.free_at_start)
    profile = []
    for outs, dead in zip(plan.outputs, plan.frees, strict=True):
        live += sum(_rounded(b) for _, b in outs)
        profile.append(live)
        live -= sum(_rounded(sizes[t]) for t in dead)
    return profile


def swap_bound_s(plan: StepPlan, device_memory: int, link_gbps: float) -> float:
    """A lower bound on the step time of any scheme that swaps (and never recomputes).

    While op p runs, live_p - device_memory bytes must be in host memory. They were
    produced before p and are read after it, so they went out through the link
    before p started and come back after it ended: the step takes at least
    max(compute before p, excess / bw) + max(compute from p on, excess / bw).
    Unlike the roofline, this bound sees that copies out and copies in cannot overlap
    when they are forced on either side of the memory peak.
    """
    bw = link_gbps * 1e9
    total = plan.compute_s
    before = 0.0
    bound = total
    for live, kernel in zip(live_profile(plan), plan.kernel_s, strict=True):
        excess = live - device_memory
        if excess > 0:
            x = excess / bw
            bound = max(bound, max(before, x) + max(total - before, x))
        before += kernel
    return bound


# Kernels one CUDA stream holds unfinished before a launch blocks the calling host thread.
# CUDA documents no figure; about 1000 was measured (a 190 us kernel launched 10,000 times:
# the first ~1000 launches take 4-5 us each, later ones wait for a kernel to finish; NVIDIA
# developer forum "CUDA stream are blocked when launch lots of kernels (>1000)", 2018, and
# Stack Overflow question 53970187; an H200 with CUDA 13.0 blocked at launch 1,043, in
# bench/cuda_bench.cu). Counted here per op, one launch each: an op that
# launches several kernels fills it sooner, so the real run-ahead is at most this.
LAUNCH_QUEUE_DEPTH = 1000

# Whether the patched TensorFlow prefetches when the program does not say: it mirrors
# tensorflow::lms::kPrefetchEnabledDefault (tests/test_prefetch_default.py checks that they
# agree). There prefetch learns steps from the kernels' step ids and has not run on a GPU
# yet (docs/how-it-works.md, Prefetch); the replay marks steps exactly, so a prefetch figure
# is what prefetch gives at best: every one is labelled.
PATCH_PREFETCH_DEFAULT = True
# The add-on's (fixed addresses): tensorflow::lms::kFixedAddressPrefetchEnabledDefault.
ADDON_PREFETCH_DEFAULT = False
# The engine's host throttle where TF_LMS_RUN_AHEAD_EPOCHS is unset:
# tensorflow::lms::kRunAheadEpochsDefault (EngineOptions::run_ahead_epochs; 0: off), which
# tests/test_prefetch_default.py checks. It acts only with prefetch and bytes on the host.
PATCH_RUN_AHEAD_EPOCHS = 8

# The host time of a layout look (EngineOptions::layout_lookahead; experimental), charged
# to the modelled host at the pin: per step event the look models and per free range its
# best fits scan. Fitted on the planner's own machine (2 CPU cores of a cloud VM,
# 2 December 2026) to the CPU time replays with the look took over replays without, at
# six results points whose looks modelled 10M to 460M events and scanned 5M to 3.5G
# ranges: within 12% at five, 23% at the sixth (the U-Net's 0.09 s). A faster host core
# costs less; docs/how-it-works.md, *What the layout look-ahead costs the host*.
LAYOUT_LOOK_NS_PER_EVENT = 9.4
LAYOUT_LOOK_NS_PER_RANGE = 2.3


def _prefetch_label(default: bool) -> str:
    return "prefetch (default)" if default else "prefetch (opt-in)"


PREFETCH_LABEL = _prefetch_label(PATCH_PREFETCH_DEFAULT)
ADDON_PREFETCH_LABEL = _prefetch_label(ADDON_PREFETCH_DEFAULT)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: the knobs `tflms simulate` exposes."""

    device_memory: int
    host_memory: int
    link_gbps: float
    lms: bool = True
    # Off unless asked for: paging on demand does not depend on learning the step, which
    # the patch's default prefetch does there (docs/how-it-works.md, Prefetch).
    prefetch: bool = False
    # The engine's experimental prefetch guard (core/src/prefetch_guard.cc): with prefetch,
    # times steps with and without it once learned and keeps the faster mode.
    prefetch_guard: bool = False
    defrag: bool = False
    prefetch_lookahead: int = DEFAULT_LOOKAHEAD
    prefetch_budget: int = 0
    link_latency_us: float = DEFAULT_LINK_LATENCY_US
    # TensorFlow's default (allow_growth off) takes the GPU's memory as one region up
    # front; with growth on, free space split across regions cannot coalesce.
    allow_growth: bool = False
    # The add-on's mode (tflms.addon on the stock wheel): addresses fixed, pages of
    # `page_size` mapped and unmapped behind them at an assumed host cost per page.
    fixed_addresses: bool = False
    page_size: int = 2 << 20
    map_us_per_page: float = 0.0
    unmap_us_per_page: float = 0.0
    # How far the host may run ahead of the GPU, in compute-stream operations (0: no
    # bound, the planner's model before the host thread was modelled).
    launch_queue_depth: int = LAUNCH_QUEUE_DEPTH
    # The engine's host throttle with prefetch (EngineOptions::run_ahead_epochs;
    # 0: off).
    run_ahead_epochs: int = PATCH_RUN_AHEAD_EPOCHS
    # A yardstick, not a mode of the patch (EngineOptions::unfragmented; unfragmented.py):
    # addresses taken out, the device's bytes still held by the LMS limit.
    unfragmented: bool = False
    # Experimental, not a mode of the patch (EngineOptions::layout_lookahead): the plan's
    # copies in placed by a look-ahead over the learned step instead of its slack. Its
    # host time is charged to the modelled host at these rates (0: free).
    layout_lookahead: bool = False
    layout_look_ns_per_event: float = LAYOUT_LOOK_NS_PER_EVENT
    layout_look_ns_per_range: float = LAYOUT_LOOK_NS_PER_RANGE

    @property
    def patch_default(self) -> bool:
        """True when this is what the patched TensorFlow does by default (LMS off, or on
        with prefetch as PATCH_PREFETCH_DEFAULT says)."""
        on = not self.lms or self.prefetch == PATCH_PREFETCH_DEFAULT
        return (
            on
            and not self.fixed_addresses
            and not self.unfragmented
            and not self.layout_lookahead
            and self.run_ahead_epochs == PATCH_RUN_AHEAD_EPOCHS
        )

    def label(self) -> str:
        if not self.lms:
            return "no LMS"
        prefetch = ADDON_PREFETCH_LABEL if self.fixed_addresses else PREFETCH_LABEL
        parts = ["LMS", prefetch if self.prefetch else "on-demand"]
        if self.prefetch and self.prefetch_guard:
            parts.append("guard")
        if self.defrag:
            parts.append("defrag")
        if self.fixed_addresses:
            parts.append(f"fixed addresses ({self.page_size >> 20} MiB pages)")
        if self.run_ahead_epochs != PATCH_RUN_AHEAD_EPOCHS:
            parts.append(f"host within {self.run_ahead_epochs} epochs")
        if self.unfragmented:
            parts.append("unfragmented")
        if self.layout_lookahead:
            parts.append("layout look-ahead")
        return " + ".join(parts)


@dataclasses.dataclass
class Sample:
    """Engine state after one op of the measured step (for the memory timeline plot)."""

    t: float  # seconds since the measured step began (compute-stream clock)
    active: int
    inactive: int
    reclaimed: int
    stall: float  # cumulative compute-stream stall for page-ins, seconds
    # Seconds each host link has been busy since the step began, on the same clock: the
    # links as the GPU runs them, not as the host enqueued them (it may be far ahead).
    d2h_busy: float = 0.0
    h2d_busy: float = 0.0


@dataclasses.dataclass
class ReplayResult:
    config: EngineConfig
    fits: bool
    oom_message: str = ""
    oom_op: str = ""
    steps: int = 0  # steps replayed (an OOM may end them sooner)
    measured_steps: int = 0  # the window at the end whose mean is measured
    step_time_s: float = 0.0  # mean host time of the measured steps, drained at both ends
    compute_time_s: float = 0.0  # sum of modelled kernel times
    compute_stall_s: float = 0.0  # compute stream waiting for page-ins
    host_sync_wait_s: float = 0.0  # host thread blocked on events (page-outs, moves, ...)
    host_launch_wait_s: float = 0.0  # host thread blocked on a full launch queue
    d2h_bytes: int = 0  # bytes swapped out per measured step
    h2d_bytes: int = 0  # bytes swapped in per measured step
    d2h_busy_s: float = 0.0
    h2d_busy_s: float = 0.0
    stats: dict[str, int] = dataclasses.field(default_factory=dict)  # at the end
    step_stats: dict[str, int] = dataclasses.field(default_factory=dict)  # per measured step
    samples: list[Sample] = dataclasses.field(default_factory=list)
    # Host time of every step run, in order: from its start to the next one's (the last
    # to the drain after it; a step that starts the window, from the drain before it).
    host_step_s: list[float] = dataclasses.field(default_factory=list)

    def swap_bytes_per_direction(self) -> int:
        return max(self.d2h_bytes, self.h2d_bytes)

    def roofline_s(self, unlimited_step_s: float) -> float:
        """max(step time with unlimited memory, bytes per direction / link bandwidth)."""
        link_s = self.swap_bytes_per_direction() / (self.config.link_gbps * 1e9)
        return max(unlimited_step_s, link_s)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config": dataclasses.asdict(self.config),
            "fits": self.fits,
            "patch_default": self.config.patch_default,
            "steps": self.steps,
            "measured_steps": self.measured_steps,
        }
        if not self.fits:
            out["oom_message"] = self.oom_message
            out["oom_op"] = self.oom_op
            return out
        out.update(
            step_time_s=self.step_time_s,
            compute_time_s=self.compute_time_s,
            compute_stall_s=self.compute_stall_s,
            host_sync_wait_s=self.host_sync_wait_s,
            host_launch_wait_s=self.host_launch_wait_s,
            d2h_bytes=self.d2h_bytes,
            h2d_bytes=self.h2d_bytes,
            d2h_busy_s=self.d2h_busy_s,
            h2d_busy_s=self.h2d_busy_s,
            step_stats=self.step_stats,
            peak_bytes_in_use=self.stats.get("peak_bytes_in_use", 0),
        )
        return out


# Counters whose per-step change the report shows.
STEP_COUNTERS = (
    "bytes_reclaimed",
    "bytes_paged_in",
    "num_page_ins",
    "num_single_reclaims",
    "num_fragment_reclaims",
    "num_full_reclaims",
    "num_defragmentations",
    "bytes_defragged",
    "num_prefetches",
    "prefetch_hits",
    "prefetch_misses",
    "page_in_stall_ns",
)

_TIMELINE_KEYS = ("host_time", "compute_time", "compute_stall", "d2h_busy", "h2d_busy")


def make_engine(config: EngineConfig, gpu: GpuModel) -> Any:
    import tflms

    return tflms.Engine(
        device_memory=config.device_memory,
        host_memory=config.host_memory,
        lms=config.lms,
        defrag=config.defrag,
        backend="sim",
        prefetch=config.prefetch and config.lms,
        prefetch_guard=config.prefetch_guard and config.prefetch and config.lms,
        prefetch_budget=config.prefetch_budget,
        prefetch_lookahead=config.prefetch_lookahead,
        allow_growth=config.allow_growth,
        store_data=False,
        link_gbps=config.link_gbps,
        link_latency_us=config.link_latency_us,
        device_gbps=gpu.device_copy_gbps,
        fixed_addresses=config.fixed_addresses,
        page_size=config.page_size,
        # The virtual range holds resident and evicted buffers alike.
        virtual_address_bytes=config.device_memory + config.host_memory
        if config.fixed_addresses
        else 0,
        map_us_per_page=config.map_us_per_page,
        unmap_us_per_page=config.unmap_us_per_page,
        launch_queue_depth=config.launch_queue_depth,
        run_ahead_epochs=config.run_ahead_epochs,
        unfragmented=config.unfragmented,
        layout_lookahead=config.layout_lookahead,
        layout_look_ns_per_event=config.layout_look_ns_per_event,
        layout_look_ns_per_range=config.layout_look_ns_per_range,
    )


# Prefetch changes from step to step: it learns the order in one step and follows, in
# the next, a plan made from the one before, so a step that fits can be followed by one
# that does not. Two steps hid that: UNet3D at its largest size ran out of memory with
# prefetch in step 3 on the A100-40 and the GH200, in step 8 on the A100-80 and the
# H100, and InceptionV3 at batch 712 on the AC922 in step 16 (after a step 12 slower
# than paging on demand). A replay with prefetch runs at least this many steps.
PREFETCH_MIN_STEPS = 20
# Steps are not alike either: replayed for 30 steps with prefetch (docs/steadiness.md),
# ResNet50 at 1409 on the DGX-1 with twice the host took 40.1 to 59.7 s a step, its
# 20th the fastest; the 3D U-Net at 464^3 on the A100-80 took 9.3 to 14.2 s, and its
# 20th, drained before and after, which the tables showed until November 2026, 11.1 s
# against 12.2 s for the mean of steps 11-20. So a replay measures the mean of a
# window of steps: with prefetch those after the first PREFETCH_SETTLE_STEPS (its first
# plans are made from steps that did not follow one yet), on demand all but the first
# (nothing is on the host when it starts).
PREFETCH_SETTLE_STEPS = 10
# A replay whose step time is reported runs at least this many steps on demand (five
# measured); a search probe, which asks only whether a batch fits, runs what it asks.
TIMED_STEPS = 6


def first_measured_step(config: EngineConfig, steps: int, timed: bool) -> int:
    """The 1-based first step of the window a replay of `steps` steps measures.

    Untimed replays (search probes) measure their last step, drained before it, as they
    always did: which batches fit does not move with the window.
    """
    if not timed:
        return steps
    first = PREFETCH_SETTLE_STEPS + 1 if config.prefetch and config.lms else 2
    return max(1, min(first, steps))


def replay(
    plan: StepPlan,
    gpu: GpuModel,
    config: EngineConfig,
    steps: int = 2,
    record: bool = False,
    on_op: Callable[[], None] | None = None,
    timed: bool = False,
    drained: bool = False,
) -> ReplayResult:
    """Runs `steps` training steps and measures them. An out-of-memory error ends the replay.

    With prefetch, at least PREFETCH_MIN_STEPS steps. `timed` (a step time that is
    reported, not only whether it fits): at least TIMED_STEPS, and the mean step of the
    window first_measured_step gives is measured; otherwise the last step.

    `record` samples engine state after every op of the measured step;
    `on_op` is called after every op (progress bars). `drained`: the host waits for the
    GPU at the end of every step, as a Keras fit with a batch-end callback does (tflms's
    statistics callbacks read the loss every step) and a loop that prints the loss does;
    otherwise it runs ahead into the next step, bounded by the launch queue.
    """
    import tflms

    if steps < 1:
        raise ValueError("steps must be at least 1")
    if config.prefetch and config.lms:
        steps = max(steps, PREFETCH_MIN_STEPS)
    if timed:
        steps = max(steps, TIMED_STEPS)
    # A replay that hangs inside the engine (a lost wake-up) cannot be interrupted from
    # Python: after the watchdog's time the process prints where it stood and exits.
    armed = _arm_watchdog(replay_timeout_s())
    try:
        return _replay(plan, gpu, config, steps, record, on_op, timed, drained, tflms)
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def _arm_watchdog(seconds: float) -> bool:
    # The process's own stderr, not a replacement (pytest's capture has no file descriptor).
    err = sys.__stderr__
    if seconds <= 0 or err is None:
        return False
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=err)
    except (OSError, ValueError, AttributeError):
        return False
    return True


def replay_timeout_s() -> float:
    return float(os.environ.get("TFLMS_REPLAY_TIMEOUT_S", "900"))


def _replay(
    plan: StepPlan,
    gpu: GpuModel,
    config: EngineConfig,
    steps: int,
    record: bool,
    on_op: Callable[[], None] | None,
    timed: bool,
    drained: bool,
    tflms: Any,
) -> ReplayResult:
    eng = make_engine(config, gpu)
    launch_s = gpu.launch_overhead_us * 1e-6
    bufs: dict[int, Any] = {}
    result = ReplayResult(config=config, fits=True, steps=steps)
    op_name = "(persistent tensors)"
    try:
        for tid, nbytes in plan.persistent:
            bufs[tid] = eng.allocate(nbytes, pinned=False)
        eng.synchronize()
        before = eng.timeline()
        stats_before = eng.stats()
        starts: list[float] = []
        first = first_measured_step(config, steps, timed) - 1
        last_start = before
        for step in range(steps):
            measured = step == steps - 1
            if record and step == max(0, steps - 2):
                # From the step before: its copies may run in the measured step.
                eng.record_copies(True)
            if step == first or (drained and step > 0):
                # The window starts drained: what earlier steps left in flight is theirs.
                eng.synchronize()
            if step == first:
                before = eng.timeline()
                stats_before = eng.stats()
            now = eng.timeline()
            if measured:
                last_start = now
            starts.append(now["host_time"])
            if len(starts) > 1:
                result.host_step_s.append(starts[-1] - starts[-2])
            eng.step_begin()
            op_name = "(step inputs)"
            for tid, nbytes in plan.step_inputs:
                bufs[tid] = eng.allocate(nbytes, pinned=False)
            for tid in plan.free_at_start:
                eng.free(bufs.pop(tid))
            for i, ins in enumerate(plan.inputs):
                op_name = plan.names[i]
                pinned = [bufs[t] for t in ins]
                if len(pinned) > 1 and plan.concats and plan.concats[i]:
                    eng.gather_for_concat(pinned)
                for b in pinned:
                    eng.pin(b)
                for tid in plan.slice_pins[i] if plan.slice_pins else ():
                    # The slices alias the root's address: it stays put while they live.
                    eng.pin(bufs[tid])
                for out, src in plan.forwards[i]:
                    bufs[out] = bufs.pop(src)
                for tid, nbytes in plan.outputs[i]:
                    b = eng.allocate(nbytes, pinned=True)
                    bufs[tid] = b
                    pinned.append(b)
                eng.host_advance(launch_s)
                eng.compute(plan.kernel_s[i])
                if measured and record:
                    # Sampled while the op's tensors are pinned: its working set is active.
                    s = eng.stats()
                    tl = eng.timeline()
                    result.samples.append(
                        Sample(
                            t=tl["compute_time"] - last_start["compute_time"],
                            active=s["bytes_active"],
                            inactive=s["bytes_inactive"],
                            reclaimed=s["current_bytes_reclaimed"],
                            stall=tl["compute_stall"] - last_start["compute_stall"],
                        )
                    )
                for b in pinned:
                    eng.unpin(b)
                for tid in plan.slice_unpins[i] if plan.slice_unpins else ():
                    eng.unpin(bufs[tid])
                for tid in plan.frees[i]:
                    eng.free(bufs.pop(tid))
                if on_op is not None:
                    on_op()
        # The host's own waits, before the end-of-step drain every step has.
        ran = eng.timeline()
        eng.synchronize()
        if record:
            _add_link_busy(result.samples, eng.take_copies(), last_start["compute_time"])
            eng.record_copies(False)
    except tflms.OutOfMemoryError as exc:
        result.fits = False
        result.oom_message = str(exc)
        result.oom_op = op_name
        result.stats = eng.stats()
        return result
    after = eng.timeline()
    stats_after = eng.stats()
    n = steps - first
    result.measured_steps = n
    result.host_step_s.append(after["host_time"] - starts[-1])
    # Per step: the window's totals over its steps.
    result.step_time_s = (after["host_time"] - before["host_time"]) / n
    result.compute_time_s = plan.compute_s
    result.compute_stall_s = (after["compute_stall"] - before["compute_stall"]) / n
    result.host_sync_wait_s = (ran["host_sync_wait"] - before["host_sync_wait"]) / n
    result.host_launch_wait_s = (ran["host_launch_wait"] - before["host_launch_wait"]) / n
    result.d2h_bytes = round((after["d2h_bytes"] - before["d2h_bytes"]) / n)
    result.h2d_bytes = round((after["h2d_bytes"] - before["h2d_bytes"]) / n)
    result.d2h_busy_s = (after["d2h_busy"] - before["d2h_busy"]) / n
    result.h2d_busy_s = (after["h2d_busy"] - before["h2d_busy"]) / n
    result.stats = dict(stats_after)
    result.step_stats = {
        k: round((int(stats_after.get(k, 0)) - int(stats_before.get(k, 0))) / n)
        for k in STEP_COUNTERS
    }
    return result


def _add_link_busy(
    samples: list[Sample], copies: list[tuple[str, float, float, int]], t0: float
) -> None:
    """Fills each sample's link-busy seconds from the copies the device ran (absolute clock).

    A link runs its copies one at a time, so its busy time up to t is the copies that ended
    by t plus the part of the one under way.
    """
    for direction in ("d2h", "h2d"):
        spans = sorted((max(s, t0), e) for d, s, e, _ in copies if d == direction and e > t0)
        starts = [s for s, _ in spans]
        done = [0.0]
        for s, e in spans:
            done.append(done[-1] + e - s)
        for sample in samples:
            t = t0 + sample.t
            i = bisect.bisect_right(starts, t)
            busy = done[i] - (max(0.0, spans[i - 1][1] - t) if i else 0.0)
            setattr(sample, f"{direction}_busy", busy)


def unlimited_memory(plan: StepPlan) -> int:
    """A device size no trace of this plan can exhaust (used for 'unlimited memory' runs)."""
    return 2 * peak_live_bytes(plan) + (1 << 30)


def replay_unlimited(
    plan: StepPlan,
    gpu: GpuModel,
    link_gbps: float,
    steps: int = 2,
    record: bool = False,
    launch_queue_depth: int = LAUNCH_QUEUE_DEPTH,
) -> ReplayResult:
    """The step on a GPU whose memory never runs out: the time LMS is measured against."""
    size = unlimited_memory(plan)
    config = EngineConfig(
        device_memory=size,
        host_memory=1 << 30,
        link_gbps=link_gbps,
        lms=False,
        launch_queue_depth=launch_queue_depth,
    )
    result = replay(plan, gpu, config, steps=steps, record=record)
    if not result.fits:
        raise RuntimeError(f"unlimited-memory replay ran out of memory: {result.oom_message}")
    return result
