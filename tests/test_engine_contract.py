"""The engine's Python contract: the calls acceptance tests outside the repository make."""

from __future__ import annotations

import ctypes

import pytest

import tflms

MiB = 1 << 20


def test_allocate_write_read_free_round_trip() -> None:
    eng = tflms.Engine(device_memory=4 * MiB, host_memory=16 * MiB, lms=True, defrag=False)
    buf = eng.allocate(1000)
    assert buf.nbytes == 1000
    buf.write(b"x" * 10, offset=990)
    buf.write(b"a" * 990)
    assert buf.read() == b"a" * 990 + b"x" * 10
    assert buf.resident
    eng.free(buf)
    assert eng.stats()["bytes_in_use"] == 0


def test_stats_keys_follow_tflms_names() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=MiB)
    stats = eng.stats()
    for key in (
        "num_allocs",
        "bytes_in_use",
        "peak_bytes_in_use",
        "largest_alloc_size",
        "bytes_limit",
        "bytes_reserved",
        "peak_bytes_reserved",
        "bytes_reservable_limit",
        "bytes_inactive",
        "bytes_active",
        "peak_bytes_active",
        "bytes_reclaimed",
        "current_bytes_reclaimed",
        "peak_bytes_reclaimed",
        "num_single_reclaims",
        "num_full_reclaims",
        "num_defragmentations",
        "bytes_defragged",
        "prefetch_hits",
        "prefetch_misses",
        "page_in_stall_ns",
    ):
        assert isinstance(stats[key], int), key
    assert stats["bytes_limit"] == MiB


def test_pinned_context_and_allocation_pinned() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=8 * MiB)
    a = eng.allocate(600 * 1024, pinned=True)
    assert a.pin_count == 1
    # A pinned buffer cannot be reclaimed: the next request does not fit.
    with pytest.raises(tflms.OutOfMemoryError):
        eng.allocate(600 * 1024)
    eng.unpin(a)
    b = eng.allocate(600 * 1024)  # now `a` may go to the host
    assert not a.resident
    with eng.pinned(a) as address:
        assert address > 0
        assert a.resident and not b.resident
    assert a.pin_count == 0
    eng.free(a)
    eng.free(b)


def test_verify_pins_reports_bytes_written_without_a_pin() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=8 * MiB, verify_pins=True)
    a = eng.allocate(64 * 1024)
    a.write(bytes(range(256)) * 256)
    eng.reclaim_inactive()  # out and back in: the same bytes, the pin passes
    with eng.pinned(a) as address:
        pass
    ctypes.memset(address + 1000, 0x5A, 1)  # a write no pin covers
    with pytest.raises(RuntimeError, match=r"verify_pins: buffer \d+ \(65536 bytes\)"):
        eng.pin(a)
    assert a.pin_count == 0
    eng.free(a)


def test_out_of_memory_error_is_a_memory_error_and_lms_off_raises_at_once() -> None:
    assert issubclass(tflms.OutOfMemoryError, MemoryError)
    eng = tflms.Engine(device_memory=MiB, host_memory=8 * MiB, lms=False)
    bufs = [eng.allocate(256 * 1024) for _ in range(4)]
    with pytest.raises(tflms.OutOfMemoryError, match="set_lms_enabled"):
        eng.allocate(256 * 1024)
    assert eng.stats()["bytes_reclaimed"] == 0
    for b in bufs:
        eng.free(b)


@pytest.mark.parametrize("size", [0, -1, -(1 << 40)])
def test_bad_sizes_raise_value_error(size: int) -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=MiB)
    with pytest.raises(ValueError, match="positive"):
        eng.allocate(size)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"device_memory": 0}, "device_memory"),
        ({"device_memory": -5}, "device_memory"),
        ({"device_memory": MiB, "host_memory": 0}, "host_memory"),
        ({"device_memory": MiB, "backend": "opencl"}, "unknown backend"),
        ({"device_memory": MiB, "lms_limit": 2 * MiB}, "LMS limit"),
        ({"device_memory": "1G"}, "integer"),
    ],
)
def test_bad_engine_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tflms.Engine(**kwargs)  # type: ignore[arg-type]


