"""Yardsticks the planner computes itself: a lower bound (LB2) and an achievable schedule (Ideal).

The engine's step time with LMS is judged against two figures that bracket the best any
swapping scheme can do on the modelled machine:

- **LB2** (`lb2_s`): no schedule that only swaps (never recomputes) is faster.
- **Ideal** (`ideal`): an offline schedule that is actually carried out here, op by op, on
  the same model of the machine: Belady evictions, copies out as early as possible, copies in
  as early as memory allows, no fragmentation. The optimum lies between the two.

The roofline (max(compute, swapped bytes / bandwidth)) is neither: it ignores that copies out
happen before the memory peak and copies in after it, so it can sit far below what any
schedule needs.

The model both yardsticks share (and the engine obeys, more strictly):

- ops run one after another on the compute stream; op i starts no earlier than the host has
  launched it. The host is the replay's (replay.py): it spends one launch time per op
  (the engine's host_advance), and with a launch queue of depth D it cannot launch op i
  before op i - D has ended (CUDA's launch queue; the engine's replay counts the same
  queue). Neither yardstick blocks the host anywhere else: the Ideal is a schedule ordered
  by stream events, so nothing in it needs the host to wait for a copy, which is the
  engine's cost to pay (a page-out under pressure waits for its copy on the host). LB2
  ignores the queue (it only ever delays ops), so it stays a lower bound;
- memory is counted per op, in BFC-rounded bytes, as live_profile counts it: while op q runs,
  the tensors live at q are either on the device or on the host, and the device holds at most
  M bytes of them; a tensor an op pins (reads, writes, or a sliced root) is on the device;
- a copy out frees its device memory when it completes; a copy in occupies its destination
  from the moment it starts; one device-to-host and one host-to-device link move
  `link_gbps` each;
- the measured step starts with every stream drained (the replay synchronises before it),
  in whatever state the previous step left: persistent tensors may already be on the host.

Copies are priced at the rounded size: the engine copies the raw size plus a fixed latency per
copy, and latency x bandwidth is far above the 255 bytes rounding can add (10 us at 12 GB/s is
120 kB), so a copy never costs the engine less than rounded / bandwidth.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from tflms.planner.replay import StepPlan, _rounded, live_profile

_NEVER = 1 << 62  # "no further use" for Belady


# --------------------------------------------------------------------------- the plan's buffers


@dataclasses.dataclass
class Buffers:
    """A StepPlan seen as device buffers: forwarded outputs are the buffer of their input.

    Ids are the plan's tensor ids of each buffer's first tensor. Sizes are BFC-rounded.
    """

    size: dict[int, int]
    persistent: frozenset[int]
    step_inputs: tuple[int, ...]  # allocated at step start (those no op reads excluded)
    pins: list[tuple[int, ...]]  # per op: buffers that must be on the device while it runs
    creates: list[tuple[int, ...]]  # per op: buffers allocated for it
    frees: list[tuple[int, ...]]  # per op: buffers dead after it

    @property
    def ops(self) -> int:
        return len(self.pins)


def plan_buffers(plan: StepPlan) -> Buffers:
    """Maps the plan's tensors onto buffers and lists, per op, what must be resident."""
    owner: dict[int, int] = {}  # tensor -> buffer (itself, or the input it was forwarded from)

    def buf(t: int) -> int:
        return owner.get(t, t)

    size = {t: _rounded(b) for t, b in plan.persistent}
    size.update((t, _rounded(b)) for t, b in plan.step_inputs)
    n = len(plan.inputs)
    pins: list[tuple[int, ...]] = []
    creates: list[tuple[int, ...]] = []
    frees: list[tuple[int, ...]] = []
    slice_count: dict[int, int] = {}  # root -> slicing ops whose views are still alive
    for i in range(n):
        for root in plan.slice_pins[i] if plan.slice_pins else ():
            slice_count[root] = slice_count.get(root, 0) + 1
        made = []
        for t, b in plan.outputs[i]:
            size[t] = _rounded(b)
            made.append(t)
        for out, src in plan.forwards[i] if plan.forwards else ():
            owner[out] = buf(src)
        pinned = [buf(t) for t in plan.inputs[i]]
        pinned += made
        pinned += [buf(r) for r, c in slice_count.items() if c > 0]
        pins.append(tuple(dict.fromkeys(pinned)))
        creates.append(tuple(made))
        frees.append(tuple(buf(t) for t in plan.frees[i]))
        for root in plan.slice_unpins[i] if plan.slice_unpins else ():
            slice_count[root] -= 1
    skipped = set(plan.free_at_start)
    return Buffers(
        size=size,
        persistent=frozenset(t for t, _ in plan.persistent),
        step_inputs=tuple(t for t, _ in plan.step_inputs if t not in skipped),
        pins=pins,
        creates=creates,
        frees=frees,
    )


