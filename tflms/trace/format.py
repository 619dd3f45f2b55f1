"""The training-step trace: data model, validation, batch rescaling and the versioned file format.

A trace is what the engine and the planner replay: the ops of one training step in executor order,
the tensors each op produces and consumes, and the persistent tensors (variables, optimizer slots,
constants) that live for the whole step. docs/trace-format.md is the user-facing description.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_NAME = "tflms-trace"
FORMAT_VERSION = 1
_GZIP_MAGIC = b"\x1f\x8b"


class TraceFormatError(ValueError):
    """A trace file or object that does not follow the format."""


@dataclass
class TensorInfo:
    id: int
    bytes: int
    batch_scaled: bool
    persistent: bool
    name: str
    # Optional extras (not needed to replay): the static shape and dtype the bytes come from.
    shape: tuple[int, ...] | None = None
    dtype: str | None = None


@dataclass
class OpInfo:
    name: str
    type: str
    inputs: list[int]
    outputs: list[int]
    flops: float
    bytes_accessed: float


@dataclass
class Trace:
    model: str
    batch_size: int
    input_shape: tuple[int, ...]
    dtype: str
    tensorflow_version: str
    tensors: list[TensorInfo]
    ops: list[OpInfo]
    metadata: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------- derived figures
    def persistent_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors if t.persistent)

    def last_uses(self) -> list[int]:
        """Index of the last op that touches each tensor (producer or consumer); -1 if none."""
        last = [-1] * len(self.tensors)
        for index, op in enumerate(self.ops):
            for tid in op.outputs:
                last[tid] = index
            for tid in op.inputs:
                last[tid] = index
        return last

    def live_bytes_profile(self) -> list[int]:
        """Transient bytes live while each op runs (its inputs and freshly allocated outputs).

        Persistent bytes are not included; add persistent_bytes() for the device total.
        """
        last = self.last_uses()
        frees: list[list[int]] = [[] for _ in self.ops]
        for tid, index in enumerate(last):
            if index >= 0 and not self.tensors[tid].persistent:
                frees[index].append(tid)
        live = 0
        profile: list[int] = []
        for index, op in enumerate(self.ops):
            live += sum(self.tensors[tid].bytes for tid in op.outputs)
            profile.append(live)
            live -= sum(self.tensors[tid].bytes for tid in frees[index])
        return profile

    def peak_live_bytes(self) -> int:
        """Persistent bytes plus the highest transient live bytes over the step (no fragmentation,
        no alignment: a lower bound for what an allocator needs)."""
        profile = self.live_bytes_profile()
        return self.persistent_bytes() + (max(profile) if profile else 0)

    def total_flops(self) -> float:
        return sum(op.flops for op in self.ops)

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "input_shape": list(self.input_shape),
            "ops": len(self.ops),
            "tensors": len(self.tensors),
            "persistent_tensors": sum(1 for t in self.tensors if t.persistent),
            "persistent_bytes": self.persistent_bytes(),
            "peak_live_bytes": self.peak_live_bytes(),
            "total_flops": self.total_flops(),
        }

    # ----------------------------------------------------------------- checks
    def validate(self) -> None:
        """Raise TraceFormatError unless the trace is self-consistent.

        Checks: tensor ids are 0..n-1 in order; bytes are positive; persistent tensors are never
        produced; every other tensor is produced exactly once, before any op consumes it.
        """
        for index, tensor in enumerate(self.tensors):
            if tensor.id != index:
                raise TraceFormatError(f"tensor at position {index} has id {tensor.id}")
            if tensor.bytes <= 0:
                raise TraceFormatError(f"tensor {index} ({tensor.name}) has {tensor.bytes} bytes")
        if self.batch_size < 1:
            raise TraceFormatError(f"batch_size must be >= 1, got {self.batch_size}")
        produced = [False] * len(self.tensors)
        for op in self.ops:
            for tid in op.inputs:
                if not 0 <= tid < len(self.tensors):
                    raise TraceFormatError(f"op {op.name} reads unknown tensor {tid}")
                if not self.tensors[tid].persistent and not produced[tid]:
                    raise TraceFormatError(
                        f"op {op.name} reads tensor {tid} ({self.tensors[tid].name}) "
                        "before any op produces it"
                    )
            for tid in op.outputs:
                if not 0 <= tid < len(self.tensors):
                    raise TraceFormatError(f"op {op.name} writes unknown tensor {tid}")
                if self.tensors[tid].persistent:
                    raise TraceFormatError(f"op {op.name} lists persistent tensor {tid} as output")
                if produced[tid]:
                    raise TraceFormatError(f"tensor {tid} is produced twice (again by {op.name})")
                produced[tid] = True
            if op.flops < 0 or op.bytes_accessed < 0:
                raise TraceFormatError(f"op {op.name} has a negative cost")
        orphans = [t.id for t in self.tensors if not t.persistent and not produced[t.id]]
        if orphans:
            raise TraceFormatError(f"{len(orphans)} non-persistent tensors are never produced")

    # ----------------------------------------------------------------- batch rescaling
    def rescaled(self, batch_size: int) -> Trace:
        """The same step at another batch size.

        The op graph of a training step does not depend on the batch size (capture checks this by
        tracing at two batch sizes), so only sizes change: batch_scaled tensors scale exactly; an
        op's flops scale when any of its inputs or outputs is batch_scaled (a weight gradient's
        output is not batch-sized but its work is); bytes_accessed is recomputed from the rescaled
        tensors in the same proportion as before (0 stays 0 for ops that move nothing).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        old = self.batch_size
        tensors = []
        for t in self.tensors:
            if t.batch_scaled:
                new_bytes = _scale_int(t.bytes, batch_size, old)
                shape = t.shape
                if shape and shape[0] % old == 0:  # batch-major, possibly flattened
                    shape = (shape[0] // old * batch_size, *shape[1:])
                tensors.append(
                    TensorInfo(t.id, new_bytes, True, t.persistent, t.name, shape, t.dtype)
                )
            else:
                tensors.append(
                    TensorInfo(t.id, t.bytes, False, t.persistent, t.name, t.shape, t.dtype)
                )
        ops = []
        for op in self.ops:
            touched = [*op.inputs, *op.outputs]
            scaled = any(self.tensors[tid].batch_scaled for tid in touched)
            flops = op.flops * batch_size / old if scaled else op.flops
            old_io = sum(self.tensors[tid].bytes for tid in touched)
            new_io = sum(tensors[tid].bytes for tid in touched)
            accessed = op.bytes_accessed * new_io / old_io if old_io else op.bytes_accessed
            ops.append(OpInfo(op.name, op.type, list(op.inputs), list(op.outputs), flops, accessed))
        metadata = dict(self.metadata)
        metadata["rescaled_from_batch_size"] = metadata.get("rescaled_from_batch_size", old)
        return Trace(
            self.model,
            batch_size,
            self.input_shape,
            self.dtype,
            self.tensorflow_version,
            tensors,
            ops,
            metadata,
        )

    # ----------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        tensors = []
        for t in self.tensors:
            entry: dict[str, Any] = {
                "id": t.id,
                "bytes": t.bytes,
                "batch_scaled": t.batch_scaled,
                "persistent": t.persistent,
                "name": t.name,
            }
            if t.shape is not None:
                entry["shape"] = list(t.shape)
            if t.dtype is not None:
                entry["dtype"] = t.dtype
            tensors.append(entry)
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model": self.model,
            "batch_size": self.batch_size,
            "input_shape": list(self.input_shape),
            "dtype": self.dtype,
            "tensorflow_version": self.tensorflow_version,
            "metadata": self.metadata,
            "tensors": tensors,
            "ops": [
                {
                    "name": op.name,
                    "type": op.type,
                    "inputs": op.inputs,
                    "outputs": op.outputs,
                    "flops": op.flops,
                    "bytes_accessed": op.bytes_accessed,
                }
                for op in self.ops
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise TraceFormatError("not a tflms trace (missing 'format': 'tflms-trace')")
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise TraceFormatError(
                f"trace format version {version} is not supported by this tflms "
                f"(it reads version {FORMAT_VERSION}); re-create the trace with `tflms trace`"
            )
        try:
            tensors = [
                TensorInfo(
                    id=int(t["id"]),
                    bytes=int(t["bytes"]),
                    batch_scaled=bool(t["batch_scaled"]),
                    persistent=bool(t["persistent"]),
                    name=str(t["name"]),
                    shape=tuple(int(d) for d in t["shape"]) if "shape" in t else None,
                    dtype=str(t["dtype"]) if "dtype" in t else None,
                )
                for t in data["tensors"]
            ]
            ops = [
                OpInfo(
                    name=str(o["name"]),
                    type=str(o["type"]),
                    inputs=[int(i) for i in o["inputs"]],
                    outputs=[int(i) for i in o["outputs"]],
                    flops=float(o["flops"]),
                    bytes_accessed=float(o["bytes_accessed"]),
                )
                for o in data["ops"]
            ]
            return cls(
                model=str(data["model"]),
                batch_size=int(data["batch_size"]),
                input_shape=tuple(int(d) for d in data["input_shape"]),
                dtype=str(data["dtype"]),
                tensorflow_version=str(data["tensorflow_version"]),
                tensors=tensors,
                ops=ops,
                metadata=dict(data.get("metadata", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"malformed trace: {exc!r}") from exc


def _scale_int(value: int, numerator: int, denominator: int) -> int:
    # Batch-scaled sizes are exact multiples of the batch, so this is exact for them; rounding
    # only matters for hand-made traces.
    return max(1, (value * numerator + denominator // 2) // denominator)


def save_trace(trace: Trace, path: str | os.PathLike[str], compress: bool | None = None) -> Path:
    """Write a trace as JSON; gzip-compressed when the name ends in .gz (or compress=True).

    The file is written next to its destination and renamed into place, so a reader never sees a
    half-written trace.
    """
    target = Path(path)
    if compress is None:
        compress = target.suffix == ".gz"
    payload = json.dumps(trace.to_dict(), separators=(",", ":")).encode()
    if compress:
        payload = gzip.compress(payload, compresslevel=6, mtime=0)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace written by save_trace (plain or gzip JSON, detected from the content)."""
    raw = Path(path).read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        raw = gzip.decompress(raw)
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path} is not a JSON trace: {exc}") from exc
    return Trace.from_dict(data)
