"""A random-operation driver of the engine checked against a reference model.

Shared by the hypothesis state machine (tests/test_engine_stateful.py) and the soak run
(`make soak`, tests/soak.py): the model is a dict of buffer -> expected bytes, and every
read must match it exactly whatever the engine did in between (reclaim, page-in,
defragmentation, prefetch).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import tflms


@dataclass
class ModelRun:
    """Drives one engine with random operations; counts what happened."""

    engine: tflms.Engine
    rng: random.Random
    max_size: int
    device: int
    live: dict[int, tuple[tflms.Buffer, bytearray]] = field(default_factory=dict)
    pinned: dict[int, int] = field(default_factory=dict)
    next_key: int = 0
    corruptions: int = 0
    ooms: int = 0
    ops: int = 0

    def allocate(self, size: int) -> None:
        try:
            buf = self.engine.allocate(size)
        except tflms.OutOfMemoryError:
            self.ooms += 1
            return
        data = bytearray(self.rng.randbytes(size))
        buf.write(data)
        self.live[self.next_key] = (buf, data)
        self.next_key += 1

    def pinned_bytes(self) -> int:
        return sum(self.live[k][0].nbytes for k, n in self.pinned.items() if n)

    def pick(self) -> int | None:
        return self.rng.choice(list(self.live)) if self.live else None

    def check(self, key: int) -> None:
        buf, data = self.live[key]
        try:
            content = buf.read()
        except tflms.OutOfMemoryError:
            # Pinned buffers may leave no room to page this one in; not a corruption.
            self.ooms += 1
            return
        if content != bytes(data):
            self.corruptions += 1

    def write(self, key: int) -> None:
        buf, data = self.live[key]
        off = self.rng.randrange(len(data))
        chunk = self.rng.randbytes(self.rng.randint(1, len(data) - off))
        buf.write(chunk, offset=off)
        data[off : off + len(chunk)] = chunk

    def step(self) -> None:
        """One random operation."""
        self.ops += 1
        r = self.rng.random()
        key = self.pick()
        try:
            if key is None or r < 0.30:
                self.allocate(self.rng.randint(1, self.max_size))
            elif r < 0.55:
                self.check(key)
            elif r < 0.65:
                self.write(key)
            elif r < 0.75:
                # Keep pinned bytes under half the device so reads can always page in.
                if self.pinned.get(key, 0) < 2 and self.pinned_bytes() < self.device // 2:
                    self.engine.pin(self.live[key][0])
                    self.pinned[key] = self.pinned.get(key, 0) + 1
            elif r < 0.85:
                if self.pinned.get(key, 0) > 0:
                    self.engine.unpin(self.live[key][0])
                    self.pinned[key] -= 1
            elif r < 0.95:
                self.free(key)
            elif r < 0.97:
                self.engine.defragment()
            elif r < 0.98:
                self.engine.reclaim_inactive()
            else:
                self.engine.step_begin()
        except tflms.OutOfMemoryError:
            # Pinning or reading needs room; with everything else pinned there may be none.
            self.ooms += 1

    def free(self, key: int) -> None:
        buf, _ = self.live[key]
        for _ in range(self.pinned.pop(key, 0)):
            self.engine.unpin(buf)
        self.check(key)
        self.engine.free(buf)
        del self.live[key]

    def finish(self) -> None:
        for key in list(self.live):
            for _ in range(self.pinned.pop(key, 0)):
                self.engine.unpin(self.live[key][0])
        for key in list(self.live):
            self.free(key)
