"""The replay's pin rules are the patch's (kernel_pins.cc, movable_tensor_buffer.cc).

Each test builds a small trace where the rule decides whether the step fits or what moves.
"""

from __future__ import annotations

from tests.test_planner import GPU, MIB, machine
from tflms.planner.replay import build_plan, replay
from tflms.planner.simulate import simulate_step
from tflms.trace.format import OpInfo, TensorInfo, Trace


class Builder:
    def __init__(self) -> None:
        self.tensors: list[TensorInfo] = []
        self.ops: list[OpInfo] = []

    def tensor(
        self, nbytes: int, persistent: bool = False, shape: tuple[int, ...] | None = None
    ) -> int:
        tid = len(self.tensors)
        self.tensors.append(
            TensorInfo(
                tid, nbytes, False, persistent, f"t{tid}", shape, "float32" if shape else None
            )
        )
        return tid

    def op(self, kind: str, inputs: list[int], outputs: list[int], flops: float = 1e6) -> None:
        io = sum(self.tensors[t].bytes for t in (*inputs, *outputs))
        self.ops.append(OpInfo(f"op{len(self.ops)}", kind, inputs, outputs, flops, float(io)))

    def trace(self) -> Trace:
        t = Trace("Rules", 1, (1,), "float32", "synthetic", self.tensors, self.ops)
        t.validate()
        return t


def test_variables_larger_than_the_gpu_fit_because_they_move_between_uses() -> None:
    # Eight 1 MiB weights (8 MiB) on a 3 MiB GPU: each is pinned only by the op using it.
    b = Builder()
    weights = [b.tensor(MIB, persistent=True) for _ in range(8)]
    x = b.tensor(64 * 1024)
    b.op("Fill", [], [x])
    for w in weights:
        y = b.tensor(64 * 1024)
        b.op("MatMul", [x, w], [y])
        x = y
    plan = build_plan(b.trace(), GPU)
    m = machine(3 * MIB, host=64 * MIB)
    assert not replay(plan, GPU, m.config(lms=False)).fits
    r = replay(plan, GPU, m.config())
    assert r.fits, r.oom_message
    # Weights went out to make room and came back for their op.
    assert r.h2d_bytes >= 4 * MIB


# The consumers below write nothing: with one region, TensorFlow's BFC hands a whole free
# chunk smaller than twice a request to that request, so a small output after a large
# tensor would need room these tiny GPUs do not have, and blur what each test shows.


def test_an_output_can_move_before_its_first_consumer_runs() -> None:
    # x is made, then y (as large) while x waits for its consumer: on a 3 MiB GPU x must go
    # out during y's kernel, which the creation pin allows only because it ended with x's.
    b = Builder()
    x, y = b.tensor(2 * MIB), b.tensor(2 * MIB)
    b.op("Fill", [], [x])
    b.op("Fill", [], [y])
    b.op("Sum", [y], [])
    b.op("Sum", [x], [])
    plan = build_plan(b.trace(), GPU)
    m = machine(3 * MIB, host=64 * MIB)
    assert not replay(plan, GPU, m.config(lms=False)).fits
    r = replay(plan, GPU, m.config(), steps=1)
    assert r.fits, r.oom_message
    assert r.d2h_bytes >= 2 * MIB and r.h2d_bytes >= 2 * MIB


def reclaimed_then_read_by(kind: str) -> Trace:
    # x is pushed out by a large tensor, and then read once more by a `kind` op.
    b = Builder()
    x, big = b.tensor(2 * MIB), b.tensor(2 * MIB)
    b.op("Fill", [], [x])
    b.op("Fill", [], [big])
    b.op("Sum", [big], [])
    b.op(kind, [x], [])
    return b.trace()


def test_kernels_that_read_no_input_bytes_page_nothing_in() -> None:
    m = machine(3 * MIB, host=64 * MIB)
    shape_op = replay(build_plan(reclaimed_then_read_by("ShapeN"), GPU), GPU, m.config(), steps=1)
    reader = replay(build_plan(reclaimed_then_read_by("Sum"), GPU), GPU, m.config(), steps=1)
    assert shape_op.fits and reader.fits
    # Sum reads x: it comes back. ShapeN reads only its shape: it stays on the host.
    assert reader.h2d_bytes >= 2 * MIB
    assert shape_op.h2d_bytes == 0
    assert shape_op.d2h_bytes >= 2 * MIB  # x did go out