# --------------------------------------------------------------------------- LB2


def host_bound_ends(kernel_s: Sequence[float], launch_s: float) -> list[float]:
    """End of each op with unlimited memory: op i starts after op i-1 and after its launch."""
    ends = []
    t = 0.0
    for i, k in enumerate(kernel_s):
        t = max(t, (i + 1) * launch_s) + k
        ends.append(t)
    return ends


def excess_profiles(plan: StepPlan, device_memory: int) -> tuple[list[int], list[int]]:
    """Per op, the bytes that must have gone out before it, and that must come back after it.

    While op q runs at most M = device_memory of its live bytes are on the device, so at least
    live_q - M are on the host. Two kinds of those need not cross the link in this step:
    - out: a persistent tensor (variable, slot) may have been on the host since the previous
      step; every other tensor was born on the device in this step. So the bytes that left in
      this step are at least live_q - M - (persistent bytes op q does not pin).
    - in: a tensor that no later op pins (its last readers, if any, read no bytes: Identity,
      Shape) stays on the host until it dies or the step ends. So the bytes that come back
      after q are at least live_q - M - (bytes live at q, unpinned at q and pinned no later).
    """
    b = plan_buffers(plan)
    n = b.ops
    live = live_profile(plan)
    persistent_total = sum(b.size[t] for t in b.persistent)
    out_excess = []
    for q in range(n):
        pinned_p = sum(b.size[t] for t in b.pins[q] if t in b.persistent)
        out_excess.append(live[q] - device_memory - (persistent_total - pinned_p))
    # Each buffer, from after its last pin to its death, needs no copy in: a difference array.
    birth: dict[int, int] = dict.fromkeys(b.persistent, 0)
    birth.update(dict.fromkeys(b.step_inputs, 0))
    death: dict[int, int] = dict.fromkeys(b.persistent, n - 1)
    last_pin: dict[int, int] = {}
    for q in range(n):
        for t in b.creates[q]:
            birth[t] = q
        for t in b.pins[q]:
            last_pin[t] = q
        for t in b.frees[q]:
            death[t] = q
    idle = [0] * (n + 1)
    for t, start in birth.items():
        lo = max(start, last_pin[t] + 1) if t in last_pin else start
        hi = death.get(t, n - 1)
        if lo <= hi:
            idle[lo] += b.size[t]
            idle[hi + 1] -= b.size[t]
    in_excess = []
    running = 0
    for q in range(n):
        running += idle[q]
        in_excess.append(live[q] - device_memory - running)
    return out_excess, in_excess


