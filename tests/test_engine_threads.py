"""Many threads hammering one engine: no deadlock, no corruption, consistent statistics."""

from __future__ import annotations

import random
import threading
import time

import tflms

MiB = 1 << 20


def test_eight_threads_for_a_bounded_time() -> None:
    eng = tflms.Engine(
        device_memory=2 * MiB,
        host_memory=256 * MiB,
        defrag=True,
        prefetch=True,
        verify_moves=True,
        verify_pins=True,
    )
    deadline = time.monotonic() + 4.0
    corruptions: list[str] = []
    errors: list[BaseException] = []
    ops = [0] * 9

    def worker(t: int) -> None:
        rng = random.Random(t)
        mine: list[tuple[tflms.Buffer, bytes]] = []
        try:
            while time.monotonic() < deadline:
                ops[t] += 1
                r = rng.random()
                if r < 0.35 or not mine:
                    size = rng.randint(1, 96 * 1024)
                    try:
                        buf = eng.allocate(size)
                        data = rng.randbytes(size)
                        buf.write(data)
                    except tflms.OutOfMemoryError:
                        continue  # every other thread may hold its buffers pinned
                    mine.append((buf, data))
                elif r < 0.75:
                    buf, data = rng.choice(mine)
                    try:
                        with eng.pinned(buf):
                            if buf.read() != data:
                                corruptions.append(f"thread {t}")
                    except tflms.OutOfMemoryError:
                        continue
                else:
                    buf, data = mine.pop(rng.randrange(len(mine)))
                    eng.free(buf)
            for buf, data in mine:
                if buf.read() != data:
                    corruptions.append(f"thread {t} at the end")
                eng.free(buf)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def housekeeper() -> None:
        while time.monotonic() < deadline:
            ops[8] += 1
            eng.defragment()
            eng.stats()
            eng.step_begin()
            time.sleep(0.01)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    threads.append(threading.Thread(target=housekeeper))
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "deadlock: a thread did not finish"
    assert not errors, errors
    assert not corruptions, corruptions
    assert sum(ops) > 500
    eng.check_invariants()
    s = eng.stats()
    assert s["bytes_in_use"] == 0
    assert s["bytes_reclaimed"] > 0
