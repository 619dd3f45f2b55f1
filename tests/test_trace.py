"""Tests of tflms.trace: the format (no TensorFlow) and real captures with the tensorflow-cpu wheel.

The captures are small (MobileNetV2 at 32x32, the 3D U-Net at 32^3) so the module runs in about a
minute on two busy cores.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tflms.trace import cache as trace_cache
from tflms.trace.format import (
    FORMAT_VERSION,
    OpInfo,
    TensorInfo,
    Trace,
    TraceFormatError,
    load_trace,
    save_trace,
)
from tflms.trace.models import MODEL_NAMES, check_input_size, resolve_model_name

REPO = Path(__file__).resolve().parents[1]
DTYPE_SIZES = {
    "float32": 4,
    "int32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "bool": 1,
    "float64": 8,
}


# ---------------------------------------------------------------------------- hand-made traces
def small_trace() -> Trace:
    """w (persistent) -> x = input (batch-scaled) -> y = conv(x, w) -> g = grad(y, x) -> assign."""
    tensors = [
        TensorInfo(0, 400, False, True, "w"),
        TensorInfo(1, 1000, True, False, "x"),
        TensorInfo(2, 2000, True, False, "y"),
        TensorInfo(3, 400, False, False, "g"),
        TensorInfo(4, 8, False, False, "unused"),
    ]
    ops = [
        OpInfo("input", "Placeholder", [], [1], 0.0, 1000.0),
        OpInfo("conv", "Conv2D", [1, 0], [2], 1e6, 3400.0),
        OpInfo("grad", "Conv2DBackpropFilter", [1, 2], [3, 4], 1e6, 3408.0),
        OpInfo("update", "AssignSubVariableOp", [0, 3], [], 100.0, 800.0),
    ]
    return Trace("Toy", 10, (10, 10, 1), "float32", "2.21.0", tensors, ops)


def test_validate_accepts_consistent_trace() -> None:
    small_trace().validate()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.ops.insert(0, OpInfo("early", "Relu", [2], [], 0, 0)), "before any op"),
        (lambda t: t.ops[1].outputs.append(0), "persistent tensor"),
        (lambda t: t.ops[2].outputs.append(2), "produced twice"),
        (lambda t: t.ops[0].outputs.clear(), "before any op"),
        (lambda t: setattr(t.tensors[3], "id", 7), "has id 7"),
        (lambda t: setattr(t.tensors[3], "bytes", 0), "0 bytes"),
    ],
)
def test_validate_rejects_inconsistencies(mutate: object, message: str) -> None:
    trace = small_trace()
    mutate(trace)  # type: ignore[operator]
    with pytest.raises(TraceFormatError, match=message):
        trace.validate()


def test_peak_live_bytes_follows_liveness() -> None:
    trace = small_trace()
    # conv: x + y live (3000); grad: x, y, g, unused (3408); x and y die after grad.
    assert trace.live_bytes_profile() == [1000, 3000, 3408, 400]
    assert trace.peak_live_bytes() == 400 + 3408
    assert trace.persistent_bytes() == 400


def test_rescaled_scales_batch_tensors_and_work() -> None:
    trace = small_trace()
    doubled = trace.rescaled(20)
    assert doubled.batch_size == 20
    assert [t.bytes for t in doubled.tensors] == [400, 2000, 4000, 400, 8]
    # every op here touches a batch-scaled tensor, including the weight gradient
    assert [op.flops for op in doubled.ops] == [0.0, 2e6, 2e6, 100.0]
    assert doubled.ops[1].bytes_accessed == 400 + 2000 + 4000
    assert doubled.ops[2].bytes_accessed == 2000 + 4000 + 400 + 8
    assert doubled.ops[3].bytes_accessed == 800.0  # touches nothing batch-scaled
    assert doubled.metadata["rescaled_from_batch_size"] == 10
    assert trace.tensors[1].bytes == 1000, "rescaled() must not modify the original"
    back = doubled.rescaled(10)
    assert [t.bytes for t in back.tensors] == [t.bytes for t in trace.tensors]
    with pytest.raises(ValueError, match="batch_size"):
        trace.rescaled(0)


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_save_load_round_trip(tmp_path: Path, name: str) -> None:
    trace = small_trace()
    path = save_trace(trace, tmp_path / name)
    raw = path.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == name.endswith(".gz")
    data = json.loads(gzip.decompress(raw) if name.endswith(".gz") else raw)
    assert data["format"] == "tflms-trace" and data["version"] == FORMAT_VERSION
    assert load_trace(path) == trace


def test_load_rejects_other_versions_and_garbage(tmp_path: Path) -> None:
    data = small_trace().to_dict()
    data["version"] = FORMAT_VERSION + 1
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TraceFormatError, match="re-create the trace"):
        load_trace(path)
    path.write_text('{"hello": 1}')
    with pytest.raises(TraceFormatError, match="not a tflms trace"):
        load_trace(path)
    path.write_text("not json")
    with pytest.raises(TraceFormatError, match="not a JSON trace"):
        load_trace(path)


def test_model_names_and_sizes() -> None:
    assert resolve_model_name("resnet50") == "ResNet50"
    assert {"ResNet152", "DenseNet201", "NASNetLarge", "EfficientNetB7", "UNet3D"} <= set(
        MODEL_NAMES
    )
    assert check_input_size("InceptionV3", None) == 299
    with pytest.raises(ValueError, match="at least 75"):
        check_input_size("InceptionV3", 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        check_input_size("UNet3D", 36)
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model_name("AlexNet")


# Drives only this command's parser (what tflms/cli.py does for every command module), so the test
# does not depend on the other subcommands being importable.
CLI_DRIVER = """
import argparse, sys
from tflms.trace.cli import add_parsers
parser = argparse.ArgumentParser(prog="tflms")
add_parsers(parser.add_subparsers(dest="command"))
args = parser.parse_args()
sys.exit(args.func(args))
"""


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", CLI_DRIVER, "trace", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_refuses_to_overwrite(tmp_path: Path) -> None:
    existing = tmp_path / "mine.json"
    existing.write_text("precious")
    result = run_cli(
        "--model", "UNet3D", "--image-size", "16", "--output", str(existing), cwd=tmp_path
    )
    assert result.returncode == 1
    assert "--force" in result.stderr
    assert existing.read_text() == "precious"
    result = run_cli("--model", "AlexNet", cwd=tmp_path)
    assert result.returncode == 2 and "unknown model" in result.stderr


# ---------------------------------------------------------------------------- real captures
@pytest.fixture(scope="module")
def mobilenet() -> Trace:
    from tflms.trace.capture import trace_model

    return trace_model("MobileNetV2", 4, 32, progress=False)


@pytest.fixture(scope="module")
def unet() -> Trace:
    from tflms.trace.capture import trace_model

    return trace_model("UNet3D", 2, 32, progress=False)


def check_consistency(trace: Trace) -> None:
    trace.validate()
    produced: set[int] = set()
    for op in trace.ops:
        for tid in op.inputs:
            assert tid in produced or trace.tensors[tid].persistent, (op.name, tid)
        produced.update(op.outputs)
    for tensor in trace.tensors:
        assert tensor.shape is not None and tensor.dtype is not None
        assert tensor.bytes == math.prod(tensor.shape) * DTYPE_SIZES[tensor.dtype], tensor
        if tensor.batch_scaled:  # batch-major: leading dim is the batch, or batch x something
            assert tensor.shape[0] % trace.batch_size == 0, tensor
    for op in trace.ops:
        if op.outputs:
            io = sum(trace.tensors[t].bytes for t in (*op.inputs, *op.outputs))
            assert op.bytes_accessed == io, op


@pytest.mark.tf
def test_mobilenet_trace_is_consistent(mobilenet: Trace) -> None:
    check_consistency(mobilenet)
    assert mobilenet.model == "MobileNetV2" and mobilenet.input_shape == (32, 32, 3)
    assert mobilenet.tensorflow_version.startswith("2.")
    assert mobilenet.metadata["batch_scaling"] == "measured"
    images = mobilenet.ops[0]
    assert images.type == "Placeholder"
    assert mobilenet.tensors[images.outputs[0]].batch_scaled
    assert mobilenet.tensors[images.outputs[0]].bytes == 4 * 32 * 32 * 3 * 4


@pytest.mark.tf
def test_mobilenet_persistent_tensors_are_weights_and_slots(mobilenet: Trace) -> None:
    import keras

    keras.backend.clear_session()
    net = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3))
    trainable = sum(math.prod(v.shape) for v in net.trainable_variables)
    total = net.count_params()
    captured = [t for t in mobilenet.tensors if t.persistent and t.name.startswith("capture:")]
    # weights + BatchNorm statistics + one momentum per trainable weight, float32; the optimizer's
    # iteration counter (int64) and learning rate (float32)
    assert sum(t.bytes for t in captured) == 4 * (total + trainable) + 8 + 4
    assert not any(t.batch_scaled for t in captured)
    # variable reads are the variable: the first convolution reads the persistent kernel
    first_conv = next(op for op in mobilenet.ops if op.type == "Conv2D")
    kernel = mobilenet.tensors[first_conv.inputs[1]]
    assert kernel.persistent and kernel.name == "capture:Conv1/kernel"
    assert all(not op.outputs for op in mobilenet.ops if op.type == "ReadVariableOp")


@pytest.mark.tf
def test_mobilenet_step_order_and_costs(mobilenet: Trace) -> None:
    types = [op.type for op in mobilenet.ops]
    last_forward = max(i for i, t in enumerate(types) if t == "Conv2D")
    first_backward = types.index("Conv2DBackpropInput")
    # BatchNorm moving statistics are assigned in the forward pass; weights after all gradients.
    weight_updates = [i for i, op in enumerate(mobilenet.ops) if op.name.startswith("sgd/Assign")]
    last_gradient = max(i for i, t in enumerate(types) if t.endswith("BackpropFilter"))
    assert types.index("Conv2D") < last_forward < first_backward < last_gradient
    assert last_gradient < min(weight_updates)
    # the gradient with respect to the input images is pruned, as TensorFlow's runtime does
    assert types.count("Conv2DBackpropInput") == types.count("Conv2D") - 1
    assert "Const" not in types
    conv = mobilenet.ops[types.index("Conv2D")]
    # 4 x 16 x 16 x 32 outputs, 3x3x3 window, multiply-add
    assert conv.flops == 2 * 4 * 16 * 16 * 32 * 3 * 3 * 3
    matmul = mobilenet.ops[types.index("MatMul")]
    assert matmul.flops == 2 * 4 * 1280 * 1000
    assert all(
        op.flops == 0 and op.bytes_accessed == 0
        for op in mobilenet.ops
        if not op.outputs and op.type in ("ReadVariableOp", "Reshape", "Identity")
    )
    # the weights' momentum update: m = 0.9 m - lr g; w += m, on persistent tensors
    updates = [op for op in mobilenet.ops if op.type in ("AssignVariableOp", "AssignAddVariableOp")]
    assert updates and all(mobilenet.tensors[op.inputs[0]].persistent for op in updates)
    assert mobilenet.peak_live_bytes() > mobilenet.persistent_bytes() > 0


@pytest.mark.tf
def test_rescaled_matches_a_fresh_trace(unet: Trace) -> None:
    from tflms.trace.capture import trace_model

    fresh = trace_model("UNet3D", 5, 32, progress=False)
    rescaled = unet.rescaled(5)
    assert [op.name for op in fresh.ops] == [op.name for op in rescaled.ops]
    assert [(t.bytes, t.batch_scaled, t.persistent, t.shape) for t in fresh.tensors] == [
        (t.bytes, t.batch_scaled, t.persistent, t.shape) for t in rescaled.tensors
    ]
    for a, b in zip(fresh.ops, rescaled.ops, strict=True):
        assert a.inputs == b.inputs and a.outputs == b.outputs
        assert a.flops == pytest.approx(b.flops, rel=1e-9), a.name
        assert a.bytes_accessed == pytest.approx(b.bytes_accessed, rel=1e-9), a.name
    assert fresh.peak_live_bytes() == rescaled.peak_live_bytes()


@pytest.mark.tf
def test_real_trace_round_trip(mobilenet: Trace, tmp_path: Path) -> None:
    plain = save_trace(mobilenet, tmp_path / "m.json")
    packed = save_trace(mobilenet, tmp_path / "m.json.gz")
    assert packed.stat().st_size * 4 < plain.stat().st_size
    assert load_trace(plain) == mobilenet
    assert load_trace(packed) == mobilenet


@pytest.mark.tf
def test_unet3d_trace(unet: Trace) -> None:
    check_consistency(unet)
    assert unet.input_shape == (32, 32, 32, 1)
    types = [op.type for op in unet.ops]
    for op_type in ("Conv3D", "Conv3DBackpropFilterV2", "Conv3DBackpropInputV2", "MaxPool3D"):
        assert op_type in types
    conv = unet.ops[types.index("Conv3D")]
    # 2 x 32^3 voxels x 32 filters, 3x3x3x1 window
    assert conv.flops == 2 * 2 * 32**3 * 32 * 27
    labels = [t for t in unet.tensors if t.name.startswith("labels")]
    assert labels and labels[0].bytes == 2 * 32**3 * 4 and labels[0].batch_scaled
    # per-voxel cross-entropy flattens batch and voxels into one batch-major dimension
    assert any(t.batch_scaled and t.shape == (2 * 32**3,) for t in unet.tensors)


@pytest.mark.tf
def test_cached_trace_traces_once_then_rescales(
    mobilenet: Trace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tflms.trace import capture

    monkeypatch.setenv("TFLMS_CACHE_DIR", str(tmp_path))
    calls: list[tuple[str, int]] = []

    def fake_trace(
        model: str,
        batch: int,
        size: int | None = None,
        progress: bool = True,
        precision: str = "fp32",
    ) -> Trace:
        calls.append((model, batch))
        return mobilenet

    # Stand-in for the capture (already exercised above) so this test checks the cache only.
    monkeypatch.setattr(capture, "trace_model", fake_trace)
    first = trace_cache.cached_trace("MobileNetV2", 4, 32)
    assert first is mobilenet and calls == [("MobileNetV2", 4)]
    path = trace_cache.cache_path("MobileNetV2", 32)
    assert path.parent == tmp_path and path.exists()
    second = trace_cache.cached_trace("mobilenetv2", 16, 32)
    assert calls == [("MobileNetV2", 4)], "a cached model must not be traced again"
    assert second.batch_size == 16
    images = mobilenet.ops[0].outputs[0]
    assert second.tensors[images].bytes == 4 * mobilenet.tensors[images].bytes
    path.write_bytes(b"\x1f\x8bgarbage")
    trace_cache.cached_trace("MobileNetV2", 4, 32)
    assert len(calls) == 2, "a corrupt cache file is replaced by a new trace"


@pytest.mark.tf
def test_cli_writes_trace_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "unet.json.gz"
    result = run_cli(
        "--model",
        "unet3d",
        "--batch-size",
        "2",
        "--image-size",
        "16",
        "--output",
        str(out),
        "--no-progress",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    trace = load_trace(out)
    assert trace.model == "UNet3D" and trace.batch_size == 2
    for key in ("ops:", "tensors:", "persistent bytes:", "peak live bytes:"):
        assert key in result.stdout
    assert str(trace.peak_live_bytes()) in result.stdout
    again = run_cli("--model", "unet3d", "--image-size", "16", "--output", str(out), cwd=tmp_path)
    assert again.returncode == 1
    # Without --batch-size a 3D U-Net is traced on one volume, as it trains.
    one = run_cli("--model", "unet3d", "--image-size", "16", "--no-progress", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith("UNet3D, batch 1, input 16x16x16x1")
    assert load_trace(tmp_path / "UNet3D-b1-s16.trace.json.gz").batch_size == 1


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_every_model_traces(model: str) -> None:
    from tflms.trace.capture import trace_model
    from tflms.trace.models import MODEL_SPECS

    spec = MODEL_SPECS[model]
    size = max(spec.min_size, 32)
    size += -size % spec.size_multiple
    trace = trace_model(model, 2, size, progress=False)
    check_consistency(trace)
    assert trace.metadata["batch_scaling"] == "measured"