def lb2_s(plan: StepPlan, device_memory: int, link_gbps: float, launch_s: float = 0.0) -> float:
    """A lower bound on the step time of any schedule that swaps and never recomputes.

    Let C be the compute time, before_q the compute before op q starts, after_q the compute
    after it ends, and xo_q, xi_q the times the link needs for the bytes that must have left
    before q and must come back after q (excess_profiles; the whole excess live_q - M when no
    tensor is persistent or read only by pin-free ops). Then, for any ops q' <= q:

    - op q' cannot start before xo_q': those bytes left through one link that was idle when
      the step began (streams are drained), and their memory is only free once the copy ends;
    - ops q'..q run after that, one after another, so op q ends no earlier than
      xo_q' + compute(q'..q), and no earlier than before_q' + compute(q'..q) either;
    - the bytes on the host at the end of q come back through the other link, each copy
      starting after q ends (its destination is not on the device while q runs), and the step
      ends after them and after the ops that follow q.

    So step >= max(before_q', xo_q') + compute(q'..q) + max(after_q, xi_q)
             = C + (xo_q' - before_q')+ + (xi_q - after_q)+.
    The two links are independent, so the forced waits add. Taking q' = q gives the older
    single-cut bound (replay.swap_bound_s) plus the op's own kernel time, and letting q' run
    ahead of q catches a memory peak that is not where the excess is largest on each side.

    With a launch time per op, C and the end of op q become those of the host-bound
    recurrence (host_bound_ends): the step is at least the unlimited-memory step U, the end of
    op q there plus xi_q, xo_q plus all compute from q on, and the sum above.

    All four maxima are computed in one pass: a running max of (xo_q' - before_q')+ over
    q' <= q pairs with (xi_q - after_q)+ at each q, O(n).
    """
    n = len(plan.kernel_s)
    if n == 0:
        return 0.0
    bw = link_gbps * 1e9
    out_excess, in_excess = excess_profiles(plan, device_memory)
    ends = host_bound_ends(plan.kernel_s, launch_s)
    total = plan.compute_s
    bound = ends[-1]
    before = 0.0
    best_out = 0.0  # max over q' <= q of (xo_q' - before_q')+
    for q in range(n):
        k = plan.kernel_s[q]
        after = total - before - k
        xo = max(0, out_excess[q]) / bw
        xi = max(0, in_excess[q]) / bw
        best_out = max(best_out, xo - before)
        bound = max(
            bound,
            xo + total - before,  # wait for the copies out, then every kernel from q on
            ends[q] + xi,  # the copies in after q
            total + best_out + max(0.0, xi - after),
        )
        before += k
    return bound


# --------------------------------------------------------------------------- Ideal


@dataclasses.dataclass
class IdealResult:
    """The offline schedule's measured step (the last of `steps`), or why it cannot run."""

    fits: bool
    step_time_s: float = 0.0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    compute_stall_s: float = 0.0  # the compute stream waiting for copies
    evictions: int = 0
    oom_op: int = -1  # the op whose pinned buffers alone exceed the device, when not fits
    # The most bytes the schedule holds on the host during the measured step: each eviction
    # from the start of its copy out until its copy in has landed (or its tensor died). The
    # schedule knows no host limit; where this exceeds the machine's, it cannot run there.
    host_peak_bytes: int = 0
    # When each op of the measured step ends, from the step's start (behind.py compares the
    # engine's replay with it op by op); not in the JSON.
    op_end_s: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    # Seconds each link has been busy from the step's start to each op's end (behind.py
    # sets them beside the replay's); not in the JSON.
    d2h_busy_to_op_s: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    h2d_busy_to_op_s: tuple[float, ...] = dataclasses.field(default=(), repr=False)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("op_end_s", "d2h_busy_to_op_s", "h2d_busy_to_op_s"):
            del out[key]
        return out


@dataclasses.dataclass
class _Eviction:
    key: int
    at: int  # global op that needed the room (it waits for the copy out)
    anchor: int  # global op after which the copy out may start; -1 - step: the step's start
    nbytes: int


@dataclasses.dataclass
class _CopyIn:
    key: int
    after: int  # global op of the eviction that sent it out
    need: int  # global op that pins it
    nbytes: int
    issue: int = -1  # global op from which its destination is reserved


def _instance_key(buf: int, step: int, persistent: bool, stride: int) -> int:
    # A persistent buffer is one object across steps; every other tensor is new each step.
    return buf if persistent else (step + 1) * stride + buf


