"""Largest batch (or input size) that fits: exponential, then binary search.

Whether a size fits is monotone in practice (more samples, more bytes), so
doubling from a starting guess brackets the answer and bisection finds it in
about 2 log2(answer) replays. Every probe is recorded so the report can show
how the answer was found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class SearchResult:
    largest: int  # 0 when even the smallest value does not fit
    probes: list[tuple[int, bool]]  # (value, fits) in probe order
    hit_limit: bool  # the search stopped at `limit` while still fitting


def _recording(
    fits: Callable[[int], bool],
    probes: list[tuple[int, bool]],
    on_probe: Callable[[int, bool], None] | None,
) -> Callable[[int], bool]:
    """fits, with every call appended to `probes` and reported to `on_probe`."""

    def probe(n: int) -> bool:
        ok = fits(n)
        probes.append((n, ok))
        if on_probe is not None:
            on_probe(n, ok)
        return ok

    return probe


def _bisect(probe: Callable[[int], bool], lo: int, hi: int, rel_tol: float) -> int:
    """The largest value found to fit between lo (fits) and hi (does not)."""
    while hi - lo > max(1, int(lo * rel_tol)):
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_fitting(
    fits: Callable[[int], bool],
    start: int,
    *,
    known_fit: int = 0,
    known_fail: int | None = None,
    limit: int = 1 << 20,
    rel_tol: float = 0.0,
    on_probe: Callable[[int, bool], None] | None = None,
) -> SearchResult:
    """The largest n in [1, limit] with fits(n), assuming fits is monotone decreasing.

    known_fit / known_fail: values already known to fit / not fit (skipped).
    rel_tol: stop bisecting once the bracket is within this fraction of the answer
    (the result still fits; it may be up to that fraction below the true largest).
    """
    if start < 1 or limit < 1:
        raise ValueError("start and limit must be at least 1")
    lo = known_fit  # largest value known to fit (0: none)
    hi = known_fail  # smallest value known not to fit (None: none)
    probes: list[tuple[int, bool]] = []

    probe = _recording(fits, probes, on_probe)

    n = min(max(start, lo + 1), limit)
    if hi is not None:
        n = min(n, hi - 1)
    if hi is None or n > lo:
        if probe(n):
            lo = n
            while hi is None and lo < limit:
                n = min(lo * 2, limit)
                if probe(n):
                    lo = n
                else:
                    hi = n
        else:
            hi = n
            while lo == 0 and hi > 1:
                n = hi // 2
                if probe(n):
                    lo = n
                else:
                    hi = n
            if lo == 0:
                return SearchResult(0, probes, False)
    if hi is None:
        return SearchResult(lo, probes, lo >= limit)
    return SearchResult(_bisect(probe, lo, hi, rel_tol), probes, False)


def largest_without_holes(
    fits: Callable[[int], bool],
    found: SearchResult,
    *,
    floor: int = 0,
    grid_points: int = 10,
    grid_step: float = 0.01,
    rel_tol: float = 0.0,
    on_probe: Callable[[int, bool], None] | None = None,
) -> SearchResult:
    """Lowers a search's answer until no probed value at or below it fails.

    Fitting is monotone for a perfect allocator, not for a real one: a smaller batch can
    fail on a fragmentation hole where a larger one fits, and bisection alone then reports
    a batch that stands above such a hole. This probes `grid_points` values below the
    answer, `grid_step` of it apart (down to `floor`, a value known to fit), and returns
    the largest value v that fits such that every probe at or below v fits, bisected
    against the smallest failing probe. The probes are `found`'s followed by the new ones.
    """
    probes = list(found.probes)

    probe = _recording(fits, probes, on_probe)

    answer = found.largest
    if answer <= floor:
        return SearchResult(answer, probes, found.hit_limit)
    seen = {n for n, _ in probes}
    step = max(1, round(answer * grid_step))
    for k in range(1, grid_points + 1):
        n = answer - k * step
        if n <= floor:
            break
        if n not in seen:
            seen.add(n)
            probe(n)
    fails = [n for n, ok in probes if not ok]
    hi = min(fails, default=None)
    if hi is None or hi > answer:
        return SearchResult(answer, probes, found.hit_limit)
    # Every probe below the smallest failure fits; bisect up to that failure.
    lo = max((n for n, ok in probes if ok and n < hi), default=floor)
    lo = max(lo, floor)
    return SearchResult(_bisect(probe, lo, hi, rel_tol), probes, False)
