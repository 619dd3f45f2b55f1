"""The in-order Ideal with addresses (`tflms simulate --placed`).

The Ideal (yardsticks.py) knows bytes, not addresses: at every op it holds at most the device's
bytes, however they would lie. A real allocator has one address space, and a request can find
its bytes free but in pieces. This replays the in-order Ideal's own memory plan (its evictions,
its copies in, each reserved from the op the plan moved it to) in an address space:

- every allocation (a step input, an op's output, a copy in's destination) goes best fit, as
  the BFC allocator places it;
- where a request finds no hole though its bytes are free, the window of its size that holds
  the fewest live bytes is emptied and those tensors are placed best fit elsewhere (the next
  windows by cost where they do not fit; a full compaction where none does), and the op waits
  for the moved bytes at the device's copy rate (GpuModel.device_copy_gbps) before it starts;
- the memory plan is also made for a few percent less than the device and placed in the whole
  device (a plan that packs memory to the last byte finds no hole often), and the fastest of
  these is the result.

So this is an achievable schedule with addresses, for a runtime that may move any tensor before
the kernel that pins it runs, on the compute stream and with the host never waiting: not a
bound, and not what the engine can do (it moves nothing a running kernel has pinned, and its
slides wait for the host). The window choice is greedy; a better one would move less.
`needs_kernel_inputs` counts the requests whose room was made by moving an input of the
requesting kernel (every window tried held one, or the full compaction moved one), which the
engine could not have moved then: such room has to be made before that kernel pins its inputs.

Each slack's plan is also laid out ahead (static_layout.py): the address space it needs when
every stay on the device gets its address before the step and nothing moves.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tflms.planner.memory_walk import walk_memory_plan
from tflms.planner.replay import StepPlan
from tflms.planner.static_layout import static_layout
from tflms.planner.yardsticks import Buffers, _memory_plan, _MemoryPlan, _timeline, plan_buffers

# Fractions of the device the memory plan leaves unused (placed in the whole device).
DEFAULT_SLACKS = (0.0, 0.01, 0.02, 0.05)
# Windows tried, cheapest first, before a full compaction.
_WINDOWS_TRIED = 40


@dataclasses.dataclass(frozen=True)
class PlacedRun:
    """One slack's placed schedule; the counts are the measured (last) step's."""

    slack: float
    fits: bool
    step_time_s: float = 0.0
    failed_placements: int = 0  # requests that found their bytes free but no hole
    needs_kernel_inputs: int = 0  # of those, the ones whose room moved a kernel input
    moved_bytes: int = 0
    compactions: int = 0
    d2h_bytes: int = 0
    # The same memory plan laid out ahead of time (static_layout.py): the most bytes live at
    # once, what the greedy layout needs, and whether that is within the device, in which case
    # the schedule moves nothing and steps in `unmoved_step_s`.
    live_peak: int = 0
    layout_peak: int = 0
    layout_fits: bool = False
    unmoved_step_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PlacedIdeal:
    in_order_s: float  # the in-order Ideal, which knows no addresses
    runs: tuple[PlacedRun, ...]
    device_memory: int = 0

    @property
    def best(self) -> PlacedRun | None:
        fitting = [r for r in self.runs if r.fits]
        return min(fitting, key=lambda r: r.step_time_s) if fitting else None

    @property
    def best_laid_out(self) -> PlacedRun | None:
        """The fastest slack whose layout planned ahead fits the device."""
        fitting = [r for r in self.runs if r.fits and r.layout_fits]
        return min(fitting, key=lambda r: r.unmoved_step_s) if fitting else None

    def to_json(self) -> dict[str, Any]:
        best, laid_out = self.best, self.best_laid_out
        return {
            "in_order_s": self.in_order_s,
            "device_memory": self.device_memory,
            "step_time_s": best.step_time_s if best else None,
            "slack": best.slack if best else None,
            "laid_out_step_s": laid_out.unmoved_step_s if laid_out else None,
            "laid_out_slack": laid_out.slack if laid_out else None,
            "runs": [r.to_json() for r in self.runs],
        }


class _AddressSpace:
    """Live buffers by address in [0, size). Not thread-safe: one replay owns it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.chunks: dict[int, tuple[int, int]] = {}  # key -> (address, bytes)
        self.compactions = 0

    def _holes(self) -> list[tuple[int, int]]:
        holes: list[tuple[int, int]] = []
        at = 0
        for address, nbytes in sorted(self.chunks.values()):
            if address > at:
                holes.append((at, address - at))
            at = max(at, address + nbytes)
        if at < self.size:
            holes.append((at, self.size - at))
        return holes

    def allocate(self, key: int, nbytes: int) -> bool:
        """Best fit, at the start of the smallest hole that holds it."""
        fitting = [h for h in self._holes() if h[1] >= nbytes]
        if not fitting:
            return False
        self.chunks[key] = (min(fitting, key=lambda h: h[1])[0], nbytes)
        return True

    def free(self, key: int) -> None:
        self.chunks.pop(key, None)

    def make_room(self, key: int, nbytes: int, keep: frozenset[int]) -> tuple[int, bool]:
        """Places `key` where moving the fewest live bytes makes a hole; returns the bytes
        moved and whether a tensor of `keep` had to move."""
        spans = sorted((a, n, k) for k, (a, n) in self.chunks.items())
        windows: list[tuple[int, bool, int, list[tuple[int, int, int]]]] = []
        for start in sorted({0, *(a + n for a, n, _ in spans)}):
            if start + nbytes > self.size:
                break
            inside = [s for s in spans if s[0] < start + nbytes and s[0] + s[1] > start]
            touches_kept = any(k in keep for _, _, k in inside)
            windows.append((sum(n for _, n, _ in inside), touches_kept, start, inside))
        # Windows free of the kernel's own inputs first, then the cheapest.
        windows.sort(key=lambda w: (w[1], w[0]))
        for moved, touches_kept, start, inside in windows[:_WINDOWS_TRIED]:
            saved = dict(self.chunks)
            for _, _, k in inside:
                del self.chunks[k]
            self.chunks[key] = (start, nbytes)
            if all(self.allocate(k, n) for _, n, k in sorted(inside, key=lambda s: -s[1])):
                return moved, touches_kept
            self.chunks = saved
        return self._compact(key, nbytes, keep)

    def _compact(self, key: int, nbytes: int, keep: frozenset[int]) -> tuple[int, bool]:
        """Every live buffer slid to the bottom in address order; `key` after them."""
        self.compactions += 1
        at = moved = 0
        touched_kept = False
        for address, n, k in sorted((a, n, k) for k, (a, n) in self.chunks.items()):
            if address != at:
                moved += n
                touched_kept = touched_kept or k in keep
            self.chunks[k] = (at, n)
            at += n
        self.chunks[key] = (at, nbytes)
        return moved, touched_kept