class _MemoryPlan:
    """Belady over op indices: what is on the device during each op, and the copies that moves."""

    def __init__(self, b: Buffers, steps: int, device_memory: int) -> None:
        self.b = b
        self.n = b.ops
        self.steps = steps
        self.memory = device_memory
        self.stride = max([*b.size, 0]) + 1
        self.pins_of: dict[int, list[int]] = {}
        for s in range(steps):
            for i, pinned in enumerate(b.pins):
                for t in pinned:
                    self.pins_of.setdefault(self.key(t, s), []).append(s * self.n + i)
        self.evictions: list[_Eviction] = []
        self.copy_ins: list[_CopyIn] = []
        # (key, op of its eviction, op after which it died on the host): a copy never needed
        self.dropped: list[tuple[int, int, int]] = []
        self.mem = np.zeros(steps * self.n, dtype=np.int64)
        self.oom_op = -1

    def key(self, t: int, step: int) -> int:
        return _instance_key(t, step, t in self.b.persistent, self.stride)

    def size(self, key: int) -> int:
        return self.b.size[key % self.stride if key >= self.stride else key]

    def run(self) -> bool:
        """Fills evictions, copy_ins and mem; False when some op's pinned buffers exceed M."""
        resident: dict[int, int] = {}
        on_host: dict[int, int] = {}  # key -> global op of its eviction
        last_pin: dict[int, int] = {}
        next_use: dict[int, int] = {}
        cursor: dict[int, int] = {}
        heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped
        used = 0

        def schedule(key: int, after: int) -> None:
            uses = self.pins_of.get(key, [])
            i = cursor.get(key, 0)
            while i < len(uses) and uses[i] <= after:
                i += 1
            cursor[key] = i
            nu = uses[i] if i < len(uses) else _NEVER
            next_use[key] = nu
            heapq.heappush(heap, (-nu, key))

        for s in range(self.steps):
            start = s * self.n
            arriving = [self.key(t, s) for t in self.b.step_inputs]
            if s == 0:
                arriving += sorted(self.b.persistent)
            for key in arriving:
                resident[key] = self.size(key)
                used += resident[key]
                schedule(key, start - 1)
            for i in range(self.n):
                p = start + i
                pinned = [self.key(t, s) for t in self.b.pins[i]]
                for key in pinned:
                    if key not in resident:
                        if key in on_host:
                            self.copy_ins.append(_CopyIn(key, on_host.pop(key), p, self.size(key)))
                        resident[key] = self.size(key)
                        used += resident[key]
                    next_use[key] = p
                while used > self.memory:
                    victim = self._pop_victim(heap, resident, next_use, p)
                    if victim is None:
                        self.oom_op = p
                        return False
                    used -= resident.pop(victim)
                    on_host[victim] = p
                    lp = last_pin.get(victim, -1)
                    anchor = lp if lp >= start else -1 - s
                    self.evictions.append(_Eviction(victim, p, anchor, self.size(victim)))
                self.mem[p] = used
                for key in pinned:
                    last_pin[key] = p
                    schedule(key, p)
                for t in self.b.frees[i]:
                    key = self.key(t, s)
                    if key in resident:
                        used -= resident.pop(key)
                    evicted_at = on_host.pop(key, None)  # dead on the host: its copy is dropped
                    if evicted_at is not None:
                        self.dropped.append((key, evicted_at, p))
        return True

    @staticmethod
    def _pop_victim(
        heap: list[tuple[int, int]], resident: dict[int, int], next_use: dict[int, int], p: int
    ) -> int | None:
        """The resident buffer used farthest in the future, or None if all are pinned by p."""
        while heap:
            neg, key = heapq.heappop(heap)
            if key not in resident or next_use.get(key) != -neg:
                continue
            if -neg <= p:  # the farthest is needed now: everything left is pinned
                heapq.heappush(heap, (neg, key))
                return None
            return key
        return None

    def place_copy_ins(self) -> None:
        """Each copy in starts at the earliest op from which memory stays within M until use.

        Taken in order of need, so a nearer use gets the room first; never before the step of
        its use (a copy in the previous step would be free in a measured step that starts
        drained) and never before the eviction that sent it out.
        """
        for c in self.copy_ins:
            lo = max(c.after + 1, c.need - c.need % self.n)
            seg = self.mem[lo : c.need]
            over = np.flatnonzero(seg + c.nbytes > self.memory)
            c.issue = lo + (int(over[-1]) + 1 if over.size else 0)
            self.mem[c.issue : c.need] += c.nbytes


