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
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tflms.planner.replay import StepPlan
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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PlacedIdeal:
    in_order_s: float  # the in-order Ideal, which knows no addresses
    runs: tuple[PlacedRun, ...]

    @property
    def best(self) -> PlacedRun | None:
        fitting = [r for r in self.runs if r.fits]
        return min(fitting, key=lambda r: r.step_time_s) if fitting else None

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {
            "in_order_s": self.in_order_s,
            "step_time_s": best.step_time_s if best else None,
            "slack": best.slack if best else None,
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
    """Walks the memory plan's steps as _MemoryPlan.run did, placing every allocation."""
    n, steps = mp.n, mp.steps
    space = _AddressSpace(device_memory)
    evicted_at: dict[int, list[int]] = {}
    for ev in mp.evictions:
        evicted_at.setdefault(ev.at, []).append(ev.key)
    issued_at: dict[int, list[int]] = {}
    for c in mp.copy_ins:
        issued_at.setdefault(c.issue, []).append(c.key)
    out = _Placement([0] * (n * steps), [0] * steps, [0] * steps, [0] * steps)
    on_device: set[int] = set()

    def allocate(key: int, p: int, keep: frozenset[int]) -> None:
        nbytes = mp.size(key)
        if not space.allocate(key, nbytes):
            step = p // n
            before = space.compactions
            moved, touched_kept = space.make_room(key, nbytes, keep)
            out.failed[step] += 1
            out.kernel_inputs[step] += touched_kept
            out.compactions[step] += space.compactions - before
            out.moved_at[p] += moved
        on_device.add(key)

    for s in range(steps):
        start = s * n
        arriving = [mp.key(t, s) for t in b.step_inputs]
        if s == 0:
            arriving += sorted(b.persistent)
        for key in arriving:
            allocate(key, start, frozenset())
        for i in range(n):
            p = start + i
            # The op waits for its evictions' copies out: their room is free when it starts.
            for key in evicted_at.get(p, ()):
                space.free(key)
                on_device.discard(key)
            made = {mp.key(t, s) for t in b.creates[i]}
            inputs = frozenset(mp.key(t, s) for t in b.pins[i]) - made
            for key in issued_at.get(p, ()):
                allocate(key, p, inputs)
            for t in b.pins[i]:
                key = mp.key(t, s)
                if key not in on_device:  # made by this op
                    allocate(key, p, inputs)
            for t in b.frees[i]:
                key = mp.key(t, s)
                if key in on_device:
                    space.free(key)
                    on_device.discard(key)
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
            return PlacedIdeal(0.0, tuple(PlacedRun(s, fits=True) for s in slacks))
        raise ValueError("the ideal schedule does not fit: some op pins more than the device")
    b = plan_buffers(plan)
    timing = (link_gbps * 1e9, launch_s, latency_s, launch_queue_depth, True)
    in_order_s = _timeline(plan, whole, *timing).step_time_s
    runs: list[PlacedRun] = []
    for slack in slacks:
        memory = int(device_memory * (1.0 - slack))
        mp = whole if slack == 0.0 else _memory_plan(plan, memory, steps)
        if isinstance(mp, _MemoryPlan):
            runs.append(_placed_run(slack, plan, mp, b, device_memory, device_copy_gbps, timing))
        else:
            runs.append(PlacedRun(slack, fits=False))
        if on_slack is not None:
            on_slack()
    return PlacedIdeal(in_order_s, tuple(runs))


def _placed_run(
    slack: float,
    plan: StepPlan,
    mp: _MemoryPlan,
    b: Buffers,
    device_memory: int,
    device_copy_gbps: float,
    timing: tuple[float, float, float, int, bool],
) -> PlacedRun:
    placement = _place(mp, b, device_memory)
    measured = placement.moved_at[(mp.steps - 1) * mp.n :]
    moved_plan = dataclasses.replace(
        plan, kernel_s=_with_moves(plan.kernel_s, measured, device_copy_gbps)
    )
    res = _timeline(moved_plan, mp, *timing)
    return PlacedRun(
        slack,
        fits=True,
        step_time_s=res.step_time_s,
        failed_placements=placement.failed[-1],
        needs_kernel_inputs=placement.kernel_inputs[-1],
        moved_bytes=sum(measured),
        compactions=placement.compactions[-1],
        d2h_bytes=res.d2h_bytes,
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

    rows = []
    for r in report["runs"]:
        if not r["fits"]:
            rows.append([f"{r['slack']:.0%}", "does not fit", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                f"{r['slack']:.0%}",
                f"{r['step_time_s']:.3f} s",
                f"{r['step_time_s'] / report['in_order_s']:.3f}x" if report["in_order_s"] else "-",
                str(r["failed_placements"]),
                str(r["needs_kernel_inputs"]),
                f"{r['moved_bytes'] / 1e9:.2f} GB",
            ]
        )
    head = (
        "The in-order Ideal placed with addresses (best fit; where no hole fits, tensors moved at "
        "the device's copy rate before the op; the memory plan made for the device less the "
        f"slack). In-order Ideal without addresses: {report['in_order_s']:.3f} s."
    )
    cols = ["slack", "step", "vs in order", "no hole", "of them, inputs moved", "moved"]
    return textwrap.fill(head, 100) + "\n\n" + table(cols, rows)
