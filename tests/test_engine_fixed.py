"""Fixed-address mode from Python: addresses never change, pages are accounted exactly."""

from __future__ import annotations

import pytest

import tflms

KiB = 1 << 10
MiB = 1 << 20
PAGE = 64 * KiB


def fixed_engine(pages: int = 8, host: int = 64 * MiB) -> tflms.Engine:
    return tflms.Engine(
        device_memory=pages * PAGE,
        host_memory=host,
        fixed_addresses=True,
        page_size=PAGE,
    )


def test_same_address_and_bytes_after_eviction() -> None:
    eng = fixed_engine()
    bufs = []
    for i in range(12):  # 12 x 2 pages live on 8 pages of device
        buf = eng.allocate(2 * PAGE - 1000)
        data = bytes([(i * 13 + j) % 251 for j in range(buf.nbytes)])
        buf.write(data)
        with eng.pinned(buf) as addr:
            bufs.append((buf, addr, data))
    stats = eng.stats()
    assert stats["bytes_reclaimed"] > 0 and stats["num_pages_unmapped"] > 0
    for buf, addr, data in bufs:
        with eng.pinned(buf) as again:
            assert again == addr
        assert buf.read() == data
        eng.check_invariants()
    stats = eng.stats()
    assert stats["page_size"] == PAGE
    assert stats["bytes_reserved"] == eng.mapped_bytes
    assert (
        stats["physical_bytes_in_use"]
        + stats["physical_bytes_cached"]
        + stats["physical_bytes_free"]
        == 8 * PAGE
    )
    for buf, _, _ in bufs:
        eng.free(buf)
    stats = eng.stats()
    assert stats["physical_bytes_in_use"] == 0 and stats["physical_bytes_evicted"] == 0
    assert stats["host_bytes_in_use"] == 0


def test_page_accounting_on_a_scripted_sequence() -> None:
    eng = fixed_engine()
    a = eng.allocate(3 * PAGE)
    b = eng.allocate(3 * PAGE)
    c = eng.allocate(3 * PAGE)  # evicts a
    assert not a.resident and b.resident and c.resident
    s = eng.stats()
    assert s["physical_bytes_in_use"] == 6 * PAGE
    assert s["physical_bytes_evicted"] == 3 * PAGE
    assert s["physical_bytes_free"] == 2 * PAGE
    eng.free(c)
    s = eng.stats()
    assert s["physical_bytes_cached"] == 3 * PAGE
    eng.check_invariants()
    for buf in (a, b):
        eng.free(buf)


def test_a_request_in_a_larger_free_chunk_maps_only_its_own_pages() -> None:
    # A 13-page hole between the region's start and a resident buffer: TensorFlow's split
    # rule would hand an 8-page request the whole hole (under twice the request), and
    # all 13 pages would be mapped for it.
    eng = fixed_engine(pages=16)
    hole = eng.allocate(13 * PAGE)
    above = eng.allocate(PAGE)
    with eng.pinned(hole) as start, eng.pinned(above) as end:
        assert end - start == 13 * PAGE
    eng.free(hole)
    buf = eng.allocate(8 * PAGE)
    with eng.pinned(buf) as addr:
        assert addr == start
    stats = eng.stats()
    assert stats["physical_bytes_in_use"] == (8 + 1) * PAGE
    # The rest of the hole is free for a request that fits it, without a new region.
    rest = eng.allocate(5 * PAGE)
    with eng.pinned(rest) as addr:
        assert addr == start + 8 * PAGE
    assert eng.stats()["physical_bytes_in_use"] == (8 + 1 + 5) * PAGE
    eng.check_invariants()


def test_failed_map_keeps_the_host_copy() -> None:
    eng = fixed_engine()
    a = eng.allocate(2 * PAGE)
    a.write(b"\x5a" * (2 * PAGE))
    addr = eng.pin(a)
    eng.unpin(a)
    assert eng.reclaim_inactive() > 0
    eng.fail_next_maps(1)
    with pytest.raises(RuntimeError, match="simulated map failure"):
        eng.pin(a)
    assert not a.resident
    assert eng.pin(a) == addr
    eng.unpin(a)
    assert a.read() == b"\x5a" * (2 * PAGE)
    eng.free(a)
    eng.check_invariants()


def test_defragment_is_a_no_op_and_bad_page_size_is_refused() -> None:
    eng = fixed_engine()
    buf = eng.allocate(1000)
    assert eng.defragment() == 0
    eng.free(buf)
    with pytest.raises(ValueError, match="page_size"):
        tflms.Engine(device_memory=MiB, fixed_addresses=True, page_size=PAGE + 1)


def test_inactive_neighbours_sharing_pages_are_evicted_together() -> None:
    # Buffers of one page each, packed at 256 bytes, straddle page boundaries: every
    # page is shared by two of them, so evicting any one alone frees no page. The
    # reclaim must see that evicting neighbours together frees whole pages (a
    # TensorArray's elements are exactly this shape).
    eng = fixed_engine(pages=8)
    head = eng.allocate(PAGE // 2)
    row = [eng.allocate(PAGE) for _ in range(6)]
    for i, buf in enumerate(row):
        buf.write(bytes([i + 1]) * buf.nbytes)
        eng.pin(buf)
        eng.unpin(buf)
    big = eng.allocate(4 * PAGE)  # needs pages only the row's evictions can free
    assert big.resident
    assert eng.stats()["num_pages_unmapped"] > 0
    eng.check_invariants()
    for i, buf in enumerate(row):
        assert buf.read() == bytes([i + 1]) * buf.nbytes
    for buf in (head, big, *row):
        eng.free(buf)


def test_map_and_unmap_cost_modelled_host_time() -> None:
    # The planner's assumption for driver calls: each mapped or unmapped page costs
    # the host thread the stated time, and nothing else changes.
    def run(map_us: float, unmap_us: float) -> tuple[float, dict[str, int]]:
        eng = tflms.Engine(
            device_memory=8 * PAGE,
            host_memory=64 * MiB,
            fixed_addresses=True,
            page_size=PAGE,
            store_data=False,
            map_us_per_page=map_us,
            unmap_us_per_page=unmap_us,
        )
        for _ in range(12):
            eng.allocate(2 * PAGE)
        eng.synchronize()
        return eng.timeline()["host_time"], eng.stats()

    free_time, free_stats = run(0.0, 0.0)
    costly_time, costly_stats = run(20.0, 30.0)
    assert costly_stats["num_pages_mapped"] == free_stats["num_pages_mapped"] > 0
    assert costly_stats["num_pages_unmapped"] == free_stats["num_pages_unmapped"] > 0
    expected = 20e-6 * free_stats["num_pages_mapped"] + 30e-6 * free_stats["num_pages_unmapped"]
    assert costly_time - free_time == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="map_us_per_page"):
        tflms.Engine(
            device_memory=8 * PAGE, fixed_addresses=True, page_size=PAGE, map_us_per_page=-1
        )