class _Link:
    """One copy direction, non-preemptive: earliest deadline first among copies ready to go,
    or, `in_order`, in the order the copies were released, as a CUDA stream runs what was
    enqueued on it (a copy that may not start yet holds back every later one)."""

    def __init__(self, bytes_per_s: float, latency_s: float, in_order: bool = False) -> None:
        self.rate = bytes_per_s
        self.latency = latency_s
        self.in_order = in_order
        self.free = 0.0
        self.waiting: list[tuple[float, int, int, int]] = []  # (ready, deadline, id, bytes)
        self.ready: list[tuple[int, int, int]] = []  # (deadline, id, bytes)
        self.queue: collections.deque[tuple[float, int, int]] = collections.deque()
        self.done: dict[int, float] = {}
        self.busy_bytes = 0
        self.spans: list[tuple[float, float]] = []  # (start, end) of each copy, in order
        # A copy may not start before before_copy(task, t) (host room); after_copy(task, t)
        # hears when one ended.
        self.before_copy: Callable[[int, float], float] | None = None
        self.after_copy: Callable[[int, float], None] | None = None

    def release(self, task: int, ready_t: float, deadline: int, nbytes: int) -> None:
        if self.in_order:
            self.queue.append((ready_t, task, nbytes))
        else:
            heapq.heappush(self.waiting, (ready_t, deadline, task, nbytes))

    def finish(self, tasks: Iterable[int]) -> float:
        """Runs the link until every one of `tasks` is done; returns when the last one ended."""
        latest = 0.0
        for task in tasks:
            while task not in self.done:
                self._step()
            latest = max(latest, self.done[task])
        return latest

    def drain(self) -> float:
        while self.waiting or self.ready or self.queue:
            self._step()
        return self.free

    def _step(self) -> None:
        if self.in_order:
            if not self.queue:
                raise RuntimeError("a copy was awaited that was never released")
            ready_t, task, nbytes = self.queue.popleft()
            self.free = max(self.free, ready_t)
            self._copy(task, nbytes)
            return
        while self.waiting and self.waiting[0][0] <= self.free:
            _, deadline, task, nbytes = heapq.heappop(self.waiting)
            heapq.heappush(self.ready, (deadline, task, nbytes))
        if not self.ready:
            if not self.waiting:
                raise RuntimeError("a copy was awaited that was never released")
            self.free = self.waiting[0][0]  # idle until the next copy may start
            return
        _, task, nbytes = heapq.heappop(self.ready)
        self._copy(task, nbytes)

    def _copy(self, task: int, nbytes: int) -> None:
        """Runs one copy from `free` on."""
        if self.before_copy is not None:
            self.free = self.before_copy(task, self.free)
        start = self.free
        self.free += self.latency + nbytes / self.rate
        self.spans.append((start, self.free))
        self.done[task] = self.free
        self.busy_bytes += nbytes
        if self.after_copy is not None:
            self.after_copy(task, self.free)


def ideal(
    plan: StepPlan,
    device_memory: int,
    link_gbps: float,
    launch_s: float = 0.0,
    latency_s: float = 0.0,
    steps: int = 2,
    launch_queue_depth: int = 0,
    in_order: bool = False,
    out_in_order: bool | None = None,
    in_in_order: bool | None = None,
    hold_out_ops: int = 0,
) -> IdealResult:
    """An achievable offline schedule of `steps` steps; the last is measured, as the replay does.

    Memory (_MemoryPlan): walking the ops, a pinned buffer on the host comes back, outputs are
    allocated, and while more than M bytes are on the device the buffer whose next pin is
    farthest away is evicted (Belady; a persistent buffer's next pin may be in the next step).
    Each copy in is then moved to the earliest op from which the memory, with its bytes added,
    stays within M until its use.

    Time: an eviction's copy out may start when the victim's last pin before the eviction
    ended (or when the step began, if that was in an earlier step), and the op that needed the
    room waits for it; a copy in may start once the op where its room was reserved may start
    (the previous op ended, that op's evictions done), and the op that pins it waits for it.
    Each link serves ready copies earliest deadline first. The step is drained at its start
    and end, like the replay's measured step.

    The host runs under the replay's host model: op i is launched `launch_s` after op i - 1
    was, and, with `launch_queue_depth` D > 0, not before op i - D has ended; the engine's
    replay uses the same launch time and queue (replay.LAUNCH_QUEUE_DEPTH), so the two are
    compared under one host. The schedule itself never blocks the host on a copy.

    `in_order`: each link runs its copies in the order they were released (ops' order), as
    the engine's CUDA copy streams do, instead of earliest deadline first. `out_in_order` and
    `in_in_order` set the device-to-host and host-to-device links apart (None: `in_order`).
    `hold_out_ops`: copies out are released in deadline order within that many ops, as a host
    that holds a copy until the copies due sooner and released in the next `hold_out_ops` ops
    were enqueued would (_held_anchors); 0 releases each at its victim's last use.
    """
    mp = _memory_plan(plan, device_memory, steps)
    if isinstance(mp, IdealResult):
        return mp
    return _timeline(
        plan,
        mp,
        link_gbps * 1e9,
        launch_s,
        latency_s,
        launch_queue_depth,
        in_order,
        out_in_order=out_in_order,
        in_in_order=in_in_order,
        hold_out_ops=hold_out_ops,
    )


