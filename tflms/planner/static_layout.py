"""A layout planned ahead for the in-order Ideal (`tflms simulate --placed`, its last columns).

`placed.py` places the Ideal's allocations one at a time, as an allocator that does not know
the future must, and moves tensors where a request finds no hole. A runtime that has learnt the
step knows every allocation of it in advance (size, when it is made, when it is freed or paged
out), so it could instead give each one an address before the step runs. This computes such a
layout for the Ideal's memory plan and says how much address space it needs:

- every stay of a buffer on the device (from its allocation, or its copy in's reservation, to
  its death or its page-out) is one interval in time with a size, in the order the memory
  plan's walk makes and frees them (memory_walk.walk_memory_plan);
- intervals are given offsets greedily, largest first (ties: earliest first), each at the start
  of the smallest gap that holds it among the intervals it overlaps in time, or above all of
  them: the greedy-by-size heuristic of offline tensor arena planners;
- the layout's peak (the highest end of any interval) is what it needs; the live bytes' peak
  is a bound no layout beats, so `peak / live peak` is the layout's own fragmentation.

Where the peak is within the device, the Ideal's schedule needs no move at all: every tensor
lies where the plan put it. The heuristic is not optimal (the problem is NP-hard), so a peak
over the device says this layout does not fit, not that none does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tflms.planner.memory_walk import walk_memory_plan
from tflms.planner.yardsticks import Buffers, _MemoryPlan


@dataclasses.dataclass(frozen=True)
class Intervals:
    """Each stay on the device: [start, end) in walk events, and its bytes."""

    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    def live_peak(self) -> int:
        """The most bytes live at one event."""
        if len(self) == 0:
            return 0
        times = np.concatenate([self.start, self.end])
        deltas = np.concatenate([self.nbytes, -self.nbytes])
        # At equal times a free comes before an allocation: [start, end) is half open.
        order = np.lexsort((deltas, times))
        return int(np.cumsum(deltas[order]).max())


def residency_intervals(mp: _MemoryPlan, b: Buffers) -> Intervals:
    """Every stay on the device of the memory plan's walk; stays not ended by the end of the
    run end there."""
    clock = 0
    opened: dict[int, tuple[int, int]] = {}  # key -> (start event, bytes)
    start: list[int] = []
    end: list[int] = []
    nbytes: list[int] = []

    def close(key: int, at: int) -> None:
        t0, n = opened.pop(key)
        start.append(t0)
        end.append(at)
        nbytes.append(n)

    def allocate(key: int, p: int, keep: frozenset[int]) -> None:
        nonlocal clock
        del p, keep
        opened[key] = (clock, mp.size(key))
        clock += 1

    def free(key: int) -> None:
        nonlocal clock
        close(key, clock)
        clock += 1

    walk_memory_plan(mp, b, allocate, free)
    for key in list(opened):
        close(key, clock)
    return Intervals(
        np.asarray(start, dtype=np.int64),
        np.asarray(end, dtype=np.int64),
        np.asarray(nbytes, dtype=np.int64),
    )


def assign_offsets(iv: Intervals) -> np.ndarray:
    """Greedy by size, best gap: an offset per interval."""
    offsets = np.zeros(len(iv), dtype=np.int64)
    order = np.lexsort((iv.start, -iv.nbytes))
    done_start = np.empty(len(order), dtype=np.int64)
    done_end = np.empty(len(order), dtype=np.int64)
    done_lo = np.empty(len(order), dtype=np.int64)
    done_hi = np.empty(len(order), dtype=np.int64)
    for m, i in enumerate(order):
        t0, t1, size = iv.start[i], iv.end[i], int(iv.nbytes[i])
        overlap = (done_start[:m] < t1) & (done_end[:m] > t0)
        lo, hi = done_lo[:m][overlap], done_hi[:m][overlap]
        at = _best_gap(lo, hi, size)
        offsets[i] = at
        done_start[m], done_end[m], done_lo[m], done_hi[m] = t0, t1, at, at + size
    return offsets


def _best_gap(lo: np.ndarray, hi: np.ndarray, size: int) -> int:
    """The start of the smallest gap between the ranges [lo, hi) that holds `size`, or the
    top of them all."""
    if len(lo) == 0:
        return 0
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    # The highest end below each range: the gap before range k runs from it to lo[k].
    reach = np.maximum.accumulate(hi)
    gap_start = np.concatenate([[0], reach[:-1]])
    gaps = lo - gap_start
    fits = np.flatnonzero(gaps >= size)
    if len(fits) == 0:
        return int(reach[-1])
    return int(gap_start[fits[np.argmin(gaps[fits])]])


@dataclasses.dataclass(frozen=True)
class StaticLayout:
    live_peak: int  # the most bytes on the device at once: no layout needs less
    peak: int  # what the greedy layout needs


def static_layout(mp: _MemoryPlan, b: Buffers) -> StaticLayout:
    """Lays out the memory plan's stays ahead of time (see the module's doc)."""
    iv = residency_intervals(mp, b)
    return StaticLayout(live_peak=iv.live_peak(), peak=layout_peak(iv, assign_offsets(iv)))


def layout_peak(iv: Intervals, offsets: np.ndarray) -> int:
    """The highest end of any interval."""
    return int((offsets + iv.nbytes).max()) if len(iv) else 0
