"""Transformer traces (keras-hub backbones, random weights): what the planner's transformer figures
rest on.

- a trace whose variables are handles without values is the same graph as with real variables;
- the configurations are the released models' (parameter counts);
- the traced work agrees with 6 x parameters x tokens plus attention;
- mixed precision computes in bfloat16 and keeps variables and Adam slots in float32;
- activations scale with the batch and with the sequence length.

GPT2-tiny (two layers, 1024-token vocabulary) keeps the module to about a minute on two cores.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest

from tests.test_trace import check_consistency
from tflms.trace.format import Trace

pytest.importorskip("keras_hub", reason="keras-hub is installed by `make install`")
pytestmark = pytest.mark.tf


def _trace(model: str, batch: int, size: int, **kwargs: Any) -> Trace:
    from tflms.trace.capture import trace_model

    return trace_model(model, batch, size, progress=False, **kwargs)


def _signature(trace: Trace) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    ops = [
        (o.type, tuple(o.inputs), tuple(o.outputs), o.flops, o.bytes_accessed) for o in trace.ops
    ]
    tensors = [(t.bytes, t.batch_scaled, t.persistent, t.shape, t.dtype) for t in trace.tensors]
    return ops, tensors


@pytest.fixture(scope="module")
def tiny() -> Trace:
    return _trace("GPT2-tiny", 2, 128)


def test_variables_without_storage_trace_the_same_graph(tiny: Trace) -> None:
    with_values = _trace("GPT2-tiny", 2, 128, variables_without_storage=False)
    assert _signature(tiny) == _signature(with_values)
    assert [o.name for o in tiny.ops] == [o.name for o in with_values.ops]


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_variables_without_storage_allocate_nothing() -> None:
    import keras

    from tflms.trace.transformers import build_language_model, variables_without_storage

    keras.backend.clear_session()
    before = _resident_bytes()
    with variables_without_storage():
        model = build_language_model("GPT2-355M", 64)
    grown = _resident_bytes() - before
    weights = sum(int(v.shape.num_elements()) * 4 for v in model.trainable_variables)
    assert weights > 1.4e9
    # Building the layers costs some memory of its own; the 1.4 GB of weights are not there.
    assert grown < 0.25 * weights, grown
    del model
    keras.backend.clear_session()


def test_tiny_trace_is_consistent_and_trains_with_adam(tiny: Trace) -> None:
    check_consistency(tiny)
    assert tiny.input_shape == (128,)
    assert tiny.metadata["optimizer"].startswith("Adam")
    assert tiny.metadata["batch_scaling"] == "measured"
    weights = tiny.metadata["parameters"] * 4
    persistent = sum(t.bytes for t in tiny.tensors if t.persistent)
    # Weights and Adam's two slots (the scalars captured beside them are a few KB).
    assert 3 * weights <= persistent < 3 * weights + 64 * 1024
    types = collections.Counter(o.type for o in tiny.ops)
    # Keras' Adam on TensorFlow: per trainable variable, its two slots are updated in place
    # (AssignAdd) and the weight once (AssignSub).
    variables = sum(1 for t in tiny.tensors if t.persistent and t.name.endswith("_momentum"))
    assert types["AssignSubVariableOp"] == variables > 0
    assert types["AssignAddVariableOp"] == 2 * variables
    assert types["SparseSoftmaxCrossEntropyWithLogits"] == 1


@pytest.mark.parametrize(
    "model, parameters",
    [
        # Released sizes (tied input and output embeddings).
        ("GPT2-124M", 124_439_808),
        ("GPT2-355M", 354_823_168),
        ("BERT-large", 335_141_888),
    ],
)
def test_configurations_are_the_released_models(model: str, parameters: int) -> None:
    import keras

    from tflms.trace.transformers import build_language_model, variables_without_storage

    keras.backend.clear_session()
    with variables_without_storage():
        net = build_language_model(model, 128)
    counted = sum(int(v.shape.num_elements()) for v in net.trainable_variables)
    keras.backend.clear_session()
    # BERT's pooler and the segment embedding are part of its backbone; the MLM head is not.
    assert abs(counted - parameters) / parameters < 0.005, counted


def test_traced_work_matches_six_n_tokens_plus_attention() -> None:
    from tflms.trace.transformers import TRANSFORMERS

    config = TRANSFORMERS["GPT2-124M"]
    seq = 256
    trace = _trace("GPT2-124M", 1, seq)
    params = trace.metadata["parameters"]
    d, layers = config.hidden_dim, config.num_layers
    position_table = config.max_sequence_length * d
    # Matrix products with the weights (the position table is a lookup, not a product), forward
    # and backward, plus attention scores and weighted values: 12 x layers x seq^2 x d per sample.
    expected = 6 * (params - position_table) * seq + 12 * layers * seq * seq * d
    traced = sum(o.flops for o in trace.ops)
    assert 0.95 * expected < traced < 1.15 * expected, traced / expected


def test_mixed_precision_computes_in_bfloat16_and_keeps_fp32_state(tiny: Trace) -> None:
    mixed = _trace("GPT2-tiny", 2, 128, precision="mixed")
    check_consistency(mixed)
    assert mixed.dtype == "mixed_bfloat16"
    # Variables and slots; the int64 seed states and Adam's step counter are not floating point.
    state = [t for t in mixed.tensors if t.persistent and t.name.startswith("capture:")]
    floats = [t for t in state if t.dtype != "int64"]
    assert len(floats) > 100 and all(t.dtype == "float32" for t in floats)
    activations = [t for t in mixed.tensors if t.batch_scaled]
    half = sum(t.bytes for t in activations if t.dtype == "bfloat16")
    assert half > 0.3 * sum(t.bytes for t in activations)
    fp32_bytes = sum(t.bytes for t in tiny.tensors if t.batch_scaled)
    assert sum(t.bytes for t in activations) < fp32_bytes


def test_activations_scale_with_batch_and_sequence(tiny: Trace) -> None:
    again = _trace("GPT2-tiny", 4, 128)
    assert _signature(tiny.rescaled(4)) == _signature(again)
    longer = _trace("GPT2-tiny", 2, 256)
    scaled = sum(t.bytes for t in tiny.tensors if t.batch_scaled)
    assert sum(t.bytes for t in longer.tensors if t.batch_scaled) > 2 * scaled


def test_precision_and_model_errors() -> None:
    from tflms.trace.capture import check_precision

    with pytest.raises(ValueError, match="use one of fp32, mixed"):
        check_precision("fp8")


def test_batch_scaling_is_measured_at_batch_one() -> None:
    # The planner traces at batch 1; a mask TensorFlow folds into a constant at 512 elements but
    # not at 1024 would make the graphs at batch 1 and 2 differ, and scaling fall back to a guess.
    trace = _trace("GPT2-tiny", 1, 512)
    assert trace.metadata["batch_scaling"] == "measured"
    logits = max((t for t in trace.tensors if t.batch_scaled), key=lambda t: t.bytes)
    assert logits.bytes >= 512 * 1024 * 4  # every position's logits over the vocabulary