def test_use_after_free_double_free_and_unpin_without_pin() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=MiB)
    keep = eng.allocate(4096)
    keep.write(b"k" * 4096)
    buf = eng.allocate(4096)
    with pytest.raises(RuntimeError, match="without a matching pin"):
        eng.unpin(buf)
    eng.free(buf)
    with pytest.raises(RuntimeError, match="double free"):
        eng.free(buf)
    for op in (buf.read, lambda: eng.pin(buf), lambda: buf.write(b"z")):
        with pytest.raises(RuntimeError, match="freed"):
            op()
    assert keep.read() == b"k" * 4096  # nothing else was touched
    eng.check_invariants()


def test_free_of_pinned_buffer_is_refused_and_buffer_stays_usable() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=MiB)
    buf = eng.allocate(4096, pinned=True)
    with pytest.raises(RuntimeError, match="pinned"):
        eng.free(buf)
    buf.write(b"q" * 4096)
    eng.unpin(buf)
    eng.free(buf)


def test_buffer_of_another_engine_is_rejected() -> None:
    a = tflms.Engine(device_memory=MiB, host_memory=MiB)
    b = tflms.Engine(device_memory=MiB, host_memory=MiB)
    buf = a.allocate(256)
    with pytest.raises(ValueError, match="another engine"):
        b.free(buf)
    a.free(buf)


def test_gather_for_concat_checks_its_buffers_and_leaves_a_quiet_device_alone() -> None:
    a = tflms.Engine(device_memory=MiB, host_memory=MiB)
    b = tflms.Engine(device_memory=MiB, host_memory=MiB)
    x, y = a.allocate(256 * 1024), a.allocate(256 * 1024)
    x.write(b"x" * 256 * 1024)
    other = b.allocate(256)
    with pytest.raises(ValueError, match="another engine"):
        a.gather_for_concat([x, other])
    # Nothing on the host: placement stays best fit's, and nothing moves.
    a.gather_for_concat([x, y])
    assert a.stats()["num_group_gathers"] == 0
    a.free(y)
    with pytest.raises(RuntimeError, match="freed"):
        a.gather_for_concat([x, y])
    assert x.read() == b"x" * 256 * 1024
    a.free(x)
    b.free(other)
    a.check_invariants()


def test_write_outside_buffer_is_rejected() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=MiB)
    buf = eng.allocate(100)
    with pytest.raises(ValueError, match="outside the buffer"):
        buf.write(b"x" * 10, offset=95)
    with pytest.raises(ValueError, match="offset"):
        buf.write(b"x", offset=-1)
    eng.free(buf)


def test_buffer_outlives_its_engine_object() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=MiB)
    buf = eng.allocate(512)
    buf.write(b"p" * 512)
    del eng
    assert buf.read() == b"p" * 512


def test_reclaim_inactive_moves_everything_unpinned() -> None:
    eng = tflms.Engine(device_memory=4 * MiB, host_memory=16 * MiB)
    bufs = [eng.allocate(100_000) for _ in range(5)]
    for i, b in enumerate(bufs):
        b.write(bytes([i]) * 100_000)
    pinned = eng.allocate(1000, pinned=True)
    moved = eng.reclaim_inactive()
    assert moved >= 5 * 100_000
    assert not any(b.resident for b in bufs) and pinned.resident
    stats = eng.stats()
    assert stats["current_bytes_reclaimed"] == 5 * 100_000
    assert [b.read() for b in bufs] == [bytes([i]) * 100_000 for i in range(5)]
    eng.unpin(pinned)