def _held_anchors(evictions: Sequence[_Eviction], hold_ops: int) -> list[int]:
    """Each eviction's release op when copies out are held in deadline order.

    A copy out whose victim's last use was at op a waits for every copy out released in
    (a, a + hold_ops] that is due before it, so on an in-order link none of those queues
    behind it. A held copy is still released before its own deadline: the copies it waits
    for are released before theirs, which come first. Copies released at a step's start
    (anchor < 0) are not held.
    """
    order = sorted((ev.anchor, j) for j, ev in enumerate(evictions) if ev.anchor >= 0)
    anchors = [a for a, _ in order]
    out = [ev.anchor for ev in evictions]
    for j, ev in enumerate(evictions):
        if ev.anchor < 0 or hold_ops <= 0:
            continue
        lo = bisect.bisect_right(anchors, ev.anchor)
        hi = bisect.bisect_right(anchors, ev.anchor + hold_ops)
        for a, k in order[lo:hi]:
            if evictions[k].at < ev.at:
                out[j] = max(out[j], a)
    return out


def _memory_plan(plan: StepPlan, device_memory: int, steps: int) -> _MemoryPlan | IdealResult:
    """The Ideal's evictions and copies in, or why there is no schedule (IdealResult)."""
    b = plan_buffers(plan)
    if b.ops == 0:
        return IdealResult(fits=True)
    mp = _MemoryPlan(b, steps, device_memory)
    if not mp.run():
        return IdealResult(fits=False, oom_op=mp.oom_op % b.ops)
    mp.place_copy_ins()
    return mp


class _HostFull(Exception):
    """A copy out finds no host room, and no copy under way or due would make any."""


class _HostLedger:
    """The bytes on the host over time, for a schedule kept within a host limit.

    An eviction takes its bytes when its copy out starts and gives them back when its copy
    in lands or its tensor dies on the host. Copies out start in time order (one link), so
    every take is known by then and only releases lie ahead: a copy out starts at the first
    moment from which its bytes fit.
    """

    def __init__(self, limit: int, h2d: _Link) -> None:
        self.limit = limit
        self.h2d = h2d
        self.events: list[tuple[float, int]] = []  # (time, +take / -release), sorted

    def add(self, t: float, delta: int) -> None:
        bisect.insort(self.events, (t, delta))

    def room_from(self, t: float, nbytes: int) -> float:
        while True:
            held = sum(d for when, d in self.events if when <= t)
            if held + nbytes <= self.limit:
                return t
            for when, d in self.events:
                if when > t and d < 0:
                    held += d
                    if held + nbytes <= self.limit:
                        return when
            # Copies in already released may land and make room: run them.
            if not (self.h2d.waiting or self.h2d.ready or self.h2d.queue):
                raise _HostFull
            self.h2d._step()