def sliced(kind: str, row_floats: int = 65536) -> tuple[Trace, int]:
    # A (4, row) root split along dimension 0 into four rows, then pressure, then the rows.
    b = Builder()
    rows = 4
    root = b.tensor(rows * row_floats * 4, shape=(rows, row_floats))
    parts = [b.tensor(row_floats * 4, shape=(1, row_floats)) for _ in range(rows)]
    big = b.tensor(3 * MIB)
    b.op("Fill", [], [root])
    b.op(kind, [root], parts)
    b.op("Fill", [], [big])
    b.op("Sum", [big], [])
    for p in parts:
        b.op("Sum", [p], [])
    return b.trace(), root


def test_a_slice_is_a_view_whose_root_stays_in_place_while_it_lives() -> None:
    view_trace, root = sliced("Split")
    copy_trace, _ = sliced("Tile")  # same shapes, but a kernel that copies
    view, copy = build_plan(view_trace, GPU), build_plan(copy_trace, GPU)
    # The split allocates nothing: its outputs are views of the root, which lives until the
    # last view is read and is kept in place from the split on.
    assert view.outputs[1] == () and len(copy.outputs[1]) == 4
    # Pinned by the split while its views live: until the last view is read.
    assert view.slice_pins[1] == (root,) and view.slice_unpins[-1] == (root,)
    assert root in view.frees[-1]
    # 1 MiB root + 3 MiB tensor on a 3.5 MiB GPU: the copy's root dies at the split, and
    # its rows can move; the view's root cannot, so there is no room for the large tensor.
    m = machine(3 * MIB + 512 * 1024, host=64 * MIB)
    assert replay(copy, GPU, m.config(), steps=1).fits
    pinned_root = replay(view, GPU, m.config(), steps=1)
    assert not pinned_root.fits
    assert "cannot move" in pinned_root.oom_message


def test_an_unaligned_slice_is_a_copy() -> None:
    # Rows of 13 floats (52 bytes) do not start aligned: TensorFlow copies them.
    trace, _ = sliced("Split", row_floats=13)
    plan = build_plan(trace, GPU)
    assert len(plan.outputs[1]) == 4 and plan.slice_pins[1] == ()


def test_prefetch_is_not_credited_unless_asked_for() -> None:
    b = Builder()
    x = b.tensor(MIB)
    b.op("Fill", [], [x])
    b.op("Sum", [x], [b.tensor(4096)])
    report, _ = simulate_step(b.trace(), machine(4 * MIB), compare=False)
    assert [r["label"] for r in report["lms"]] == ["LMS + on-demand"]
    assert report["lms"][0]["config"]["prefetch"] is False
    assert machine(4 * MIB).config().prefetch is False


def test_a_root_moves_again_once_its_slices_are_gone() -> None:
    # The root is split, its rows are read, then a large tensor needs the root's room
    # before the root itself is read again: once the rows are dead it may go out.
    b = Builder()
    root = b.tensor(4 * 65536 * 4, shape=(4, 65536))
    parts = [b.tensor(65536 * 4, shape=(1, 65536)) for _ in range(4)]
    big = b.tensor(3 * MIB)
    b.op("Fill", [], [root])
    b.op("Split", [root], parts)
    for p in parts:
        b.op("Sum", [p], [])
    b.op("Fill", [], [big])
    b.op("Sum", [big], [])
    b.op("Sum", [root], [])
    plan = build_plan(b.trace(), GPU)
    assert plan.slice_pins[1] == (root,) and plan.slice_unpins[5] == (root,)
    r = replay(plan, GPU, machine(3 * MIB + 512 * 1024, host=64 * MIB).config(), steps=1)
    assert r.fits, r.oom_message
    assert r.d2h_bytes >= MIB and r.h2d_bytes >= MIB  # the root went out and came back
