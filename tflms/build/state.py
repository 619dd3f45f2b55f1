"""The resume file of a wheel build: which stages completed, and from which inputs.

A stage is skipped on a re-run only when the inputs recorded for it equal the inputs it would
run with now. Re-running a stage forgets every later stage, because their inputs include its
outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

STATE_FORMAT = 1


def digest(inputs: dict[str, Any]) -> str:
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class BuildState:
    def __init__(self, path: Path, order: tuple[str, ...]) -> None:
        self.path = path
        self.order = order
        self.stages: dict[str, dict[str, Any]] = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                data = {}
            if data.get("format") == STATE_FORMAT:
                self.stages = dict(data.get("stages", {}))

    def is_done(self, stage: str, inputs: dict[str, Any]) -> bool:
        record = self.stages.get(stage)
        return bool(record) and record.get("digest") == digest(inputs)

    def outputs(self, stage: str) -> dict[str, Any]:
        return dict(self.stages.get(stage, {}).get("outputs", {}))

    def mark_done(
        self, stage: str, inputs: dict[str, Any], outputs: dict[str, Any] | None = None
    ) -> None:
        self.stages[stage] = {
            "digest": digest(inputs),
            "inputs": inputs,
            "outputs": outputs or {},
            "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self.save()

    def forget_from(self, stage: str) -> None:
        """Forgets `stage` and every stage after it."""
        start = self.order.index(stage)
        for later in self.order[start:]:
            self.stages.pop(later, None)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        payload = {"format": STATE_FORMAT, "stages": self.stages}
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, self.path)
