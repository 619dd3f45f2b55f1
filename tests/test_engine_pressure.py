"""Memory pressure, faults and fragmentation: nothing is ever lost."""

from __future__ import annotations

import pytest

import tflms

MiB = 1 << 20


def pattern(i: int, n: int) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def test_working_set_8x_device_completes_with_lms_and_fails_without() -> None:
    device = 2 * MiB
    n, size = 64, 256 * 1024  # 16 MiB live: 8x the device
    eng = tflms.Engine(device_memory=device, host_memory=64 * MiB, lms=True)
    bufs = []
    for i in range(n):
        b = eng.allocate(size)
        b.write(pattern(i, size))
        bufs.append(b)
    for _ in range(2):  # two passes: every buffer comes back at least once
        for i, b in enumerate(bufs):
            assert b.read() == pattern(i, size)
    stats = eng.stats()
    assert stats["bytes_reclaimed"] >= n * size
    assert stats["num_page_ins"] >= n
    assert stats["bytes_active"] + stats["bytes_inactive"] == stats["bytes_in_use"]
    eng.check_invariants()

    off = tflms.Engine(device_memory=device, host_memory=64 * MiB, lms=False)
    with pytest.raises(tflms.OutOfMemoryError):
        for _ in range(n):
            off.allocate(size)


def test_host_pool_full_is_a_clear_error_and_loses_nothing() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=300 * 1024)
    bufs = []
    with pytest.raises(tflms.OutOfMemoryError, match="TF_GPU_HOST_MEM_LIMIT_IN_MB"):
        for i in range(8):
            b = eng.allocate(256 * 1024)
            b.write(pattern(i, 256 * 1024))
            bufs.append(b)
    eng.check_invariants()
    for i, b in enumerate(bufs):
        if b.resident:
            assert b.read() == pattern(i, 256 * 1024)
    eng.free(bufs.pop())  # room to page the reclaimed one back in
    for i, b in enumerate(bufs):
        assert b.read() == pattern(i, 256 * 1024)
    for b in bufs:
        eng.free(b)
    assert eng.stats()["host_bytes_in_use"] == 0


def test_injected_copy_failure_keeps_buffers_resident_and_intact() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=16 * MiB)
    bufs = [eng.allocate(300 * 1024) for _ in range(3)]
    for i, b in enumerate(bufs):
        b.write(pattern(i, 300 * 1024))
    eng.fail_next_copies("d2h", 100)
    with pytest.raises(tflms.OutOfMemoryError, match="copy failure"):
        eng.allocate(400 * 1024)
    assert all(b.resident for b in bufs)
    assert [b.read() for b in bufs] == [pattern(i, 300 * 1024) for i in range(3)]
    stats = eng.stats()
    assert stats["current_bytes_reclaimed"] == 0 and stats["host_bytes_in_use"] == 0
    eng.check_invariants()
    eng.fail_next_copies("d2h", 0)
    extra = eng.allocate(400 * 1024)
    assert [b.read() for b in bufs] == [pattern(i, 300 * 1024) for i in range(3)]
    for b in [*bufs, extra]:
        eng.free(b)


def test_sub_allocator_refusal_is_out_of_memory_then_recovers() -> None:
    eng = tflms.Engine(device_memory=4 * MiB, host_memory=MiB)
    eng.refuse_device_allocations(True)
    with pytest.raises(tflms.OutOfMemoryError) as refused:
        eng.allocate(1000)
    # Memory the device did not give is not free memory that fragmentation or LMS wastes.
    message = str(refused.value)
    assert f"The device refused the arena the {4 * MiB} bytes still under its limit" in message
    assert "fragmented" not in message and "Every byte left" not in message
    eng.refuse_device_allocations(False)
    eng.free(eng.allocate(1000))
    eng.check_invariants()


def test_a_device_larger_than_this_machine_keeps_what_is_written() -> None:
    # 256 GiB of simulated device on a machine with a tenth of that: its memory is backed
    # where it is written. (It was one host allocation of the whole device, which failed
    # here, and then the first allocation read as fragmentation.)
    eng = tflms.Engine(device_memory=256 << 30, host_memory=MiB, lms=False)
    bufs = [eng.allocate(MiB) for _ in range(3)]
    for i, b in enumerate(bufs):
        b.write(pattern(i, MiB))
    assert [b.read() for b in bufs] == [pattern(i, MiB) for i in range(3)]
    for b in bufs:
        eng.free(b)
    eng.check_invariants()


def checkerboard(eng: tflms.Engine) -> list[tflms.Buffer]:
    """Half the device free, in 256 KiB holes."""
    bufs = [eng.allocate(256 * 1024) for _ in range(8)]
    keep = []
    for i, b in enumerate(bufs):
        if i % 2:
            eng.free(b)
        else:
            b.write(pattern(i, 256 * 1024))
            keep.append(b)
    return keep


def test_fragmentation_fails_plain_bfc_and_names_defrag() -> None:
    eng = tflms.Engine(device_memory=2 * MiB, host_memory=MiB, lms=False, defrag=False)
    keep = checkerboard(eng)
    largest, total = eng.free_space()
    assert total >= 512 * 1024 > largest
    with pytest.raises(tflms.OutOfMemoryError, match="fragmented.*lms_defrag_enabled"):
        eng.allocate(512 * 1024)
    for b in keep:
        eng.free(b)


def test_defragmentation_makes_the_same_request_fit() -> None:
    eng = tflms.Engine(
        device_memory=2 * MiB, host_memory=MiB, lms=False, defrag=True, verify_moves=True
    )
    keep = checkerboard(eng)
    big = eng.allocate(512 * 1024)
    stats = eng.stats()
    assert stats["num_defragmentations"] >= 1 and stats["bytes_defragged"] > 0
    assert stats["num_allocs_from_defrag"] == 1
    assert [b.read() for b in keep] == [pattern(2 * i, 256 * 1024) for i in range(4)]
    eng.free(big)
    assert eng.defragment() >= 0
    assert [b.read() for b in keep] == [pattern(2 * i, 256 * 1024) for i in range(4)]
    eng.check_invariants()


def test_explicit_defragment_compacts_to_one_free_block() -> None:
    eng = tflms.Engine(device_memory=2 * MiB, host_memory=MiB, lms=False, defrag=True)
    keep = checkerboard(eng)
    moved = eng.defragment()
    assert moved > 0
    largest, total = eng.free_space()
    assert largest == total  # all free space coalesced
    assert [b.read() for b in keep] == [pattern(2 * i, 256 * 1024) for i in range(4)]


def test_pinned_buffers_are_never_moved_by_defragment() -> None:
    eng = tflms.Engine(device_memory=2 * MiB, host_memory=MiB, lms=False, defrag=True)
    keep = checkerboard(eng)
    addresses = [eng.pin(b) for b in keep]
    assert eng.defragment() == 0
    assert [eng.pin(b) for b in keep] == addresses
    for b in keep:
        eng.unpin(b)
        eng.unpin(b)


def test_order_of_reclaim_steps_is_visible_in_statistics() -> None:
    eng = tflms.Engine(device_memory=MiB, host_memory=32 * MiB)
    small = [eng.allocate(64 * 1024) for _ in range(16)]  # fills the device
    assert eng.stats()["num_single_reclaims"] == 0
    eng.allocate(64 * 1024)  # one victim suffices
    assert eng.stats()["num_single_reclaims"] == 1
    eng.allocate(512 * 1024)  # needs a window of several buffers
    stats = eng.stats()
    assert stats["num_fragment_reclaims"] + stats["num_full_reclaims"] >= 1
    assert stats["num_allocs_from_single_reclaim"] == 1
    del small
