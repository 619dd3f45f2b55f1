"""Tensors TensorFlow keeps in host memory on a GPU never reach the replayed device.

TensorFlow's GPU `Const` kernel for int32 is HostConstantOp (HostMemory("output")): the
shapes, axes and permutations a step's kernels read stay on the host. The replay used to
allocate each on the device and pin it with its kernel, where 256 bytes mid-device can
split the free memory a large output needs.
"""

from __future__ import annotations

import dataclasses

from tests.test_planner import GPU, chain_trace, machine
from tflms.planner.replay import build_plan, peak_live_bytes, replay
from tflms.trace.format import OpInfo, TensorInfo, Trace


def _with_concat(trace: Trace) -> tuple[Trace, dict[str, int]]:
    """The chain with a ConcatV2 of its last activation and an int32 label volume."""
    tensors, ops = list(trace.tensors), list(trace.ops)

    def tensor(nbytes: int, persistent: bool, name: str, dtype: str) -> int:
        tensors.append(TensorInfo(len(tensors), nbytes, False, persistent, name, None, dtype))
        return len(tensors) - 1

    ids = {
        "axis": tensor(4, True, "const:concat/axis", "int32"),
        "scale": tensor(4, True, "const:scale", "float32"),
        "labels": tensor(4096, False, "labels", "int32"),
        "counter": tensor(8, True, "capture:iterations", "int32"),
    }
    # The labels come with the images, from the input pipeline.
    ops[0] = dataclasses.replace(ops[0], outputs=[*ops[0].outputs, ids["labels"]])
    last = next(t.id for t in trace.tensors if t.name == "a7")
    ids["out"] = tensor(
        2 * next(t.bytes for t in trace.tensors if t.name == "a7"), False, "cat", "float32"
    )
    ops.append(OpInfo("concat", "ConcatV2", [last, last, ids["axis"]], [ids["out"]], 0.0, 1e6))
    ops.append(
        OpInfo(
            "metric", "Mul", [ids["out"], ids["scale"], ids["labels"], ids["counter"]], [], 0.0, 1e6
        )
    )
    out = dataclasses.replace(trace, tensors=tensors, ops=ops)
    out.validate()
    return out, ids


def test_int32_constants_are_not_allocated_or_pinned_on_the_device() -> None:
    trace, ids = _with_concat(chain_trace(layers=8, batch=4))
    plan = build_plan(trace, GPU)
    persistent = {tid for tid, _ in plan.persistent}
    pinned = {tid for ins in plan.inputs for tid in ins}
    # The int32 constant stays on the host: nothing allocates or pins it.
    assert ids["axis"] not in persistent and ids["axis"] not in pinned
    assert ids["axis"] not in plan.sizes
    # A float32 constant, an int32 variable and int32 data (labels) are device tensors.
    assert {ids["scale"], ids["counter"]} <= persistent
    assert {ids["scale"], ids["counter"], ids["labels"]} <= pinned
    assert (ids["labels"], 4096) in plan.outputs[0]
    # The concat still pins its two inputs and allocates its output.
    concat = plan.names.index("concat")
    assert plan.inputs[concat] == (next(t.id for t in trace.tensors if t.name == "a7"),)
    assert plan.outputs[concat] == ((ids["out"], trace.tensors[ids["out"]].bytes),)
    # And the real engine runs it, with one persistent buffer fewer than the trace lists.
    r = replay(plan, GPU, machine(peak_live_bytes(plan) // 2).config(), steps=2)
    assert r.fits, r.oom_message
    assert len(plan.persistent) == sum(1 for t in trace.tensors if t.persistent) - 1