def _timeline(
    plan: StepPlan,
    mp: _MemoryPlan,
    bytes_per_s: float,
    launch_s: float,
    latency_s: float,
    depth: int = 0,
    in_order: bool = False,
    host_limit: int | None = None,
    *,
    out_in_order: bool | None = None,
    in_in_order: bool | None = None,
    hold_out_ops: int = 0,
) -> IdealResult:
    n, steps = mp.n, mp.steps
    total = n * steps
    victims_at: list[list[int]] = [[] for _ in range(total)]
    outs_after: list[list[int]] = [[] for _ in range(total)]
    outs_at_start: list[list[int]] = [[] for _ in range(steps)]
    anchors = _held_anchors(mp.evictions, hold_out_ops)
    for j, ev in enumerate(mp.evictions):
        victims_at[ev.at].append(j)
        if anchors[j] >= 0:
            outs_after[anchors[j]].append(j)
        else:
            outs_at_start[-1 - ev.anchor].append(j)
    if hold_out_ops > 0:
        for released in outs_after:
            released.sort(key=lambda j: mp.evictions[j].at)
    issued_at: list[list[int]] = [[] for _ in range(total)]
    needed_at: list[list[int]] = [[] for _ in range(total)]
    for j, c in enumerate(mp.copy_ins):
        issued_at[c.issue].append(j)
        needed_at[c.need].append(j)
    d2h = _Link(bytes_per_s, latency_s, in_order if out_in_order is None else out_in_order)
    h2d = _Link(bytes_per_s, latency_s, in_order if in_in_order is None else in_in_order)
    op_end = np.zeros(total)
    drops_after: dict[int, list[int]] = collections.defaultdict(list)
    if host_limit is not None:
        ledger = _HostLedger(host_limit, h2d)

        def take(j: int, t: float) -> float:
            start = ledger.room_from(t, mp.evictions[j].nbytes)
            ledger.add(start, mp.evictions[j].nbytes)
            return start

        d2h.before_copy = take
        h2d.after_copy = lambda j, t: ledger.add(t, -mp.copy_ins[j].nbytes)
        for key, _, p in mp.dropped:
            drops_after[p].append(mp.size(key))
    t0 = end = stall = launched = 0.0
    d2h_before = h2d_before = 0
    ends: list[float] = []  # this step's op ends, for the launch queue
    for p in range(total):
        i = p % n
        if i == 0:
            # The replay synchronises before the measured step: it starts drained.
            t0 = end = launched = max(end, d2h.drain(), h2d.drain())
            d2h_before, h2d_before, stall = d2h.busy_bytes, h2d.busy_bytes, 0.0
            ends = []
            for j in outs_at_start[p // n]:
                ev = mp.evictions[j]
                d2h.release(j, t0, ev.at, ev.nbytes)
        # The host launches op i one launch time after op i - 1, once the queue has room.
        launched += launch_s
        if depth > 0 and i >= depth:
            launched = max(launched, ends[i - depth])
        ready = max(end, d2h.finish(victims_at[p]))
        for j in issued_at[p]:
            c = mp.copy_ins[j]
            h2d.release(j, ready, c.need, c.nbytes)
        arrived = h2d.finish(needed_at[p])
        start = max(ready, launched, arrived)
        stall += start - max(end, launched)
        end = start + plan.kernel_s[i]
        op_end[p] = end
        for nbytes in drops_after.get(p, ()):
            ledger.add(end, -nbytes)
        ends.append(end)
        for j in outs_after[p]:
            ev = mp.evictions[j]
            d2h.release(j, end, ev.at, ev.nbytes)
    finish = max(end, d2h.drain(), h2d.drain())
    return IdealResult(
        fits=True,
        step_time_s=finish - t0,
        d2h_bytes=d2h.busy_bytes - d2h_before,
        h2d_bytes=h2d.busy_bytes - h2d_before,
        compute_stall_s=stall,
        evictions=sum(1 for ev in mp.evictions if ev.at >= (steps - 1) * n),
        host_peak_bytes=_host_peak(mp, d2h, h2d, op_end, t0, latency_s, bytes_per_s),
        op_end_s=tuple(float(t) - t0 for t in op_end[total - n :]),
        d2h_busy_to_op_s=_busy_until(d2h.spans, t0, op_end[total - n :]),
        h2d_busy_to_op_s=_busy_until(h2d.spans, t0, op_end[total - n :]),
    )


def _busy_until(
    spans: Sequence[tuple[float, float]], t0: float, times: Iterable[float]
) -> tuple[float, ...]:
    """Seconds a link's copies (`spans`, one after another) ran from t0 to each of `times`
    (non-decreasing)."""
    runs = [(max(start, t0), end) for start, end in spans if end > t0]
    out: list[float] = []
    k = 0
    done = 0.0
    for t in times:
        while k < len(runs) and runs[k][1] <= t:
            done += runs[k][1] - runs[k][0]
            k += 1
        partial = t - runs[k][0] if k < len(runs) and runs[k][0] < t else 0.0
        out.append(done + partial)
    return tuple(out)


def _host_peak(
    mp: _MemoryPlan,
    d2h: _Link,
    h2d: _Link,
    op_end: np.ndarray,
    t0: float,
    latency_s: float,
    bytes_per_s: float,
) -> int:
    """The most bytes on the host from `t0` (the measured step's start) on.

    A copy in and a drop give back the bytes of the eviction before them: the same buffer's.
    """
    events: list[tuple[float, int]] = []  # (time, bytes): a release sorts before a take
    for j, ev in enumerate(mp.evictions):
        events.append((d2h.done[j] - latency_s - ev.nbytes / bytes_per_s, ev.nbytes))
    for j, c in enumerate(mp.copy_ins):
        events.append((h2d.done[j], -c.nbytes))
    for key, _, p in mp.dropped:
        events.append((float(op_end[p]), -mp.size(key)))
    events.sort()
    held = peak = 0
    for t, delta in events:
        if t >= t0:  # what is held until this event, the step's start included
            peak = max(peak, held)
        held += delta
    # Bytes still held after the last event stay on the host through the step.
    return max(peak, held)


# --------------------------------------------------------------------------- reports


@dataclasses.dataclass(frozen=True)
class Yardsticks:
    """Both yardsticks for one plan on one machine (they do not depend on the LMS variant)."""

    lb2_s: float
    ideal: IdealResult
    # The same schedule with copies run in the order they were issued, as the engine's CUDA
    # copy streams run them: a yardstick for this engine's design (still no fragmentation).
    ideal_in_order: IdealResult
    # Where the Ideal holds more on the host than `host_limit`: the same evictions and copies
    # in with each copy out waiting until its bytes fit on the host (the closest schedule of
    # this kind the machine can run; fits False where a copy out would wait for room only a
    # later op's copy in frees). None where the Ideal keeps within the limit.
    ideal_within_host: IdealResult | None = None
    ideal_in_order_within_host: IdealResult | None = None  # the same, copies in issue order

    def to_json(self) -> dict[str, Any]:
        out = {
            "lb2_s": self.lb2_s,
            "ideal": self.ideal.to_json(),
            "ideal_in_order": self.ideal_in_order.to_json(),
        }
        if self.ideal_within_host is not None:
            out["ideal_within_host"] = self.ideal_within_host.to_json()
        if self.ideal_in_order_within_host is not None:
            out["ideal_in_order_within_host"] = self.ideal_in_order_within_host.to_json()
        return out


def yardsticks(
    plan: StepPlan,
    device_memory: int,
    link_gbps: float,
    launch_s: float,
    latency_s: float,
    steps: int = 2,
    launch_queue_depth: int = 0,
    host_limit: int | None = None,
) -> Yardsticks:
    mp = _memory_plan(plan, device_memory, steps)
    within: list[IdealResult | None] = [None, None]
    if isinstance(mp, IdealResult):
        edf = in_order = mp
    else:

        def run(in_order: bool, limit: int | None = None) -> IdealResult:
            args = (link_gbps * 1e9, launch_s, latency_s, launch_queue_depth, in_order, limit)
            try:
                return _timeline(plan, mp, *args)
            except _HostFull:
                return IdealResult(fits=False)

        edf, in_order = run(False), run(True)
        if host_limit is not None and max(edf.host_peak_bytes, in_order.host_peak_bytes) > (
            host_limit
        ):
            within = [run(False, host_limit), run(True, host_limit)]
    return Yardsticks(
        lb2_s=lb2_s(plan, device_memory, link_gbps, launch_s),
        ideal=edf,
        ideal_in_order=in_order,
        ideal_within_host=within[False],
        ideal_in_order_within_host=within[True],
    )


def annotate(row: dict[str, Any], ys: Yardsticks) -> dict[str, Any]:
    """Adds lb2_s, ideal_s and the engine's ratios to them to one LMS run's JSON."""
    row["lb2_s"] = ys.lb2_s
    row["ideal_s"] = ys.ideal.step_time_s if ys.ideal.fits else None
    row["ideal"] = ys.ideal.to_json()
    step = row.get("step_time_s") if row.get("fits") else None
    row["lb2_ratio"] = step / ys.lb2_s if step and ys.lb2_s > 0 else None
    ideal_s = row["ideal_s"]
    row["ideal_ratio"] = step / ideal_s if step and ideal_s else None
    in_order = ys.ideal_in_order
    row["ideal_in_order_s"] = in_order.step_time_s if in_order.fits else None
    row["ideal_in_order_ratio"] = (
        step / row["ideal_in_order_s"] if step and row["ideal_in_order_s"] else None
    )
    row["ideal_in_order_host_peak_bytes"] = in_order.host_peak_bytes
    for name, res in (
        ("ideal_within_host", ys.ideal_within_host),
        ("ideal_in_order_within_host", ys.ideal_in_order_within_host),
    ):
        row[f"{name}_s"] = res.step_time_s if res and res.fits else None
        row[f"{name}_ratio"] = step / row[f"{name}_s"] if step and row[f"{name}_s"] else None
    return row
