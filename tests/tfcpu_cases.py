"""TensorFlow programs run by tests/test_tfcpu.py, each in a process of its own.

    python -m tests.tfcpu_cases CASE MODE

MODE is `stock` (TensorFlow as installed), `lms` (tflms.tfcpu with a modelled device
memory well below the program's peak), `defrag` (the same with defragmentation and
verified moves), `prefetch` (the same as `lms` with the engine's prefetch, which learns
steps from the step ids at the pin sites), `fixed` (the engine's fixed-address mode:
evicted pages unmapped) or
`nolms` (the tfcpu device and allocator without movable tensors).
The program prints one line `RESULT <json>`: its values (floats as hex, so equality is
bit-for-bit) and, under tfcpu, the engine's statistics.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# Modelled device memory per case: at most a quarter of the program's peak bytes in
# use measured without pressure, in the most frugal schedule seen (tests/test_tfcpu.py
# checks that ratio).
DEVICE_MEMORY = {
    "cnn": "2368KiB",
    "rnn": "2560KiB",
    "map_fn": "2368KiB",
    "tensor_array": "1536KiB",
    "variables": "8MiB",
    "temporaries": "64MiB",
    "kept_buffers": "8MiB",
    "forwarding": "64MiB",
    "dlpack": "8MiB",
    "custom_op": "8MiB",
    "retry": "8MiB",
    "pin_retry": "8MiB",
    "xla": "8MiB",
    "big_variables": "4MiB",
    "fragmented": "9MiB",
    "memory_stats": "8MiB",
    "no_read": "8MiB",
    "slice_root": "8MiB",
    "keras_fit": "2368KiB",
    "keras_fit_deep": "3MiB",
    "keras_fit_validated": "3MiB",
    "padding": "24MiB",
    "host_pieces": "8MiB",
    "host_full": "4544KiB",
    "host_exchange": "1280KiB",
    "list_stack": "1MiB",
    "array_gather": "1MiB",
    "concat": "1MiB",
}

# Host memory for reclaimed bytes per case (TF_GPU_HOST_MEM_LIMIT_IN_MB's role): 1 GiB,
# more than any case needs, except where the case is about the host side.
HOST_MEMORY: dict[str, str] = {
    "host_pieces": "1MiB",
    "host_full": "512KiB",
    "host_exchange": "512KiB",
}


def environment_before_tensorflow() -> None:
    """What the environment must say before TensorFlow is imported (also tfcpu_zygote's)."""
    # The same CPU kernels on every machine. TensorFlow turns its oneDNN kernels on by itself
    # only on CPUs with AVX-512; without them Conv2DBackpropInput falls back to a kernel whose
    # scratch buffer is sized for a 30 MiB L3 cache (26.8 MB for the CNN here), which no
    # modelled device a quarter of the CNN's peak can hold. Stock runs are set the same way,
    # so the bit-for-bit comparison is between the same kernels.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")


def _setup(case: str, mode: str) -> Any:
    environment_before_tensorflow()
    if mode != "stock":
        import tflms.tfcpu as tc

        memory = os.environ.get("TFCPU_DEVICE_MEMORY", DEVICE_MEMORY[case])
        host = os.environ.get("TFCPU_HOST_MEMORY", HOST_MEMORY.get(case, "1GiB"))
        tc.enable(
            device_memory=memory,
            host_memory=host,
            defrag=mode == "defrag",
            # "default" leaves prefetch unset: the patch's own code resolves it, as it
            # does for a program that never calls set_lms_prefetch_enabled.
            prefetch=None if mode == "default" else mode in ("prefetch", "guarded"),
            # "prefetch" tests prefetch itself in every step; "guarded" lets the
            # engine's guard time steps with and without it and keep the faster.
            prefetch_guard=mode == "guarded",
            verify_moves=mode == "defrag",
            lms=mode != "nolms",
            fixed_addresses=mode == "fixed",
            # Every pin checks the tensor's bytes against its last unpin's
            # (a stale page-in fails the kernel); benchmarks turn it off.
            verify_pins=os.environ.get("TFCPU_VERIFY_PINS", "1") == "1",
        )
        # Benchmarks pace the copies like a GPU's link (bench/prefetch_fit.py).
        link = os.environ.get("TFCPU_LINK_BYTES_PER_SECOND")
        if link:
            tc._model_link(float(link))  # noqa: SLF001
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    # One kernel at a time: the device's working set is then one kernel's, the
    # same in every run.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def _hex(values: Any) -> list[str]:
    import numpy as np

    return [float(v).hex() for v in np.asarray(values, dtype=np.float64).ravel()]


def _cnn16(keras: Any) -> Any:
    """16 same-padded 3x3 convolutions on 16x16x3 images, SGD with momentum, no XLA."""
    return _cnn(keras, depth=16, width=16)


def _cnn(keras: Any, depth: int, width: int) -> Any:
    """`depth` same-padded 3x3 convolutions of `width` filters on 16x16x3 images."""
    layers = [
        keras.layers.Conv2D(width, 3, padding="same", activation="relu") for _ in range(depth)
    ]
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            *layers,
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def cnn(tf: Any) -> dict[str, Any]:
    import keras
    import numpy as np

    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 10, 64)
    model = _cnn16(keras)
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
    return {"loss": _hex(history.history["loss"])}