@dataclasses.dataclass
class _Placement:
    moved_at: list[int]  # bytes moved before each global op
    failed: list[int]  # per step
    kernel_inputs: list[int]  # per step
    compactions: list[int]  # per step


def _place(mp: _MemoryPlan, b: Buffers, device_memory: int) -> _Placement:
    """Places every allocation of the memory plan's walk best fit, making room where none fits."""
    steps = mp.steps
    space = _AddressSpace(device_memory)
    out = _Placement([0] * (mp.n * steps), [0] * steps, [0] * steps, [0] * steps)

    def allocate(key: int, p: int, keep: frozenset[int]) -> None:
        nbytes = mp.size(key)
        if not space.allocate(key, nbytes):
            step = p // mp.n
            before = space.compactions
            moved, touched_kept = space.make_room(key, nbytes, keep)
            out.failed[step] += 1
            out.kernel_inputs[step] += touched_kept
            out.compactions[step] += space.compactions - before
            out.moved_at[p] += moved

    walk_memory_plan(mp, b, allocate, space.free)
    return out


def placed_ideal(
    plan: StepPlan,
    device_memory: int,
    link_gbps: float,
    device_copy_gbps: float,
    launch_s: float = 0.0,
    latency_s: float = 0.0,
    steps: int = 2,
    launch_queue_depth: int = 0,
    slacks: Sequence[float] = DEFAULT_SLACKS,
    on_slack: Callable[[], None] | None = None,
) -> PlacedIdeal:
    """The in-order Ideal placed with addresses at each of `slacks` (see the module's doc);
    `on_slack` hears when each slack's schedule is done (a progress bar)."""
    if device_copy_gbps <= 0:
        raise ValueError(f"device_copy_gbps must be positive, got {device_copy_gbps}")
    for slack in slacks:
        if not 0.0 <= slack < 1.0:
            raise ValueError(f"a slack is a fraction of the device in [0, 1), got {slack}")
    whole = _memory_plan(plan, device_memory, steps)
    if not isinstance(whole, _MemoryPlan):
        if whole.fits:  # a plan without ops: nothing to place
            runs = tuple(PlacedRun(s, fits=True, layout_fits=True) for s in slacks)
            return PlacedIdeal(0.0, runs, device_memory)
        raise ValueError("the ideal schedule does not fit: some op pins more than the device")
    b = plan_buffers(plan)
    timing = (link_gbps * 1e9, launch_s, latency_s, launch_queue_depth, True)
    in_order_s = _timeline(plan, whole, *timing).step_time_s
    runs: list[PlacedRun] = []
    for slack in slacks:
        memory = int(device_memory * (1.0 - slack))
        mp = whole if slack == 0.0 else _memory_plan(plan, memory, steps)
        if isinstance(mp, _MemoryPlan):
            # The whole device's plan unmoved is the in-order Ideal itself.
            unmoved_s = in_order_s if mp is whole else _timeline(plan, mp, *timing).step_time_s
            runs.append(
                _placed_run(slack, plan, mp, b, device_memory, device_copy_gbps, timing, unmoved_s)
            )
        else:
            runs.append(PlacedRun(slack, fits=False))
        if on_slack is not None:
            on_slack()
    return PlacedIdeal(in_order_s, tuple(runs), device_memory)