def test_lms_limit_reclaims_before_the_device_is_full() -> None:
    eng = tflms.Engine(device_memory=4 * MiB, host_memory=16 * MiB, lms_limit=MiB)
    bufs = [eng.allocate(256 * 1024) for _ in range(8)]
    assert eng.stats()["bytes_in_use"] <= MiB
    assert eng.stats()["num_single_reclaims"] > 0
    eng.set_lms_limit(0)  # whole device again
    more = [eng.allocate(256 * 1024) for _ in range(4)]
    assert eng.stats()["bytes_in_use"] > MiB
    with pytest.raises(ValueError, match="exceeds the device"):
        eng.set_lms_limit(8 * MiB)
    for b in bufs + more:
        eng.free(b)


@pytest.mark.parametrize("extra", [1, MiB, (1 << 63) - 1 - MiB])
def test_request_larger_than_the_device_fails_at_once_and_moves_nothing(extra: int) -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=16 * MiB)
    bufs = [eng.allocate(256 * 1024) for _ in range(3)]
    for i, b in enumerate(bufs):
        b.write(bytes([i]) * 256 * 1024)
    before = eng.stats()
    assert before["bytes_inactive"] > 0
    with pytest.raises(tflms.OutOfMemoryError) as err:
        eng.allocate(MiB + extra)
    message = str(err.value)
    assert "exceeds the device memory limit" in message
    assert f"{MiB + extra} bytes" in message and f"{MiB} bytes" in message
    after = eng.stats()
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert {k: v for k, v in after.items() if k != "num_ooms"} == {
        k: v for k, v in before.items() if k != "num_ooms"
    }
    assert all(b.resident for b in bufs)
    assert [b.read() for b in bufs] == [bytes([i]) * 256 * 1024 for i in range(3)]
    eng.check_invariants()


# What clear_stats keeps: current values and limits. Peaks restart from the current
# value; every other counter is cumulative and restarts from zero.
_CURRENT = {
    "bytes_in_use": "peak_bytes_in_use",
    "bytes_reserved": "peak_bytes_reserved",
    "bytes_active": "peak_bytes_active",
    "current_bytes_reclaimed": "peak_bytes_reclaimed",
    "host_bytes_in_use": "host_peak_bytes_in_use",
}
_KEPT = {*_CURRENT, "bytes_inactive", "bytes_limit", "bytes_reservable_limit", "host_bytes_limit"}


def test_clear_stats_restarts_peaks_from_now_and_counters_from_zero() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=16 * MiB, defrag=True)
    bufs = [eng.allocate(256 * 1024) for _ in range(8)]  # 2x the device: reclaims
    for i, b in enumerate(bufs):
        b.write(bytes([i]) * 256 * 1024)
    pinned = eng.allocate(300 * 1024, pinned=True)
    with pytest.raises(tflms.OutOfMemoryError):
        eng.allocate(2 * MiB)
    eng.unpin(pinned)
    for b in bufs[:4]:
        eng.free(b)
    before = eng.stats()
    for key in ("num_allocs", "bytes_reclaimed", "num_page_ins", "num_ooms"):
        assert before[key] > 0, key
    assert before["host_peak_bytes_in_use"] > before["host_bytes_in_use"]
    assert before["peak_bytes_active"] > before["bytes_active"]

    eng.clear_stats()
    after = eng.stats()
    assert after.keys() == before.keys()
    for key, value in after.items():
        if key in _KEPT:
            assert value == before[key], key
        elif key in _CURRENT.values():
            current = next(c for c, p in _CURRENT.items() if p == key)
            assert value == before[current], key
        else:
            assert value == 0, key  # cumulative counters and largest_alloc_size
    eng.check_invariants()

    # Counting restarts from here, and peaks grow again from the current values.
    extra = eng.allocate(100_000, pinned=True)
    again = eng.stats()
    assert again["num_allocs"] >= 1
    assert again["largest_alloc_size"] >= 100_000
    for current, peak in _CURRENT.items():
        assert again[peak] >= again[current], peak
    assert again["peak_bytes_active"] > after["peak_bytes_active"]
    assert [b.read() for b in bufs[4:]] == [bytes([i]) * 256 * 1024 for i in range(4, 8)]
    eng.unpin(extra)
    for b in [*bufs[4:], pinned, extra]:
        eng.free(b)
    eng.check_invariants()
