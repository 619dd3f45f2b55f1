"""The order in which an allocator sees the Ideal's memory plan (yardsticks._MemoryPlan).

The plan says, per op, what leaves the device (evictions), what is reserved for a copy in and
what is made and dies; both placed replays (placed.py, one request at a time; static_layout.py,
every request known ahead) walk it the same way, so they place the same requests in the same
order.
"""

from __future__ import annotations

from collections.abc import Callable

from tflms.planner.yardsticks import Buffers, _MemoryPlan


def walk_memory_plan(
    mp: _MemoryPlan,
    b: Buffers,
    allocate: Callable[[int, int, frozenset[int]], None],
    free: Callable[[int], None],
) -> None:
    """Walks the memory plan's steps as _MemoryPlan.run did, in the order an allocator sees
    them: `allocate(key, global op, the requesting kernel's own inputs)` for every step input,
    copy in's destination and output, `free(key)` for every eviction and death."""
    n, steps = mp.n, mp.steps
    evicted_at: dict[int, list[int]] = {}
    for ev in mp.evictions:
        evicted_at.setdefault(ev.at, []).append(ev.key)
    issued_at: dict[int, list[int]] = {}
    for c in mp.copy_ins:
        issued_at.setdefault(c.issue, []).append(c.key)
    on_device: set[int] = set()

    def arrive(key: int, p: int, keep: frozenset[int]) -> None:
        allocate(key, p, keep)
        on_device.add(key)

    def leave(key: int) -> None:
        if key in on_device:
            free(key)
            on_device.discard(key)

    for s in range(steps):
        start = s * n
        arriving = [mp.key(t, s) for t in b.step_inputs]
        if s == 0:
            arriving += sorted(b.persistent)
        for key in arriving:
            arrive(key, start, frozenset())
        for i in range(n):
            p = start + i
            # The op waits for its evictions' copies out: their room is free when it starts.
            for key in evicted_at.get(p, ()):
                leave(key)
            made = {mp.key(t, s) for t in b.creates[i]}
            inputs = frozenset(mp.key(t, s) for t in b.pins[i]) - made
            for key in issued_at.get(p, ()):
                arrive(key, p, inputs)
            for t in b.pins[i]:
                key = mp.key(t, s)
                if key not in on_device:  # made by this op
                    arrive(key, p, inputs)
            for t in b.frees[i]:
                leave(mp.key(t, s))
