"""Capture one training step of a Keras model as a trace, without executing it.

The step (forward pass, sparse categorical cross-entropy, gradients, SGD with momentum) is traced
into a tf.function graph with static shapes; the graph is then walked:

- ops TensorFlow's function runtime would prune (not reachable from the step's outputs or control
  outputs, and not stateful) are dropped;
- ops are ordered topologically, following graph creation order wherever that order is valid
  (creation order is the program order of the Python step);
- captured variables (weights, BatchNorm statistics, optimizer slots and counters) and constants
  become persistent tensors; the step's inputs (images, labels) are produced by their Placeholder;
- ops that only forward a buffer (ReadVariableOp, Identity, Reshape, ...) allocate nothing: their
  outputs are the tensor they read, so a variable read is the variable itself;
- which tensors scale with the batch is measured, not guessed: the step is traced a second time at
  batch + 1 and the two graphs are compared tensor by tensor.

Transformers (keras-hub) train a language-model step instead: token ids in, cross-entropy over the
vocabulary at every position, Adam. Their variables are created without storage (handles only,
tflms.trace.transformers.variables_without_storage), so a model larger than this machine's memory
traces; the graph is the same as with real variables. `precision="mixed"` traces under Keras'
mixed_bfloat16 policy (bfloat16 compute, float32 variables and optimizer state).

See docs/trace-format.md for the format and these modelling choices.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import time
import warnings
from collections.abc import Iterable
from typing import Any

from tflms.trace.costs import ALIAS_OPS, estimate_flops
from tflms.trace.format import OpInfo, TensorInfo, Trace
from tflms.trace.models import (
    MODEL_SPECS,
    build_model,
    check_input_size,
    input_dtype,
    input_shape,
    label_shape,
    resolve_model_name,
)

log = logging.getLogger(__name__)

# Bump when the way traces are extracted changes, so cached traces are re-made.
# 2: segment sums cost their input, transformers; 3: transformer masks computed from the ids.
CAPTURE_REVISION = 3

OPTIMIZER_DESCRIPTIONS = {
    "sgd": "SGD(learning_rate=0.01, momentum=0.9)",
    "adam": "Adam(learning_rate=1e-4)",
}
LOSS_DESCRIPTION = "SparseCategoricalCrossentropy"
# Trace precisions: Keras dtype policies. Mixed precision uses bfloat16, which needs no loss
# scaling (float16's dynamic loss scale is a conditional update that a flat step cannot hold; its
# memory is a few scalars per variable).
PRECISIONS = {"fp32": "float32", "mixed": "mixed_bfloat16"}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return precision


def _import_tensorflow() -> tuple[Any, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    return tf, keras


def trace_model(
    model: str,
    batch_size: int,
    input_size: int | None = None,
    progress: bool = True,
    precision: str = "fp32",
    variables_without_storage: bool | None = None,
) -> Trace:
    """Trace one training step of `model` (a name in MODEL_NAMES) at `batch_size`.

    input_size is the image edge (the U-Net's cube edge, a transformer's sequence length); None
    uses the model's default. precision is a key of PRECISIONS. variables_without_storage (default:
    for the transformers) creates the variables as handles without values.
    Resets Keras' global state (clear_session) so op names do not depend on earlier models.
    """
    from tqdm import tqdm

    name = resolve_model_name(model)
    size = check_input_size(name, input_size)
    spec = MODEL_SPECS[name]
    check_precision(precision)
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    if variables_without_storage is None:
        variables_without_storage = spec.text
    started = time.perf_counter()
    with tqdm(
        total=4, desc=f"trace {name} b{batch_size}", disable=not progress, unit="stage"
    ) as bar:
        bar.set_postfix_str("importing TensorFlow")
        tf, keras = _import_tensorflow()
        bar.set_postfix_str("building model")
        keras.backend.clear_session()
        previous_policy = keras.config.dtype_policy()
        storage = contextlib.nullcontext()
        if variables_without_storage:
            from tflms.trace.transformers import variables_without_storage as without_storage

            storage = without_storage()
        try:
            keras.config.set_dtype_policy(PRECISIONS[precision])
            with warnings.catch_warnings(), storage:
                warnings.simplefilter("ignore")
                net = build_model(name, size)
                if spec.optimizer == "adam":
                    optimizer = keras.optimizers.Adam(learning_rate=1e-4)
                else:
                    optimizer = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
                optimizer.build(net.trainable_variables)
        finally:
            keras.config.set_dtype_policy(previous_policy)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=spec.text)
        step = _train_step(tf, net, optimizer, loss)
        parameters = sum(_num_elements(v.shape) for v in net.trainable_variables)
        bar.update(1)

        bar.set_postfix_str(f"tracing at batch {batch_size}")
        graph = _trace_graph(tf, step, name, size, batch_size)
        bar.update(1)
        bar.set_postfix_str(f"tracing at batch {batch_size + 1}")
        probe = _trace_graph(tf, step, name, size, batch_size + 1)
        bar.update(1)

        bar.set_postfix_str("extracting ops")
        variables = {id(v.value.handle): v for v in [*net.variables, *optimizer.variables]}
        extractor = _Extractor(tf, graph, probe, batch_size, variables)
        tensors, ops = extractor.run()
        bar.update(1)
    elapsed = time.perf_counter() - started
    trace = Trace(
        model=name,
        batch_size=batch_size,
        input_shape=input_shape(name, size),
        dtype=PRECISIONS[precision],
        tensorflow_version=tf.__version__,
        tensors=tensors,
        ops=ops,
        metadata={
            "input_size": size,
            "keras_version": keras.__version__,
            "optimizer": OPTIMIZER_DESCRIPTIONS[spec.optimizer],
            "loss": LOSS_DESCRIPTION,
            "precision": precision,
            "parameters": parameters,
            "graph_ops": extractor.graph_ops,
            "pruned_ops": extractor.pruned_ops,
            "capture_revision": CAPTURE_REVISION,
            "batch_scaling": extractor.batch_scaling_method,
            "trace_seconds": round(elapsed, 2),
        },
    )
    trace.validate()
    log.info(
        "traced %s at batch %d, size %d: %d ops, %d tensors in %.1f s",
        name,
        batch_size,
        size,
        len(ops),
        len(tensors),
        elapsed,
    )
    return trace


def _train_step(tf: Any, net: Any, optimizer: Any, loss_fn: Any) -> Any:
    @tf.function
    def train_step(images: Any, labels: Any) -> Any:
        with tf.GradientTape() as tape:
            predictions = net(images, training=True)
            loss = loss_fn(labels, predictions)
        gradients = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(gradients, net.trainable_variables, strict=True))
        return loss

    return train_step


def _trace_graph(tf: Any, step: Any, name: str, size: int, batch: int) -> Any:
    images = tf.TensorSpec(
        (batch, *input_shape(name, size)), tf.as_dtype(input_dtype(name)), name="images"
    )
    labels = tf.TensorSpec((batch, *label_shape(name, size)), tf.int32, name="labels")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return step.get_concrete_function(images, labels).graph


# Ops whose output length depends on values, not shapes, but is bounded by their inputs' length:
# BroadcastGradientArgs returns the axes to reduce a broadcast gradient over (at most the rank).
BOUNDED_BY_INPUT_LENGTH = frozenset({"BroadcastGradientArgs"})


def _static_shape(tensor: Any) -> tuple[int, ...]:
    shape = tensor.shape
    if tensor.op.type in BOUNDED_BY_INPUT_LENGTH and shape.rank == 1:
        # The largest it can be; a few bytes either way.
        return (max(int(t.shape[0]) for t in tensor.op.inputs),)
    if shape.rank is None or not shape.is_fully_defined():
        raise ValueError(
            f"tensor {tensor.name} has a shape that is not static ({shape}); "
            "tflms trace needs every shape known at trace time"
        )
    return tuple(int(d) for d in shape)


def _dtype_size(dtype: Any) -> int:
    # resource, variant and string tensors own no fixed-size device buffer.
    if dtype.name in ("resource", "variant", "string"):
        return 0
    return int(dtype.size)


class _Extractor:
    """Turns a traced step graph into trace tensors and ops."""

    def __init__(
        self, tf: Any, graph: Any, probe: Any, batch_size: int, variables: dict[int, Any]
    ) -> None:
        self.tf = tf
        self.graph = graph
        self.batch_size = batch_size
        self.tensors: list[TensorInfo] = []
        self.ops: list[OpInfo] = []
        self.id_of: dict[str, int | None] = {}  # TF tensor name -> trace tensor id (None: no bytes)
        self.shape_of: dict[str, tuple[int, ...]] = {}  # shapes used for costs (variables too)
        self.captured: dict[str, str] = {}  # internal placeholder name -> variable/capture name
        self.captured_variables: dict[str, Any] = {}
        for external, internal in graph.captures:
            variable = variables.get(id(external))
            label = variable.path if variable is not None else internal.op.name
            self.captured[internal.name] = f"capture:{label}"
            if variable is not None:
                self.captured_variables[internal.name] = variable
        self.probe_bytes = self._probe_bytes(probe)
        self.graph_ops = len(graph.get_operations())
        self.pruned_ops = 0
        self.non_proportional: list[tuple[str, int, int]] = []

    # --------------------------------------------------------------- batch scaling
    def _probe_bytes(self, probe: Any) -> dict[str, int] | None:
        """Bytes of each tensor at batch + 1, keyed by the batch-B graph's tensor names; None
        when the two graphs differ in structure (then the leading dimension decides)."""
        ops, probe_ops = self.graph.get_operations(), probe.get_operations()
        same = len(ops) == len(probe_ops) and all(
            a.name == b.name and a.type == b.type and len(a.outputs) == len(b.outputs)
            for a, b in zip(ops, probe_ops, strict=False)
        )
        if not same:
            log.warning(
                "the step graph differs between batch %d and %d; batch scaling falls back to "
                "'leading dimension == batch'",
                self.batch_size,
                self.batch_size + 1,
            )
            self.batch_scaling_method = "leading-dimension"
            return None
        self.batch_scaling_method = "measured"
        result: dict[str, int] = {}
        for a, b in zip(ops, probe_ops, strict=True):
            for ta, tb in zip(a.outputs, b.outputs, strict=True):
                if tb.shape.is_fully_defined():
                    result[ta.name] = _dtype_size(tb.dtype) * _num_elements(tb.shape)
        return result

    def _batch_scaled(self, tensor: Any, nbytes: int) -> bool:
        if self.probe_bytes is None:
            shape = tensor.shape
            return shape.rank is not None and shape.rank > 0 and shape[0] == self.batch_size
        probe = self.probe_bytes.get(tensor.name)
        if probe is None or probe == nbytes:
            return False
        batch = self.batch_size
        if nbytes * (batch + 1) != probe * batch:
            # Typically reduction indices of broadcast gradients, which differ at batch 1.
            self.non_proportional.append((tensor.name, nbytes, probe))
            return False
        return True

    # --------------------------------------------------------------- walking the graph
    def run(self) -> tuple[list[TensorInfo], list[OpInfo]]:
        kept = self._live_ops()
        self.pruned_ops = self.graph_ops - len(kept)
        for op in _creation_topological_order(kept):
            self._visit(op)
        if self.non_proportional:
            largest = max(self.non_proportional, key=lambda entry: max(entry[1:]))
            level = logging.WARNING if max(largest[1:]) > 4096 else logging.INFO
            log.log(
                level,
                "%d tensors change with the batch but not in proportion (largest: %s, %d -> %d "
                "bytes); Trace.rescaled() keeps their size",
                len(self.non_proportional),
                *largest,
            )
        return self.tensors, self.ops

    def _live_ops(self) -> list[Any]:
        """Ops the function runtime keeps: reachable from outputs/control outputs, or stateful."""
        graph = self.graph
        roots = [t.op for t in graph.outputs] + list(graph.control_outputs)
        roots += [
            op for op in graph.get_operations() if op._is_stateful and op.type != "Placeholder"
        ]
        seen: set[str] = set()
        stack = list(roots)
        while stack:
            op = stack.pop()
            if op.name in seen:
                continue
            seen.add(op.name)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
        return [op for op in graph.get_operations() if op.name in seen]

    def _new_tensor(self, tensor: Any, persistent: bool, name: str) -> int | None:
        shape = _static_shape(tensor)
        nbytes = _dtype_size(tensor.dtype) * _num_elements(shape)
        self.shape_of[tensor.name] = shape
        if nbytes == 0:
            self.id_of[tensor.name] = None
            return None
        tid = len(self.tensors)
        self.tensors.append(
            TensorInfo(
                id=tid,
                bytes=nbytes,
                batch_scaled=self._batch_scaled(tensor, nbytes),
                persistent=persistent,
                name=name,
                shape=shape,
                dtype=tensor.dtype.name,
            )
        )
        self.id_of[tensor.name] = tid
        return tid

    def _new_variable(self, tensor: Any) -> None:
        variable = self.captured_variables.get(tensor.name)
        if variable is None:
            # A captured resource we cannot name: take its shape from the handle data.
            shape, dtype = self._handle_shape(tensor)
            label = self.captured[tensor.name]
        else:
            shape = tuple(int(d) for d in variable.value.shape)
            dtype = variable.value.dtype
            label = self.captured[tensor.name]
        nbytes = _dtype_size(dtype) * _num_elements(shape)
        self.shape_of[tensor.name] = shape
        if nbytes == 0:
            self.id_of[tensor.name] = None
            return
        tid = len(self.tensors)
        self.tensors.append(
            TensorInfo(tid, nbytes, False, True, label, shape=shape, dtype=dtype.name)
        )
        self.id_of[tensor.name] = tid

    def _handle_shape(self, tensor: Any) -> tuple[tuple[int, ...], Any]:
        from tensorflow.python.ops import handle_data_util

        data = handle_data_util.get_resource_handle_data(tensor)
        if not data.shape_and_type:
            raise ValueError(f"captured resource {tensor.name} carries no shape")
        entry = data.shape_and_type[0]
        shape = tuple(int(d.size) for d in entry.shape.dim)
        if any(d < 0 for d in shape):
            raise ValueError(f"captured resource {tensor.name} has a dynamic shape {shape}")
        return shape, self.tf.as_dtype(entry.dtype)

    def _visit(self, op: Any) -> None:
        if op.type == "Placeholder" and op.outputs[0].name in self.captured:
            out = op.outputs[0]
            if out.dtype.name == "resource":
                self._new_variable(out)
            else:
                self._new_tensor(out, True, self.captured[out.name])
            return
        if op.type == "Const":
            self._new_tensor(op.outputs[0], True, f"const:{op.name}")
            return
        if op.type in ("If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"):
            raise ValueError(
                f"the step graph contains control flow ({op.type} {op.name}); "
                "tflms trace handles control-flow-free training steps only"
            )

        inputs = _unique(self.id_of[t.name] for t in op.inputs)
        input_shapes = [self.shape_of[t.name] for t in op.inputs]
        if op.type in ALIAS_OPS:
            for index, out in enumerate(op.outputs):
                source = op.inputs[index if op.type == "IdentityN" else 0]
                self.id_of[out.name] = self.id_of[source.name]
                self.shape_of[out.name] = (
                    _static_shape(out)
                    if out.dtype.name != "resource"
                    else self.shape_of[source.name]
                )
            self.ops.append(OpInfo(op.name, op.type, inputs, [], 0.0, 0.0))
            return

        outputs = []
        for out in op.outputs:
            if out.dtype.name == "resource":
                raise ValueError(
                    f"op {op.name} ({op.type}) creates a resource inside the step; "
                    "variables must exist before the step is traced"
                )
            tid = self._new_tensor(out, False, out.name)
            if tid is not None:
                outputs.append(tid)
        output_shapes = [self.shape_of[t.name] for t in op.outputs]
        attrs = _cost_attrs(op)
        flops = estimate_flops(op.type, input_shapes, output_shapes, attrs)
        accessed = sum(self.tensors[t].bytes for t in (*inputs, *outputs))
        self.ops.append(OpInfo(op.name, op.type, inputs, outputs, flops, float(accessed)))


def _cost_attrs(op: Any) -> dict[str, object]:
    # Only the attributes the cost model reads, and only on ops that have them: get_attr on a
    # missing attribute raises, which costs seconds over a large graph.
    if op.type == "MatMul":
        keys: tuple[str, ...] = ("transpose_a",)
    elif op.type.startswith("BatchMatMul"):
        keys = ("adj_x",)
    elif "Pool" in op.type and not op.type.endswith("V2"):
        keys = ("ksize",)
    else:
        return {}
    return {key: op.get_attr(key) for key in keys}


def _unique(ids: Iterable[int | None]) -> list[int]:
    seen: set[int] = set()
    result = []
    for tid in ids:
        if tid is not None and tid not in seen:
            seen.add(tid)
            result.append(tid)
    return result


def _num_elements(shape: Iterable[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _creation_topological_order(ops: list[Any]) -> list[Any]:
    """Kahn's algorithm that always runs the earliest-created ready op: creation order where it is
    a valid order, the nearest valid order where an op was created before one it depends on."""
    index = {op.name: i for i, op in enumerate(ops)}
    consumers: list[list[int]] = [[] for _ in ops]
    pending = [0] * len(ops)
    for i, op in enumerate(ops):
        preds = {index[t.op.name] for t in op.inputs if t.op.name in index}
        preds |= {index[c.name] for c in op.control_inputs if c.name in index}
        pending[i] = len(preds)
        for p in preds:
            consumers[p].append(i)
    ready = [i for i, n in enumerate(pending) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(ops[i])
        for c in consumers[i]:
            pending[c] -= 1
            if pending[c] == 0:
                heapq.heappush(ready, c)
    if len(order) != len(ops):
        raise ValueError("the step graph has a cycle; cannot order its ops")
    return order