def rnn(tf: Any) -> dict[str, Any]:
    import keras
    import numpy as np

    keras.utils.set_random_seed(2)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 48, 16)).astype("float32")
    y = rng.standard_normal((32, 1)).astype("float32")
    # use_cudnn=False: the generic loop (a while loop with TensorList accumulators)
    model = keras.Sequential(
        [
            keras.Input((48, 16)),
            keras.layers.LSTM(128, use_cudnn=False),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=False)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return {"loss": _hex(history.history["loss"])}


def map_fn(tf: Any) -> dict[str, Any]:
    x = tf.reshape(tf.range(256 * 128, dtype=tf.float32) / 1000.0, [256, 128])
    w = tf.reshape(tf.range(64 * 128, dtype=tf.float32) / 8192.0, [64, 128])

    @tf.function
    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            # Each iteration's intermediates are kept for the backward pass in
            # TensorList accumulators: the step's peak is mostly list elements.
            y = tf.map_fn(lambda r: tf.reduce_sum(tf.sin(tf.tile(r[None], [64, 1]) * w), 0), x)
            z = tf.scan(lambda a, r: a * 0.5 + tf.tanh(r), y)
            loss = tf.reduce_sum(z)
        return loss, tape.gradient(loss, x)

    loss, grad = step(x)
    loss2, grad2 = step(x * 0.5)
    return {"values": _hex([loss, tf.reduce_sum(grad), loss2, tf.reduce_sum(grad2)])}


def tensor_array(tf: Any) -> dict[str, Any]:
    # TF1 graph with control flow v1: TensorArrayV3 kernels read the array's
    # elements directly (Gather, Concat), which only the array handle reaches.
    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.disable_control_flow_v2()
    graph = tf.Graph()
    with graph.as_default():
        base = tf.reshape(tf.range(64 * 1024, dtype=tf.float32), [64, 1024]) / 7.0
        ta = tf.TensorArray(tf.float32, size=64, element_shape=[1024], clear_after_read=False)

        def body(i: Any, ta: Any) -> Any:
            return i + 1, ta.write(i, tf.sqrt(base[i] + tf.cast(i, tf.float32)))

        n, ta = tf.compat.v1.while_loop(lambda i, _: i < 64, body, [0, ta])
        # Made after the loop, so the array's elements are the older tensors
        # the engine pages out to make room; read only after the gather.
        big = tf.tile(base * (tf.cast(n, tf.float32) / 32.0), [2, 1])
        with tf.control_dependencies([big]):
            gathered = ta.gather(tf.range(63, -1, -1))
            concat = ta.concat()
        with tf.control_dependencies([gathered, concat]):
            big_sum = tf.reduce_sum(big)
        out = [tf.reduce_sum(gathered * 3.0), tf.reduce_sum(concat), gathered[5, 7], big_sum]
    with tf.compat.v1.Session(graph=graph) as sess:
        values = sess.run(out)
    return {"values": _hex(values)}


def variables(tf: Any) -> dict[str, Any]:
    import tflms.tfcpu as tc

    v = tf.Variable(tf.reshape(tf.range(256 * 1024, dtype=tf.float32), [256, 1024]))
    w = tf.Variable(tf.ones([1024, 64]))
    moved = tc.reclaim_inactive() if tc.enabled() else 0
    # Read after everything inactive left the device; then update in place.
    first = tf.reduce_sum(tf.matmul(v, w))
    v.assign_add(tf.ones_like(v))
    w.assign(w * 2.0)
    if tc.enabled():
        tc.reclaim_inactive()
    second = tf.reduce_sum(tf.matmul(v.read_value(), w))
    return {"values": _hex([first, second]), "reclaimed_before_read": moved}


def kept_buffers(tf: Any) -> dict[str, Any]:
    # Buffers a kernel creates and keeps without outputting them must not stay
    # pinned once it has finished: a variable's new buffer when its update copies
    # it (a read still references the old one), and list elements. Eager ops, so
    # that no kernel runs where the active bytes are read.
    import tflms.tfcpu as tc

    def active() -> int:
        return tc.stats()["bytes_active"] if tc.enabled() else 0

    v = tf.Variable(tf.fill([256, 1024], 1.0))  # 1 MiB
    delta = tf.fill([256, 1024], 0.25)
    before = active()
    old = v.read_value()  # shares v's buffer: the update below copies it
    v.assign_sub(delta)
    after_update = active()
    rows = tf.reshape(tf.range(8 * 16384, dtype=tf.float32), [8, 16384])
    listed = tf.raw_ops.TensorListFromTensor(tensor=rows, element_shape=tf.constant([16384]))
    after_list = active()
    stacked = tf.raw_ops.TensorListStack(
        input_handle=listed, element_shape=tf.constant([16384]), element_dtype=tf.float32
    )
    values = [tf.reduce_sum(old), tf.reduce_sum(v), tf.reduce_sum(stacked)]
    return {"values": _hex(values), "active": [before, after_update, after_list]}


def temporaries(tf: Any) -> dict[str, Any]:
    # Bytes in use after each step must come back to the same figure: buffers
    # freed while still creation-pinned (temporaries, unread outputs) are freed.
    import tflms.tfcpu as tc

    x = tf.reshape(tf.range(64 * 64, dtype=tf.float32), [64, 64]) / 100.0
    w = tf.Variable(tf.ones([64, 64]) * 0.01)

    @tf.function
    def step() -> Any:
        with tf.GradientTape() as tape:
            y = tf.nn.softmax(tf.matmul(x, w))
            loss = tf.reduce_sum(tf.math.log(y + 1.0))
        g = tape.gradient(loss, w)
        w.assign_sub(g * 0.1)
        _unused = tf.sort(tf.reshape(y, [-1]))  # an output nobody reads
        return loss

    in_use = []
    for _ in range(6):
        step()
        in_use.append(tc.stats()["bytes_in_use"] if tc.enabled() else 0)
    return {"bytes_in_use": in_use}


def forwarding(tf: Any) -> dict[str, Any]:
    # Allocations per step, to be compared with the same device without LMS.
    import tflms.tfcpu as tc

    x = tf.reshape(tf.range(128 * 128, dtype=tf.float32), [128, 128]) / 1000.0
    w = tf.Variable(tf.ones([128, 128]) * 0.01)

    @tf.function
    def step() -> Any:
        h = tf.matmul(x, w)
        h = tf.nn.relu(h + 1.0)  # Add, Relu: forward their input when it is unshared
        h = tf.cast(tf.cast(h, tf.float64) * 2.0, tf.float32)
        w.assign(h * 0.001)  # AssignVariableOp copies into the variable in place
        return tf.reduce_sum(h)

    counts = []
    for _ in range(4):
        before = tc.stats()["num_allocs"]
        step()
        counts.append(tc.stats()["num_allocs"] - before)
    return {"allocs_per_step": counts}


def dlpack(tf: Any) -> dict[str, Any]:
    import numpy as np

    import tflms.tfcpu as tc

    x = tf.reshape(tf.range(64 * 1024, dtype=tf.float32), [64, 1024])
    y = x * 3.0
    z = tf.reduce_sum(y)  # a consumer released y's creation pin: y may move
    if tc.enabled():
        tc.reclaim_inactive()
        tc._delay_page_ins(100_000)  # noqa: SLF001  the page-in lands late
    view = np.from_dlpack(y)
    got = float(view.astype(np.float64).sum())
    seen = view[3, :4].tolist()
    after = tf.reduce_sum(y * 1.0)
    return {"values": _hex([z, got, after, *seen])}


def custom_op(tf: Any) -> dict[str, Any]:
    # A kernel library built against the stock 2.21 headers (TensorBuffer
    # without any LMS change) produces a tensor over its own TensorBuffer
    # subclass; LMS kernels then read it, and its outputs are paged out and in.
    import tflms.tfcpu as tc

    module = tf.load_op_library(os.environ["TFCPU_CUSTOM_OP"])
    x = tf.reshape(tf.range(32 * 1024, dtype=tf.float32), [32, 1024])
    own = module.tflms_test_own_buffer(x)  # output over the op's own buffer
    scaled = module.tflms_test_scale(own, factor=0.5)  # allocate_output in the op
    total = tf.reduce_sum(scaled)
    if tc.enabled():
        tc.reclaim_inactive()
    # With an optional 16 MiB scratch space, more than the modelled device holds.
    scaled_again = module.tflms_test_scale(scaled, factor=2.0, scratch_bytes=16 << 20)
    again = tf.reduce_sum(scaled_again + own)
    return {"values": _hex([total, again])}


def _waited_while_held(tf: Any, n: int, run: Callable[[], Any]) -> tuple[Any, float]:
    """run()'s result and its seconds, while another thread holds an escaped tensor of n
    floats (it cannot move) and drops it after 0.5 s."""
    import threading
    import time

    import numpy as np

    held = [tf.fill([n], tf.constant(1.5))]
    held.append(np.asarray(held[0]))  # the address escaped: it cannot move

    def release() -> None:
        time.sleep(0.5)
        held.clear()

    thread = threading.Thread(target=release)
    thread.start()
    start = time.monotonic()
    result = run()
    waited = time.monotonic() - start
    thread.join()
    return result, waited


def retry(tf: Any) -> dict[str, Any]:
    # An allocation that does not fit while another thread is about to free
    # memory waits for it, as TensorFlow's BFC allocator does (up to 10 s).
    import numpy as np

    n = 6 * 1024 * 1024 // 4
    # y does not fit beside the held tensor.
    y, waited = _waited_while_held(tf, n, lambda: tf.fill([n], tf.constant(2.0)))
    # Read on the host: y fills the device (BFC does not split a chunk for it).
    return {"values": _hex([np.asarray(y).astype(np.float64).sum()]), "waited": waited}


def pin_retry(tf: Any) -> dict[str, Any]:
    # A kernel whose input was paged out, while another thread holds the memory its
    # page-in needs and is about to drop it: the pin waits, as an allocation does.
    import tflms.tfcpu as tc

    n = 6 * 1024 * 1024 // 4
    x = tf.fill([n], tf.constant(0.75))
    if tc.enabled():
        tc.reclaim_inactive()  # x is on the host now
    # Pins x: its page-in does not fit beside the held tensor.
    total, waited = _waited_while_held(tf, n, lambda: tf.reduce_sum(x))
    return {"values": _hex([total]), "waited": waited}


def xla(tf: Any) -> dict[str, Any]:
    # An XLA cluster's buffers never move: LMS warns once, and results hold.
    x = tf.reshape(tf.range(256 * 256, dtype=tf.float32), [256, 256]) / 65536.0

    @tf.function(jit_compile=True)
    def f(x: Any) -> Any:
        return tf.reduce_sum(tf.tanh(tf.matmul(x, x)))

    return {"values": _hex([f(x), f(x * 2.0)])}


def big_variables(tf: Any) -> dict[str, Any]:
    # Weights and Adam's slots (about 6.5 MB) exceed the modelled device
    # memory: variables must move between uses, as in TFLMS v2.
    import keras
    import numpy as np

    import tflms.tfcpu as tc

    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 256)).astype("float32")
    y = rng.standard_normal((64, 1)).astype("float32")
    layers = [keras.layers.Dense(256, activation="relu") for _ in range(8)]
    model = keras.Sequential([keras.Input((256,)), *layers, keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=False)
    # Bytes that cannot move between steps, where no kernel runs: a weight that its
    # update copied (copy-on-write) must not stay pinned until the next step reads it.
    active: list[int] = []

    class ActiveBytes(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if tc.enabled():
                active.append(tc.stats()["bytes_active"])

    history = model.fit(
        x, y, batch_size=32, epochs=3, verbose=0, shuffle=False, callbacks=[ActiveBytes()]
    )
    weights = sum(float(np.abs(w).sum()) for w in model.get_weights())
    variable_bytes = sum(
        int(np.prod(v.shape)) * 4 for v in [*model.variables, *model.optimizer.variables]
    )
    return {
        "loss": _hex(history.history["loss"]),
        "weights": _hex([weights]),
        "variable_bytes": variable_bytes,
        "active_between_steps": active,
    }


def fragmented(tf: Any) -> dict[str, Any]:
    # Free holes between tensors no kernel uses: a large allocation fits only
    # once they are moved together (defragmentation) or paged out.
    n = 256 * 1024  # 1 MiB of float32
    tensors = [tf.fill([n], float(i)) for i in range(8)]
    kept = tensors[1::2]
    del tensors
    big = tf.fill([4 * n], 9.0)
    sums = [tf.reduce_sum(t) for t in [*kept, big]]
    return {"values": _hex(sums)}


def list_stack(tf: Any) -> dict[str, Any]:
    # A loop's accumulator the way the device fills up: each 1 KiB list element is
    # made right after a 15 KiB tensor, so the 62 elements lie 16 KiB apart over the
    # whole 1 MiB device. TensorListStack pins them all and needs 62 KiB: paging out
    # the 15 KiB tensors leaves gaps of 15 KiB between pinned elements. Eager, so
    # ops run in program order and the layout is the program's own.
    width, count = 256, 62
    lst = tf.raw_ops.EmptyTensorList(
        element_shape=tf.constant([width]), max_num_elements=-1, element_dtype=tf.float32
    )
    kept = []
    for i in range(count):
        kept.append(tf.fill([15 * width], float(i)))
        element = tf.sin(tf.fill([width], float(i) * 0.25))
        lst = tf.raw_ops.TensorListPushBack(input_handle=lst, tensor=element)
    stacked = tf.raw_ops.TensorListStack(
        input_handle=lst, element_dtype=tf.float32, element_shape=[width]
    )
    return {"values": _hex([tf.reduce_sum(stacked), stacked[count - 1, 7], tf.reduce_sum(kept[3])])}


def array_gather(tf: Any) -> dict[str, Any]:
    # list_stack's layout with a TensorArray resource instead of a list: the kernel
    # pins reach the elements through the array's handle, and TensorArrayGatherV3
    # pins all 62 and needs 62 KiB. TensorFlow 2 lowers tf.TensorArray to lists inside
    # functions; the resource kernels run here by name.
    width, count = 256, 62
    handle, flow = tf.raw_ops.TensorArrayV3(
        size=count,
        dtype=tf.float32,
        element_shape=[width],
        clear_after_read=False,
        identical_element_shapes=True,
    )
    kept = []
    for i in range(count):
        kept.append(tf.fill([15 * width], float(i)))
        element = tf.sin(tf.fill([width], float(i) * 0.25))
        flow = tf.raw_ops.TensorArrayWriteV3(handle=handle, index=i, value=element, flow_in=flow)
    gathered = tf.raw_ops.TensorArrayGatherV3(
        handle=handle,
        indices=tf.range(count),
        flow_in=flow,
        dtype=tf.float32,
        element_shape=[width],
    )
    values = [tf.reduce_sum(gathered), gathered[count - 1, 7], tf.reduce_sum(kept[3])]
    return {"values": _hex(values)}


def concat(tf: Any) -> dict[str, Any]:
    # A concat's two inputs, the way UNet3D's skip connection meets its upsampled
    # tensor: one on the host, the other resident in the middle of the device, and
    # the only free hole the first fits right beside it (units of 64 KiB, a 16-unit
    # device). Paged in there by its pin, the pair would sit in the middle and leave
    # no gap for the 6-unit output with 10 units free.
    import tflms.tfcpu as tc

    unit = 16 * 1024  # float32 elements in 64 KiB
    skip = tf.fill([3 * unit], 2.0)
    if tc.enabled():  # stock TensorFlow has no host to page out to
        tc.reclaim_inactive()
    f0 = tf.fill([4 * unit], 0.5)
    up = tf.fill([3 * unit], 1.0)
    f1 = tf.fill([unit], 1.5)
    f2 = tf.fill([3 * unit], 2.5)
    f3 = tf.fill([5 * unit], 3.5)
    del f2
    joined = tf.concat([up, skip], axis=0)
    values = [tf.reduce_sum(joined), joined[3 * unit + 5], tf.reduce_sum(f0 + f1[0] + f3[0])]
    return {"values": _hex(values)}


def memory_stats(tf: Any) -> dict[str, Any]:
    # tf.config.experimental.get_memory_info / reset_memory_stats reach the LMS
    # allocator's GetStats and ClearStats.
    x = tf.ones([256, 1024])
    y = x * 2.0
    total = float(tf.reduce_sum(y))
    del y
    before = tf.config.experimental.get_memory_info("CPU:0")
    tf.config.experimental.reset_memory_stats("CPU:0")
    after = tf.config.experimental.get_memory_info("CPU:0")
    return {"total": total, "before": before, "after": after}


def no_read(tf: Any) -> dict[str, Any]:
    # Kernels that never read their inputs' bytes (Shape, Size, Rank, Identity,
    # the calls and control-flow forwarding ops) must not page a tensor in.
    import tflms.tfcpu as tc

    x = tf.fill([512, 1024], tf.constant(3.0))  # 2 MiB

    # Unknown rank: grappler cannot fold Shape, Size or Rank into constants, so
    # their kernels really run on the paged-out tensor.
    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
    def meta(t: Any) -> Any:
        same = tf.identity(t)
        return tf.shape(same), tf.size(same), tf.rank(same), same

    meta.get_concrete_function()  # traced before x leaves the device
    page_ins = []
    if tc.enabled():
        tc.reclaim_inactive()
        page_ins.append(tc.stats()["num_page_ins"])
    shape, size, rank, same = meta(x)
    if tc.enabled():
        page_ins.append(tc.stats()["num_page_ins"])
    total = tf.reduce_sum(same)  # a kernel that reads: the bytes come back
    if tc.enabled():
        page_ins.append(tc.stats()["num_page_ins"])
    values = [*shape.numpy().tolist(), int(size), int(rank), total]
    return {"values": _hex(values), "page_ins": page_ins}


def slice_root(tf: Any) -> dict[str, Any]:
    # A slice aliases its root's bytes: the root stays pinned in place while the
    # slice lives, and may move again once every slice is gone.
    import tflms.tfcpu as tc

    x = tf.reshape(tf.range(1024 * 512, dtype=tf.float32), [1024, 512]) / 1000.0
    s = x[256:512]  # StridedSlice on the first axis: Tensor::Slice, no copy
    moved = []
    if tc.enabled():
        moved.append(tc.reclaim_inactive())
    with_slice = tf.reduce_sum(s * 2.0)
    del s
    if tc.enabled():
        moved.append(tc.reclaim_inactive())
    after = tf.reduce_sum(x)
    return {"values": _hex([with_slice, after]), "moved": moved, "root_bytes": 1024 * 512 * 4}


def keras_fit(tf: Any) -> dict[str, Any]:
    # What a user runs: Keras fit over a tf.data pipeline, several short epochs,
    # validation after each, and a callback whose eager ops run between steps.
    # Each train step is a call of Keras's train function (its own step id); the
    # pipeline's map function and the callback's ops run under ids of their own.
    return _fit_over_pipeline(tf, _cnn16)


def keras_fit_deep(tf: Any) -> dict[str, Any]:
    # keras_fit's program with the proportions of a GPU training step: 48 narrow
    # convolutions whose 256 KiB activations are a twelfth of the modelled device (the
    # largest of ResNet50's at 4x batch on a 16 GB V100 are a seventh of it), where
    # keras_fit's 512 KiB ones are 22% of its device and exceed the prefetch budget.
    return _fit_over_pipeline(tf, lambda keras: _cnn(keras, depth=48, width=8))


def keras_fit_validated(tf: Any) -> dict[str, Any]:
    # keras_fit_deep with six validation steps an epoch, more than the engine keeps
    # recordings of step orders, as a user's validation set of a few hundred examples
    # gives. Under tfcpu it also reports, for the first training step of each epoch
    # after the first, the bytes paged in and those paged in on demand.
    return _fit_over_pipeline(tf, lambda keras: _cnn(keras, depth=48, width=8), validation_steps=6)


def _fit_over_pipeline(
    tf: Any, make_model: Callable[[Any], Any], validation_steps: int = 1
) -> dict[str, Any]:
    import keras
    import numpy as np

    keras.utils.set_random_seed(4)
    rng = np.random.default_rng(3)
    examples = 128 + 32 * validation_steps
    x = rng.standard_normal((examples, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 10, examples)

    def scale(images: Any, labels: Any) -> Any:
        return images * 0.5 + 0.25, labels

    train = tf.data.Dataset.from_tensor_slices((x[:128], y[:128])).map(scale).batch(32)
    val = tf.data.Dataset.from_tensor_slices((x[128:], y[128:])).map(scale).batch(32)
    model = make_model(keras)
    norms: list[Any] = []

    after_validation: list[list[int]] = []
    watch = validation_steps > 1 and _lms_stats() is not None

    class KernelNorm(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if watch and batch == 0:
                after_validation.append(_paged_in())

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if watch and batch == 0:
                begin = after_validation.pop()
                after_validation.append([b - a for a, b in zip(begin, _paged_in(), strict=True)])
            norms.append(tf.reduce_sum(tf.square(self.model.layers[0].kernel)))

    history = model.fit(
        train, validation_data=val, epochs=4, verbose=0, shuffle=False, callbacks=[KernelNorm()]
    )
    result = {
        "loss": _hex(history.history["loss"]),
        "val_loss": _hex(history.history["val_loss"]),
        "norms": _hex(norms),
    }
    if watch:
        # The first epoch's first step has nothing to follow yet.
        result["first_after_validation"] = after_validation[1:]
    return result


def _lms_stats() -> dict[str, int] | None:
    """The engine's statistics where LMS runs (not stock TensorFlow, not `nolms`)."""
    import tflms.tfcpu as tc

    stats = tc.stats() if tc.enabled() else {}
    return stats if "bytes_paged_in_on_demand" in stats else None


def _paged_in() -> list[int]:
    stats = _lms_stats() or {}
    return [stats.get("bytes_paged_in", 0), stats.get("bytes_paged_in_on_demand", 0)]


def padding(tf: Any) -> dict[str, Any]:
    # Training steps whose activations are a few MiB each and of mixed sizes: a tensor
    # that takes a free chunk less than twice its size leaves the rest inside its chunk
    # (TensorFlow's split rule), padding the engine gives back while it follows the
    # learned step's plan (core/src/padding.cc) before it pages anything out.
    widths = [256, 1024, 384, 768, 512, 640, 16]
    batch = 2048
    x = tf.random.stateless_normal([batch, widths[0]], seed=[1, 2])
    labels = tf.random.stateless_normal([batch, widths[-1]], seed=[3, 4])
    weights = [
        tf.Variable(tf.random.stateless_normal([a, b], seed=[5, i]) * (2.0 / a) ** 0.5)
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True))
    ]

    @tf.function
    def step() -> Any:
        with tf.GradientTape() as tape:
            h = x
            for w in weights[:-1]:
                h = tf.nn.relu(tf.matmul(h, w))
            loss = tf.reduce_mean(tf.square(tf.matmul(h, weights[-1]) - labels))
        for w, g in zip(weights, tape.gradient(loss, weights), strict=True):
            w.assign_sub(0.01 * g)
        return loss

    losses = [step() for _ in range(8)]
    return {"values": _hex(losses)}


def host_pieces(tf: Any) -> dict[str, Any]:
    # A host side whose free bytes lie in two holes, neither large enough for the next
    # page-out: a, b and c go to the host in that order, a and c are freed, and d (700
    # KiB) fits only in both holes together, as a copy in two pieces (host_pool.cc).
    import tflms.tfcpu as tc

    lms = tc.enabled() and "num_scattered_host_copies" in tc.stats()
    kib = 256  # float32 elements per KiB
    a = tf.fill([400 * kib], 1.0)
    b = tf.range(200 * kib, dtype=tf.float32)
    c = tf.fill([400 * kib], 3.0)
    if lms:
        tc.reclaim_inactive()
    del a, c
    d = tf.range(700 * kib, dtype=tf.float32) * 0.5
    if lms:
        tc.reclaim_inactive()
    scattered = tc.stats()["num_scattered_host_copies"] if lms else None
    # Read back: the pins page d in from its two pieces (verified against its last
    # unpin's bytes), and b from its one.
    values = [tf.reduce_sum(d), tf.reduce_max(d), tf.reduce_sum(b)]
    return {"values": _hex(values), "scattered": scattered}


def host_full(tf: Any) -> dict[str, Any]:
    # Holes of 640 KiB between inactive 1 MiB tensors, with a host side (512 KiB) that
    # takes none of them: the 1216 KiB output fits only once b slides down into the
    # hole below it and the holes join (defrag.cc, SlideFor). No tensor finds a hole
    # of its own size to move to, so moving alone (DefragFor) cannot make the room.
    kib = 256  # float32 elements per KiB
    # Room for the reductions' outputs, freed at the bottom: c takes the rest of the
    # device whole (a chunk under twice a request is not split, as in TensorFlow's BFC).
    spare = [tf.fill([16 * kib], 0.0) for _ in range(4)]
    a = tf.fill([1024 * kib], 1.0)
    g1 = tf.fill([640 * kib], 2.0)
    b = tf.range(1024 * kib, dtype=tf.float32)
    g2 = tf.fill([640 * kib], 4.0)
    c = tf.fill([1024 * kib], 5.0)
    del g1, g2, spare
    big = tf.range(1216 * kib, dtype=tf.float32)
    values = [tf.reduce_sum(x) for x in (a, b, c, big)] + [b[12345], b[-1]]
    return {"values": _hex(values)}


def host_exchange(tf: Any) -> dict[str, Any]:
    # Both memories nearly full (core/src/exchange.cc, swap.cc). s1-s3 (384 KiB) go to
    # the 512 KiB host side; spare tensors, v (512 KiB) and p (128 KiB) take their place
    # at the bottom of the device, below free chunks none of which holds 512 KiB.
    # Tiling p into 512 KiB fits only where v lies, and the host cannot take v: s1-s3
    # come back into the free top, which frees their host copies, and v leaves (an
    # exchange). Reading v back then finds neither memory with room for it: it trades
    # places with the tiled tensor, in pieces through the free bytes (a swap in place).
    # Without either this is an out-of-memory error.
    import tflms.tfcpu as tc

    lms = tc.enabled() and "num_host_exchanges" in tc.stats()
    kib = 256  # float32 elements per KiB
    s = [tf.fill([128 * kib], float(i + 1)) for i in range(3)]
    if lms:
        tc.reclaim_inactive()
    # Room for the reductions' outputs, freed once the tile has run.
    spare = [tf.fill([16 * kib], 0.0) for _ in range(4)]
    v = tf.range(512 * kib, dtype=tf.float32)
    p = tf.range(128 * kib, dtype=tf.float32) * 0.25
    tiled = tf.tile(p, [4])
    del spare
    values = [tf.reduce_sum(x) for x in (tiled, *s, v, p)]
    values += [tiled[-1], v[12345], v[-1]]
    moved = None
    if lms:
        st = tc.stats()
        moved = [st[k] for k in ("num_host_exchanges", "num_swaps_in_place", "num_ooms")]
    return {"values": _hex(values), "moved": moved}


AUTOGRAPH_PREFIX = "__autograph_generated_file"

CASES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "cnn": cnn,
    "rnn": rnn,
    "map_fn": map_fn,
    "tensor_array": tensor_array,
    "variables": variables,
    "temporaries": temporaries,
    "kept_buffers": kept_buffers,
    "forwarding": forwarding,
    "dlpack": dlpack,
    "custom_op": custom_op,
    "retry": retry,
    "pin_retry": pin_retry,
    "xla": xla,
    "big_variables": big_variables,
    "fragmented": fragmented,
    "memory_stats": memory_stats,
    "no_read": no_read,
    "slice_root": slice_root,
    "keras_fit": keras_fit,
    "keras_fit_deep": keras_fit_deep,
    "keras_fit_validated": keras_fit_validated,
    "padding": padding,
    "host_pieces": host_pieces,
    "host_full": host_full,
    "host_exchange": host_exchange,
    "list_stack": list_stack,
    "array_gather": array_gather,
    "concat": concat,
}


def main(argv: list[str]) -> None:
    case, mode = argv
    tf = _setup(case, mode)
    start = time.perf_counter()
    result = CASES[case](tf)
    result["wall_s"] = time.perf_counter() - start
    # Where autograph's generated sources went, and how many are there while the process
    # lives (they are removed at its exit): a test checks that none outlives its case.
    temp = tempfile.gettempdir()
    result["temp_dir"] = temp
    result["autograph_files"] = sum(
        1 for name in os.listdir(temp) if name.startswith(AUTOGRAPH_PREFIX)
    )
    if mode != "stock":
        import tflms.tfcpu as tc

        result["stats"] = tc.stats()
        result["kernel_wait_ns"] = tc._kernel_wait_ns()  # noqa: SLF001
        result["prefetch_enabled"] = tc.prefetch_enabled()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