def _placed_run(
    slack: float,
    plan: StepPlan,
    mp: _MemoryPlan,
    b: Buffers,
    device_memory: int,
    device_copy_gbps: float,
    timing: tuple[float, float, float, int, bool],
    unmoved_s: float,
) -> PlacedRun:
    placement = _place(mp, b, device_memory)
    measured = placement.moved_at[(mp.steps - 1) * mp.n :]
    moved_plan = dataclasses.replace(
        plan, kernel_s=_with_moves(plan.kernel_s, measured, device_copy_gbps)
    )
    res = _timeline(moved_plan, mp, *timing)
    layout = static_layout(mp, b)
    return PlacedRun(
        slack,
        fits=True,
        step_time_s=res.step_time_s,
        failed_placements=placement.failed[-1],
        needs_kernel_inputs=placement.kernel_inputs[-1],
        moved_bytes=sum(measured),
        compactions=placement.compactions[-1],
        d2h_bytes=res.d2h_bytes,
        live_peak=layout.live_peak,
        layout_peak=layout.peak,
        layout_fits=layout.peak <= device_memory,
        unmoved_step_s=unmoved_s,
    )


def _with_moves(
    kernel_s: Iterable[float], moved: Sequence[int], device_copy_gbps: float
) -> list[float]:
    """Each op's kernel time plus its moves at the device's copy rate (they run before it on
    the compute stream). The earlier steps' ops get the measured step's moves too: the
    measured step starts drained, so that changes nothing it measures."""
    rate = device_copy_gbps * 1e9
    return [k + m / rate for k, m in zip(kernel_s, moved, strict=True)]


def format_placed(report: dict[str, Any]) -> str:
    """The text `tflms simulate --placed` prints."""
    from tflms.planner.report import table

    device = report["device_memory"]
    rows = []
    for r in report["runs"]:
        if not r["fits"]:
            rows.append([f"{r['slack']:.0%}", "does not fit", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                f"{r['slack']:.0%}",
                f"{r['step_time_s']:.3f} s",
                f"{r['step_time_s'] / report['in_order_s']:.3f}x" if report["in_order_s"] else "-",
                str(r["failed_placements"]),
                str(r["needs_kernel_inputs"]),
                f"{r['moved_bytes'] / 1e9:.2f} GB",
                f"{r['layout_peak'] / device:.3f}x" if device else "-",
            ]
        )
    head = (
        "The in-order Ideal placed with addresses (best fit; where no hole fits, tensors moved at "
        "the device's copy rate before the op; the memory plan made for the device less the "
        f"slack). In-order Ideal without addresses: {report['in_order_s']:.3f} s. Laid out "
        "ahead: the address space the same plan needs when every stay on the device is given "
        "its address before the step (largest first, nothing moved), as a multiple of the device."
    )
    if report.get("laid_out_step_s") is not None:
        tail = (
            f"Laid out ahead, the plan fits the device at {report['laid_out_slack']:.0%} slack "
            f"and steps in {report['laid_out_step_s']:.3f} s, moving nothing."
        )
    else:
        tail = "Laid out ahead, the plan fits the device at no slack tried."
    cols = [
        "slack",
        "step",
        "vs in order",
        "no hole",
        "of them, inputs moved",
        "moved",
        "laid out ahead",
    ]
    return textwrap.fill(head, 100) + "\n\n" + table(cols, rows) + "\n\n" + tail
