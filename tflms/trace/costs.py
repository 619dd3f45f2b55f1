"""Estimated work of a TensorFlow op from its static shapes: FLOPs (multiply and add count as
two) and which ops move no data at all.

The estimate is a roofline input, not a profile: convolutions and matrix products are counted
exactly, pooling per window element, and everything else as a few operations per element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Shape = Sequence[int]

# Ops whose outputs share their input's buffer in TensorFlow's runtime (no allocation, no kernel
# work): output i is input i (IdentityN) or input 0 (the others).
ALIAS_OPS = frozenset(
    {
        "Identity",
        "IdentityN",
        "StopGradient",
        "PreventGradient",
        "Reshape",
        "Squeeze",
        "ExpandDims",
        "EnsureShape",
        "ReadVariableOp",
    }
)

# Ops that only copy or rearrange data, or compute on shapes: no arithmetic.
_MOVEMENT_OPS = frozenset(
    {
        "Placeholder",
        "NoOp",
        "Const",
        "Shape",
        "ShapeN",
        "Size",
        "Rank",
        "BroadcastGradientArgs",
        "Fill",
        "ZerosLike",
        "OnesLike",
        "Tile",
        "BroadcastTo",
        "Pad",
        "PadV2",
        "MirrorPad",
        "Slice",
        "StridedSlice",
        "StridedSliceGrad",
        "ConcatV2",
        "ConcatOffset",
        "Pack",
        "Unpack",
        "Split",
        "SplitV",
        "Transpose",
        "GatherV2",
        "GatherNd",
        "Cast",
        "Range",
        "Snapshot",
        "AssignVariableOp",
        "OneHot",
        "ReverseV2",
        "DepthToSpace",
        "SpaceToDepth",
    }
)

# One operation per element of the first input. Segment sums are here too: an embedding's gradient
# adds each token's row into the (much larger, mostly untouched) table, so its work follows the
# tokens, not the table.
_REDUCTIONS = frozenset(
    {
        *("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin", "BiasAddGrad"),
        *("UnsortedSegmentSum", "SegmentSum"),
    }
)

_CONV_FORWARD = frozenset({"Conv2D", "Conv3D"})
_CONV_BACKPROP_INPUT = frozenset({"Conv2DBackpropInput", "Conv3DBackpropInputV2"})
_CONV_BACKPROP_FILTER = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2"})
_DEPTHWISE = frozenset(
    {
        "DepthwiseConv2dNative",
        "DepthwiseConv2dNativeBackpropInput",
        "DepthwiseConv2dNativeBackpropFilter",
    }
)
_POOLS = frozenset(
    {
        "MaxPool",
        "AvgPool",
        "MaxPool3D",
        "AvgPool3D",
        "MaxPoolGrad",
        "AvgPoolGrad",
        "MaxPool3DGrad",
        "AvgPool3DGrad",
        "MaxPoolGradGrad",
    }
)

# Per-element operation counts of composite kernels.
_PER_ELEMENT = {
    "Softmax": 5.0,
    "LogSoftmax": 5.0,
    "SparseSoftmaxCrossEntropyWithLogits": 6.0,
    "SoftmaxCrossEntropyWithLogits": 6.0,
    "FusedBatchNorm": 5.0,
    "FusedBatchNormV3": 5.0,
    "FusedBatchNormGrad": 8.0,
    "FusedBatchNormGradV3": 8.0,
    "Sigmoid": 4.0,
    "Tanh": 4.0,
    "Exp": 4.0,
    "Log": 4.0,
    "Erf": 4.0,
    "Rsqrt": 2.0,
    "Sqrt": 2.0,
    "SigmoidGrad": 3.0,
    "TanhGrad": 3.0,
    "RsqrtGrad": 3.0,
    "SquaredDifference": 2.0,
}


def num_elements(shape: Shape) -> int:
    return math.prod(shape)


def estimate_flops(
    op_type: str,
    input_shapes: Sequence[Shape],
    output_shapes: Sequence[Shape],
    attrs: dict[str, object],
) -> float:
    """FLOPs of one op from its static input/output shapes and the attributes it needs
    (transpose_a/transpose_b/adj_x, ksize)."""
    if op_type in ALIAS_OPS or op_type in _MOVEMENT_OPS:
        return 0.0
    out0 = num_elements(output_shapes[0]) if output_shapes else 0
    if op_type in _CONV_FORWARD:
        # output elements x (window x input channels per group), multiply-add = 2
        return 2.0 * out0 * num_elements(input_shapes[1][:-1])
    if op_type in _CONV_BACKPROP_INPUT:
        return 2.0 * num_elements(input_shapes[2]) * num_elements(input_shapes[1][:-1])
    if op_type in _CONV_BACKPROP_FILTER:
        return 2.0 * num_elements(input_shapes[2]) * num_elements(output_shapes[0][:-1])
    if op_type in _DEPTHWISE:
        if op_type == "DepthwiseConv2dNative":
            window, grad = input_shapes[1][:2], output_shapes[0]
        elif op_type == "DepthwiseConv2dNativeBackpropInput":
            window, grad = input_shapes[1][:2], input_shapes[2]
        else:
            window, grad = output_shapes[0][:2], input_shapes[2]
        return 2.0 * num_elements(grad) * num_elements(window)
    if op_type == "MatMul":
        a = input_shapes[0]
        k = a[0] if attrs.get("transpose_a") else a[1]
        return 2.0 * out0 * k
    if op_type in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        a = input_shapes[0]
        k = a[-2] if attrs.get("adj_x") else a[-1]
        return 2.0 * out0 * k
    if op_type in _POOLS:
        ksize = attrs.get("ksize")
        window = num_elements(ksize) if isinstance(ksize, (list, tuple)) else 1  # type: ignore[arg-type]
        # Gradients count the forward output's windows: input 1 has that shape (orig_output for
        # max pooling, the incoming gradient for average pooling).
        windows = num_elements(input_shapes[1]) if op_type.endswith("Grad") else out0
        return float(window * windows)
    if op_type in _REDUCTIONS:
        return float(num_elements(input_shapes[0])) if input_shapes else 0.0
    if op_type in ("AddN",):
        return float(out0 * max(len(input_shapes) - 1, 1))
    per_element = _PER_ELEMENT.get(op_type, 1.0)
    largest = max((num_elements(s) for s in (*input_shapes, *output_shapes)), default=0)
    return per_element * largest
