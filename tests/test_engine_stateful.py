"""Property-based stateful test: byte-exact data under any operation sequence.

Device capacity is a small fraction of the live bytes, so buffers go to the host and
back (and are moved by defragmentation) all the time.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import tflms

DEVICE = 256 * 1024
MAX_SIZE = 48 * 1024


def checked_engine(*, defrag: bool, prefetch: bool, allow_growth: bool = True) -> tflms.Engine:
    """An LMS engine on DEVICE bytes that verifies every move and every pin's bytes."""
    return tflms.Engine(
        device_memory=DEVICE,
        host_memory=64 << 20,
        lms=True,
        defrag=defrag,
        prefetch=prefetch,
        allow_growth=allow_growth,
        verify_moves=True,
        verify_pins=True,
    )


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        defrag=st.booleans(), prefetch=st.booleans(), growth=st.booleans(), seed=st.integers(0, 99)
    )
    def start(self, defrag: bool, prefetch: bool, growth: bool, seed: int) -> None:
        self.engine = checked_engine(defrag=defrag, prefetch=prefetch, allow_growth=growth)
        self.live: dict[int, tuple[tflms.Buffer, bytes]] = {}
        self.pins: dict[int, int] = {}
        self.next = 0
        self.seed = seed

    def pick(self, index: int) -> int | None:
        if not self.live:
            return None
        keys = sorted(self.live)
        return keys[index % len(keys)]

    @rule(size=st.integers(1, MAX_SIZE), fill=st.integers(0, 255))
    def allocate(self, size: int, fill: int) -> None:
        try:
            buf = self.engine.allocate(size)
        except tflms.OutOfMemoryError:
            assert sum(self.pins.values()) > 0  # only pins can make room impossible
            return
        data = bytes((fill + i) % 256 for i in range(min(size, 512))) * (size // 512 + 1)
        data = data[:size]
        buf.write(data)
        self.live[self.next] = (buf, data)
        self.next += 1

    @rule(index=st.integers(0, 1000))
    def read(self, index: int) -> None:
        key = self.pick(index)
        if key is None:
            return
        buf, data = self.live[key]
        try:
            assert buf.read() == data
        except tflms.OutOfMemoryError:
            assert sum(self.pins.values()) > 0

    @rule(index=st.integers(0, 1000), offset=st.integers(0, MAX_SIZE), byte=st.integers(0, 255))
    def overwrite(self, index: int, offset: int, byte: int) -> None:
        key = self.pick(index)
        if key is None:
            return
        buf, data = self.live[key]
        offset %= len(data)
        patch = bytes([byte]) * min(64, len(data) - offset)
        try:
            buf.write(patch, offset=offset)
        except tflms.OutOfMemoryError:
            assert sum(self.pins.values()) > 0
            return
        self.live[key] = (buf, data[:offset] + patch + data[offset + len(patch) :])

    @rule(index=st.integers(0, 1000))
    def pin(self, index: int) -> None:
        key = self.pick(index)
        if key is None or self.pins.get(key, 0) >= 1 or sum(self.pins.values()) >= 3:
            return
        try:
            self.engine.pin(self.live[key][0])
        except tflms.OutOfMemoryError:
            return
        self.pins[key] = 1
        assert self.live[key][0].resident

    @rule(index=st.integers(0, 1000))
    def unpin(self, index: int) -> None:
        key = self.pick(index)
        if key is None or not self.pins.get(key):
            return
        self.engine.unpin(self.live[key][0])
        self.pins[key] = 0

    @rule(index=st.integers(0, 1000))
    def free(self, index: int) -> None:
        key = self.pick(index)
        if key is None:
            return
        buf, _ = self.live.pop(key)
        if self.pins.pop(key, 0):
            self.engine.unpin(buf)
        self.engine.free(buf)

    @rule()
    def defragment(self) -> None:
        self.engine.defragment()

    @rule()
    def reclaim_all(self) -> None:
        self.engine.reclaim_inactive()
        for key, (buf, _) in self.live.items():
            assert buf.resident == bool(self.pins.get(key))

    @rule()
    def step(self) -> None:
        self.engine.step_begin()

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "engine"):
            return
        self.engine.check_invariants()
        s = self.engine.stats()
        assert s["bytes_active"] + s["bytes_inactive"] == s["bytes_in_use"]
        assert s["bytes_in_use"] <= s["bytes_reserved"] <= s["bytes_limit"]
        assert s["current_bytes_reclaimed"] <= s["host_bytes_in_use"]
        assert s["peak_bytes_in_use"] >= s["bytes_in_use"]

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for key, (buf, data) in list(self.live.items()):
            if self.pins.get(key):
                self.engine.unpin(buf)
            assert buf.read() == data
            self.engine.free(buf)
        s = self.engine.stats()
        assert s["bytes_in_use"] == 0 and s["current_bytes_reclaimed"] == 0


EngineMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineMachine = EngineMachine.TestCase


def test_random_operations_against_model_many_steps() -> None:
    """Thousands of random steps in one run, device 1/8 of the live bytes."""
    import random

    from tests.engine_model import ModelRun

    eng = checked_engine(defrag=True, prefetch=True)
    run = ModelRun(eng, random.Random(1234), MAX_SIZE, DEVICE)
    for _ in range(5000):
        run.step()
        if run.ops % 500 == 0:
            eng.check_invariants()
    run.finish()
    assert run.corruptions == 0
    assert eng.stats()["bytes_reclaimed"] > 8 * DEVICE
    eng.check_invariants()
