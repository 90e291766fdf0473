"""The forms each operator of the table is proven in (`operator_cases.Case`): odd and even sizes,
padding, strides, dilations, groups, negative axes, broadcasting, 1-D and 2-D — the attribute forms
PyTorch's exporters write for `torch.nn`'s layers and functional ops."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from operator_cases import Case, Const, Data, Param

I64 = np.int64


def ints(*values: int) -> Const:
    return Const(np.array(values, I64))


def floats(*values: float) -> Const:
    return Const(np.array(values, np.float32))


def scalar(value: float) -> Const:
    return Const(np.array(value, np.float32))


POSITIVE = {"low": 0.5, "high": 2.0}

CONVOLUTIONS = [
    Case("Conv", "2-D 3x3 pad 1 odd", (Data((2, 3, 7, 7)), Param((4, 3, 3, 3)), Param((4,))), {"pads": [1, 1, 1, 1]}),
    Case(
        "Conv",
        "2-D dilation 2 stride 2 even",
        (Data((2, 3, 8, 8)), Param((4, 3, 3, 3))),
        {"dilations": [2, 2], "strides": [2, 2], "pads": [2, 1, 2, 1]},
    ),
    Case("Conv", "1-D dilation 3 causal", (Data((2, 3, 11)), Param((4, 3, 3)), Param((4,))), {"dilations": [3], "pads": [6, 0]}),
    Case(
        "Conv",
        "1-D grouped stride 2",
        (Data((2, 4, 9)), Param((6, 2, 3)), Param((6,))),
        {"group": 2, "strides": [2], "pads": [1, 1]},
    ),
    Case(
        "Conv",
        "2-D SAME_UPPER stride 2 odd",
        (Data((2, 2, 7, 7)), Param((3, 2, 3, 3))),
        {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
    ),
    Case(
        "Conv",
        "2-D SAME_LOWER dilation 2",
        (Data((2, 2, 6, 5)), Param((3, 2, 3, 2))),
        {"auto_pad": "SAME_LOWER", "dilations": [2, 2]},
    ),
    Case(
        "Conv",
        "2-D depthwise 5x5 stride 2 asymmetric pads",
        (Data((2, 4, 9, 8)), Param((4, 1, 5, 5)), Param((4,))),
        {"group": 4, "strides": [2, 2], "pads": [2, 1, 1, 2]},
    ),
    Case(
        "Conv", "2-D stride 3 unread rows", (Data((2, 2, 8, 8)), Param((3, 2, 3, 3))), {"strides": [3, 3], "pads": [1, 1, 1, 1]}
    ),
    Case(
        "Conv",
        "1-D VALID dilation 2 stride 2",
        (Data((2, 3, 12)), Param((2, 3, 2))),
        {"auto_pad": "VALID", "dilations": [2], "strides": [2]},
    ),
    Case(
        "ConvTranspose",
        "2-D stride 2 pad 1 output padding 1 odd",
        (Data((2, 3, 5, 5)), Param((3, 2, 3, 3)), Param((2,))),
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
    ),
    Case(
        "ConvTranspose",
        "2-D dilation 2",
        (Data((2, 4, 4, 5)), Param((4, 3, 3, 3)), Param((3,))),
        {"dilations": [2, 2], "pads": [1, 0, 1, 0]},
    ),
    Case("ConvTranspose", "2-D stride 2 even no bias", (Data((2, 2, 4, 4)), Param((2, 3, 2, 2))), {"strides": [2, 2]}),
    Case(
        "ConvTranspose",
        "2-D groups 2 stride 2",
        (Data((2, 4, 3, 4)), Param((4, 3, 3, 3)), Param((6,))),
        {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0]},
    ),
    Case(
        "ConvTranspose", "1-D stride 3 pad 1", (Data((2, 3, 6)), Param((3, 2, 4)), Param((2,))), {"strides": [3], "pads": [1, 1]}
    ),
    Case(
        "ConvTranspose",
        "1-D stride 2 dilation 2 output padding 1",
        (Data((2, 2, 7)), Param((2, 3, 3))),
        {"strides": [2], "dilations": [2], "output_padding": [1]},
    ),
    Case("Gemm", "transB with bias", (Data((3, 5)), Param((4, 5)), Param((4,))), {"transB": 1}),
    Case("Gemm", "alpha beta row bias", (Data((2, 5)), Param((5, 3)), Param((1, 3))), {"alpha": 0.5, "beta": 2.0}),
    Case("MatMul", "3-D by a weight", (Data((2, 3, 4)), Param((4, 5)))),
    Case("MatMul", "batched data by data", (Data((2, 2, 3, 4)), Data((2, 2, 4, 5)))),
    Case("MatMul", "broadcast weight batch", (Data((2, 3, 3, 4)), Param((3, 4, 2)))),
    Case("Einsum", "matmul-like with a weight", (Data((2, 3, 4)), Param((4, 5))), {"equation": "bij,jk->bik"}),
    Case("Einsum", "attention scores", (Data((2, 2, 3, 4)), Data((2, 2, 5, 4))), {"equation": "bhid,bhjd->bhij"}),
    Case("Einsum", "ellipsis and a summed index", (Data((2, 3, 4)), Param((4, 2))), {"equation": "...ij,jk->...k"}),
    Case("Einsum", "implicit output", (Data((2, 3)), Param((3, 4))), {"equation": "ij,jk"}),
    Case("Einsum", "relative position bias", (Data((2, 3, 4)), Param((3, 5, 4))), {"equation": "bld,lrd->blr"}),
    Case("Einsum", "a diagonal (frozen)", (Data((2, 3, 3)),), {"equation": "bii->bi"}),
]

ACTIVATIONS = [
    Case("Relu", "4-D", (Data((2, 3, 4, 5)),)),
    Case("LeakyRelu", "alpha 0.1", (Data((2, 3, 5)),), {"alpha": 0.1}),
    Case("LeakyRelu", "alpha 1.7", (Data((3, 7)),), {"alpha": 1.7}),
    Case("PRelu", "per-channel slope", (Data((2, 3, 4, 5)), Param((3, 1, 1)))),
    Case("PRelu", "one slope", (Data((2, 6)), Param((1,)))),
    Case("Elu", "alpha 0.7", (Data((2, 3, 5)),), {"alpha": 0.7}),
    Case("Selu", "default", (Data((2, 9)),)),
    Case("Celu", "alpha 1.5", (Data((2, 9)),), {"alpha": 1.5}, opset=20),
    Case("Gelu", "exact", (Data((2, 9)),)),
    Case("Gelu", "tanh", (Data((2, 3, 5)),), {"approximate": "tanh"}),
    Case("Sigmoid", "2-D", (Data((2, 7)),)),
    Case("HardSigmoid", "alpha 0.3 beta 0.4", (Data((2, 3, 5), low=-4, high=4),), {"alpha": 0.3, "beta": 0.4}),
    Case("HardSwish", "wide range", (Data((2, 3, 5), low=-5, high=5),)),
    Case("Tanh", "2-D", (Data((2, 7)),)),
    Case("Softplus", "2-D", (Data((2, 7), low=-3, high=3),)),
    Case("Softsign", "2-D", (Data((2, 7)),)),
    Case("Mish", "2-D", (Data((2, 7), low=-3, high=3),)),
    Case("ThresholdedRelu", "alpha 0.2", (Data((2, 7)),), {"alpha": 0.2}),
    Case("Shrink", "soft", (Data((2, 7)),), {"lambd": 0.5, "bias": 0.5}),
    Case("Shrink", "hard", (Data((2, 7)),), {"lambd": 0.5}),
    Case("Softmax", "axis -1", (Data((2, 3, 5)),), {"axis": -1}),
    Case("Softmax", "axis 1", (Data((2, 4, 3)),), {"axis": 1}),
    Case("LogSoftmax", "axis -1", (Data((2, 3, 5)),), {"axis": -1}),
    Case("Hardmax", "axis -1 (frozen)", (Data((2, 3, 5)),), {"axis": -1}),
]

NORMALIZATIONS = [
    Case(
        "BatchNormalization",
        "2-D eval",
        (Data((2, 3, 4, 5)), Param((3,)), Param((3,)), floats(0.1, -0.2, 0.3), floats(0.5, 1.5, 2.0)),
        {"epsilon": 1e-3},
    ),
    Case("BatchNormalization", "1-D eval", (Data((3, 4, 5)), Param((4,)), Param((4,)), floats(0, 1, 2, 3), floats(1, 2, 3, 4))),
    Case(
        "LayerNormalization",
        "last axis",
        (Data((2, 3, 6)), Param((6,)), Param((6,))),
        {"axis": -1, "epsilon": 1e-5},
        float32=True,
    ),
    Case("LayerNormalization", "two trailing axes no bias", (Data((2, 3, 4, 5)), Param((4, 5))), {"axis": -2}, float32=True),
    Case("InstanceNormalization", "1-D", (Data((2, 3, 7)), Param((3,)), Param((3,))), {"epsilon": 1e-5}),
    Case("InstanceNormalization", "2-D", (Data((2, 4, 3, 5)), Param((4,)), Param((4,)))),
    Case(
        "GroupNormalization",
        "opset 21",
        (Data((2, 6, 5)), Param((6,)), Param((6,))),
        {"num_groups": 3, "epsilon": 1e-5},
        opset=21,
    ),
    Case("GroupNormalization", "opset 21 2-D", (Data((2, 4, 3, 3)), Param((4,)), Param((4,))), {"num_groups": 2}, opset=21),
    Case("RMSNormalization", "last axis", (Data((2, 3, 6)), Param((6,))), {"axis": -1, "epsilon": 1e-5}, opset=23),
    Case("LRN", "size 3 (frozen)", (Data((2, 5, 3, 3)),), {"size": 3}),
]

POOLS = [
    Case(
        "MaxPool",
        "2-D 3x3 stride 2 pad 1 odd",
        (Data((2, 3, 7, 7)),),
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    ),
    Case("MaxPool", "2-D ceil mode even", (Data((2, 2, 8, 8)),), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    Case("MaxPool", "2-D dilation 2", (Data((2, 2, 9, 8)),), {"kernel_shape": [3, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1]}),
    Case("MaxPool", "1-D k3 stride 2", (Data((2, 3, 11)),), {"kernel_shape": [3], "strides": [2]}),
    Case("MaxPool", "1-D pad 1 stride 2", (Data((2, 3, 10)),), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    Case(
        "MaxPool",
        "1-D ceil dilation 2",
        (Data((2, 2, 12)),),
        {"kernel_shape": [2], "strides": [3], "dilations": [2], "ceil_mode": 1},
    ),
    Case(
        "AveragePool",
        "2-D pad excluded",
        (Data((2, 3, 7, 7)),),
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    ),
    Case(
        "AveragePool",
        "2-D pad included",
        (Data((2, 2, 6, 6)),),
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
    ),
    Case("AveragePool", "2-D ceil mode", (Data((2, 2, 7, 7)),), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    Case("AveragePool", "1-D k3 stride 2", (Data((2, 3, 10)),), {"kernel_shape": [3], "strides": [2]}),
    Case(
        "AveragePool",
        "2-D ceil mode counting the padding",
        (Data((2, 3, 9, 9)),),
        {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1, "count_include_pad": 1},
    ),
    Case(
        "AveragePool",
        "1-D ceil mode, pad 1, counting it",
        (Data((2, 3, 16)),),
        {"kernel_shape": [3], "strides": [2], "pads": [1, 1], "ceil_mode": 1, "count_include_pad": 1},
    ),
    Case(
        "AveragePool", "1-D pad 1 ceil", (Data((2, 3, 9)),), {"kernel_shape": [4], "strides": [2], "pads": [1, 1], "ceil_mode": 1}
    ),
    Case("GlobalAveragePool", "2-D", (Data((2, 3, 4, 5)),)),
    Case("GlobalAveragePool", "1-D", (Data((2, 3, 7)),)),
    Case("GlobalMaxPool", "2-D", (Data((2, 3, 4, 5)),)),
    Case(
        "Resize",
        "nearest x2 asymmetric",
        (Data((2, 2, 3, 4)), None, floats(1, 1, 2, 2)),
        {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
    ),
    Case("Resize", "nearest to odd sizes", (Data((2, 2, 3, 4)), None, None, ints(2, 2, 7, 5)), {"mode": "nearest"}),
    Case(
        "Resize",
        "linear pytorch half pixel",
        (Data((2, 2, 3, 4)), None, floats(1, 1, 2, 1.5)),
        {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
    ),
    Case(
        "Resize",
        "linear align corners",
        (Data((2, 2, 4, 3)), None, None, ints(2, 2, 7, 6)),
        {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
    ),
    Case("Resize", "cubic half pixel", (Data((2, 1, 4, 4)), None, floats(1, 1, 2, 2)), {"mode": "cubic", "cubic_coeff_a": -0.75}),
    Case("Resize", "linear 1-D downsample", (Data((2, 3, 9)), None, None, ints(2, 3, 4)), {"mode": "linear"}),
    Case("DepthToSpace", "CRD", (Data((2, 8, 2, 3)),), {"blocksize": 2, "mode": "CRD"}),
    Case("DepthToSpace", "DCR", (Data((2, 8, 3, 2)),), {"blocksize": 2, "mode": "DCR"}),
    Case("SpaceToDepth", "block 2", (Data((2, 2, 4, 6)),), {"blocksize": 2}),
]

ELEMENTWISE = [
    Case("Add", "broadcast bias", (Data((2, 3, 4)), Param((3, 1)))),
    Case("Add", "data and data", (Data((2, 5)), Data((2, 5)))),
    Case("Sub", "weight minus data", (Param((1, 5)), Data((2, 5)))),
    Case("Mul", "broadcast scale", (Data((2, 3, 4)), Param((4,)))),
    Case("Mul", "data and data", (Data((2, 5)), Data((2, 5)))),
    Case("Div", "by a weight", (Data((2, 5)), Param((5,), **POSITIVE))),
    Case("Div", "weight by data", (Param((1, 5)), Data((2, 5), **POSITIVE))),
    Case("Neg", "2-D", (Data((2, 5)),)),
    Case("Abs", "2-D", (Data((2, 5)),)),
    Case("Reciprocal", "positive", (Data((2, 5), **POSITIVE),)),
    Case("Sqrt", "positive", (Data((2, 5), **POSITIVE),)),
    Case("Pow", "square", (Data((2, 5)), scalar(2.0))),
    Case("Pow", "cube", (Data((2, 5)), scalar(3.0))),
    Case("Pow", "square root", (Data((2, 5), **POSITIVE), scalar(0.5))),
    Case("Pow", "computed exponent", (Data((2, 5), **POSITIVE), Data((2, 5)))),
    Case("Pow", "a weight as the exponent", (Data((2, 5), **POSITIVE), Param((5,)))),
    Case("Pow", "an integer exponent", (Data((2, 5)), Const(np.array(3, I64)))),
    Case("Exp", "2-D", (Data((2, 5)),)),
    Case("Log", "positive", (Data((2, 5), **POSITIVE),)),
    Case("Erf", "2-D", (Data((2, 5)),)),
    Case("Sin", "2-D", (Data((2, 5), low=-3, high=3),)),
    Case("Cos", "2-D", (Data((2, 5), low=-3, high=3),)),
    Case("Max", "three inputs broadcast", (Data((2, 5)), Param((5,)), Data((2, 5)))),
    Case("Max", "clamp below by a tensor", (Data((2, 3, 4)), Param((3, 1)))),
    Case("Min", "two inputs", (Data((2, 5)), Data((2, 5)))),
    Case("Sum", "three inputs", (Data((2, 5)), Param((5,)), Data((2, 5)))),
    Case("Mean", "two inputs broadcast", (Data((2, 3, 4)), Param((1, 4)))),
    Case("Clip", "both bounds", (Data((2, 5), low=-3, high=3), scalar(-1.0), scalar(1.0))),
    Case("Clip", "lower bound only", (Data((2, 5)), scalar(0.2))),
    Case("Where", "mask, data and weight", (Data((2, 5), dtype="bool"), Data((2, 5)), Param((5,)))),
    Case("Where", "fill with -inf before a softmax", (Data((2, 5), dtype="bool"), Data((2, 5)), scalar(-1e3))),
    Case("Cast", "to double and back", (Data((2, 5)),), {"to": 11}),
    Case("Cast", "float to float", (Data((2, 5)),), {"to": 1}),
    Case("CastLike", "like a float", (Data((2, 5)), scalar(0.0))),
    Case("Identity", "2-D", (Data((2, 5)),)),
    Case("Dropout", "eval", (Data((2, 5)),), {}),
    Case("Floor", "2-D", (Data((2, 5), low=-3, high=3),)),
    Case("Floor", "3-D", (Data((2, 3, 4), low=-3, high=3),)),
    Case("Ceil", "2-D", (Data((2, 5), low=-3, high=3),)),
    Case("Round", "2-D", (Data((2, 5), low=-3, high=3),)),
    Case("Sign", "2-D", (Data((2, 5)),)),
    Case("Tan", "2-D", (Data((2, 5), low=-1.2, high=1.2),)),
    Case("Asin", "2-D", (Data((2, 5), low=-0.9, high=0.9),)),
    Case("Acos", "2-D", (Data((2, 5), low=-0.9, high=0.9),)),
    Case("Atan", "2-D", (Data((2, 5), low=-3, high=3),)),
    Case("Sinh", "2-D", (Data((2, 5)),)),
    Case("Cosh", "2-D", (Data((2, 5)),)),
    Case("Asinh", "2-D", (Data((2, 5), low=-3, high=3),)),
    Case("Acosh", "2-D", (Data((2, 5), low=1.2, high=3),)),
    Case("Atanh", "2-D", (Data((2, 5), low=-0.9, high=0.9),)),
]

REDUCTIONS = [
    Case("ReduceMean", "axis 1 dropped", (Data((2, 3, 4)), ints(1)), {"keepdims": 0}),
    Case("ReduceMean", "last axis kept", (Data((2, 3, 4)), ints(-1)), {"keepdims": 1}),
    Case("ReduceSum", "two axes", (Data((2, 3, 4, 2)), ints(1, 2)), {"keepdims": 0}),
    Case("ReduceSum", "negative axis kept", (Data((2, 3, 5)), ints(-2)), {"keepdims": 1}),
    Case("ReduceMax", "last axis", (Data((2, 3, 5)), ints(-1)), {"keepdims": 0}),
    Case("ReduceMax", "axis 1 kept", (Data((2, 4, 3)), ints(1)), {"keepdims": 1}),
    Case("ReduceMin", "last axis", (Data((2, 3, 5)), ints(2)), {"keepdims": 0}),
    Case("ReduceL2", "last axis kept", (Data((2, 3, 5)), ints(-1)), {"keepdims": 1}),
    Case("ReduceL1", "axis 1", (Data((2, 3, 5)), ints(1)), {"keepdims": 0}),
    Case("ReduceSumSquare", "axis 1", (Data((2, 3, 5)), ints(1)), {"keepdims": 0}),
    Case("ReduceLogSumExp", "last axis", (Data((2, 3, 5)), ints(-1)), {"keepdims": 0}),
    Case("ReduceLogSum", "last axis positive", (Data((2, 3, 5), **POSITIVE), ints(-1)), {"keepdims": 1}),
    Case("ReduceProd", "(frozen)", (Data((2, 3, 5)), ints(-1)), {"keepdims": 0}),
    Case("CumSum", "axis 1", (Data((2, 5, 3)), Const(np.array(1, I64)))),
    Case("CumSum", "exclusive reversed last axis", (Data((2, 3, 5)), Const(np.array(-1, I64))), {"exclusive": 1, "reverse": 1}),
    Case("CumSum", "reversed", (Data((2, 6)), Const(np.array(1, I64))), {"reverse": 1}),
    Case("TopK", "largest 2 of the last axis", (Data((2, 3, 6)), ints(2)), {"axis": -1}, outputs=2),
    Case("TopK", "smallest 3 of axis 1", (Data((2, 5, 2)), ints(3)), {"axis": 1, "largest": 0}, outputs=2),
    Case("TopK", "unsorted", (Data((2, 3, 6)), ints(2)), {"axis": -1, "sorted": 0}, outputs=2),
    Case("ArgMax", "(frozen)", (Data((2, 3, 5)),), {"axis": -1, "keepdims": 0}),
    Case("ArgMin", "(frozen)", (Data((2, 3, 5)),), {"axis": 1, "keepdims": 1}),
]

SHAPES = [
    Case("Reshape", "with -1 and 0", (Data((2, 3, 4)), ints(0, -1, 2))),
    Case("Flatten", "axis 1 of 4-D", (Data((2, 3, 4, 2)),), {"axis": 1}),
    Case("Transpose", "permuted", (Data((2, 3, 4, 5)),), {"perm": [0, 2, 3, 1]}),
    Case("Squeeze", "axis 2", (Data((2, 3, 1, 4)), ints(2))),
    Case("Unsqueeze", "axes 1 and -1", (Data((2, 3)), ints(1, -1))),
    Case("Expand", "data over an axis", (Data((2, 1, 3)), ints(2, 4, 3))),
    Case("Expand", "the last axis, with a new leading one", (Data((2, 3, 1)), ints(2, 2, 3, 4))),
    Case("Concat", "data and data axis 1", (Data((2, 2, 3)), Data((2, 3, 3))), {"axis": 1}),
    Case("Concat", "negative axis", (Data((2, 3, 2)), Data((2, 3, 1))), {"axis": -1}),
    Case("Split", "two halves", (Data((2, 6, 3)), ints(2, 4)), {"axis": 1}, outputs=2),
    Case("Split", "equal thirds last axis", (Data((2, 3, 6)),), {"axis": -1, "num_outputs": 3}, opset=18, outputs=3),
    Case("Slice", "step 2 even", (Data((2, 3, 8)), ints(1), ints(8), ints(2), ints(2))),
    Case("Slice", "flip", (Data((2, 3, 5)), ints(-1), ints(-6), ints(-1), ints(-1))),
    Case("Slice", "reversed step 2 from the middle", (Data((2, 9)), ints(6), ints(0), ints(1), ints(-2))),
    Case("Slice", "two axes negative indices", (Data((2, 5, 6)), ints(1, -4), ints(-1, 100), ints(1, 2))),
    Case("Gather", "a column", (Data((2, 4, 3)), Const(np.array(2, I64))), {"axis": 1}),
    Case("Gather", "rows with repeats", (Data((2, 5, 3)), ints(0, 3, 3, 1)), {"axis": 1}),
    Case("Gather", "an embedding table", (Param((6, 3)), Data((2, 4), low=0, high=6, dtype="int64")), {"axis": 0}),
    Case("GatherND", "last token", (Data((2, 4, 3)), Const(np.array([[0, 3], [1, 1]], I64)))),
    Case("GatherND", "batch dims 1 (frozen)", (Data((2, 4, 3)), Const(np.array([[1], [2]], I64))), {"batch_dims": 1}),
    Case(
        "GatherElements",
        "axis 1 with repeats",
        (Data((2, 4, 3)), Const(np.array([[[0, 1, 3], [3, 3, 0]], [[2, 2, 2], [1, 0, 3]]], I64))),
        {"axis": 1},
    ),
    Case(
        "GatherElements",
        "relative positions last axis",
        (Data((2, 3, 5)), Const(np.tile(np.array([[2, 1, 0], [3, 2, 1], [4, 3, 2]], I64), (2, 1, 1)))),
        {"axis": 2},
    ),
    Case("ScatterElements", "(frozen)", (Data((2, 4)), Const(np.array([[1, 0], [3, 2]], I64)), Data((2, 2))), {"axis": 1}),
    Case("ScatterND", "(frozen)", (Data((2, 4, 3)), Const(np.array([[0, 1], [1, 3]], I64)), Data((2, 3)))),
    Case("Tile", "2-D reps", (Data((2, 3, 2)), ints(1, 2, 3))),
    Case("Tile", "last axis of 2-D", (Data((2, 3)), ints(1, 3))),
    Case("Pad", "constant 1-D causal", (Data((2, 3, 6)), ints(0, 0, 2, 0, 0, 0))),
    Case("Pad", "constant value 2-D", (Data((2, 2, 3, 4)), ints(0, 0, 1, 0, 0, 0, 2, 1), scalar(0.5))),
    Case("Pad", "reflect 2-D", (Data((2, 2, 5, 4)), ints(0, 0, 1, 2, 0, 0, 2, 1)), {"mode": "reflect"}),
    Case("Pad", "edge 1-D", (Data((2, 3, 4)), ints(0, 0, 3, 0, 0, 2)), {"mode": "edge"}),
    Case("Pad", "wrap 2-D", (Data((2, 2, 4, 5)), ints(0, 0, 1, 2, 0, 0, 3, 1)), {"mode": "wrap"}, opset=19),
    Case("Pad", "axes input", (Data((2, 3, 5)), ints(2, 1), None, ints(-1)), {"mode": "reflect"}, opset=18),
    Case("Pad", "negative widths crop", (Data((2, 3, 7, 6)), ints(0, 0, -2, 1, 0, 0, 1, -1))),
    Case("Trilu", "upper k 1", (Data((2, 4, 4)), Const(np.array(1, I64))), {"upper": 1}),
    Case("Trilu", "lower k -1 wide", (Data((2, 3, 5)), Const(np.array(-1, I64))), {"upper": 0}),
    Case("Equal", "(frozen)", (Data((2, 5), low=0, high=3, dtype="int64"), Data((2, 5), low=0, high=3, dtype="int64"))),
    Case("Less", "(frozen)", (Data((2, 5)), Data((2, 5)))),
    Case("LessOrEqual", "(frozen)", (Data((2, 5)), Param((5,)))),
    Case("Greater", "(frozen)", (Data((2, 5)), Data((2, 5)))),
    Case("GreaterOrEqual", "(frozen)", (Data((2, 5)), scalar(0.0))),
    Case("And", "(frozen)", (Data((2, 5), dtype="bool"), Data((2, 5), dtype="bool"))),
    Case("Or", "(frozen)", (Data((2, 5), dtype="bool"), Data((2, 5), dtype="bool"))),
    Case("Xor", "(frozen)", (Data((2, 5), dtype="bool"), Data((2, 5), dtype="bool"))),
    Case("Not", "(frozen)", (Data((2, 5), dtype="bool"),)),
    Case("IsNaN", "(frozen)", (Data((2, 5)),)),
    Case("IsInf", "(frozen)", (Data((2, 5)),)),
    Case("Mod", "integers", (Data((2, 5), low=0, high=9, dtype="int64"), Const(np.array(4, I64)))),
    Case("Mod", "floats, floored (remainder)", (Data((2, 5), low=-3, high=3), scalar(0.7))),
    Case("Mod", "floats, truncated (fmod)", (Data((2, 5), low=-3, high=3), scalar(0.7)), {"fmod": 1}),
    Case("OneHot", "(frozen)", (Data((2, 3), low=0, high=4, dtype="int64"), Const(np.array(4, I64)), floats(0, 1))),
]

RECURRENT = [
    Case(
        "GRU",
        "batch first, linear before reset",
        (Data((2, 4, 3)), Param((1, 15, 3)), Param((1, 15, 5)), Param((1, 30))),
        {"hidden_size": 5, "layout": 1, "linear_before_reset": 1},
    ),
    Case(
        "LSTM",
        "batch first",
        (Data((2, 3, 3)), Param((1, 16, 3)), Param((1, 16, 4)), Param((1, 32))),
        {"hidden_size": 4, "layout": 1},
    ),
    Case(
        "RNN",
        "bidirectional batch first",
        (Data((2, 3, 2)), Param((2, 3, 2)), Param((2, 3, 3)), Param((2, 6))),
        {"hidden_size": 3, "layout": 1, "direction": "bidirectional"},
    ),
]

RECURRENT += [
    Case(
        "GRU",
        "bidirectional",
        (Data((2, 3, 3)), Param((2, 12, 3)), Param((2, 12, 4)), Param((2, 24))),
        {"hidden_size": 4, "layout": 1, "direction": "bidirectional"},
    ),
    Case(
        "LSTM",
        "bidirectional",
        (Data((2, 4, 2)), Param((2, 12, 2)), Param((2, 12, 3)), Param((2, 24))),
        {"hidden_size": 3, "layout": 1, "direction": "bidirectional"},
    ),
    Case(
        "RNN",
        "Relu activation",
        (Data((2, 4, 3)), Param((1, 4, 3)), Param((1, 4, 4)), Param((1, 8))),
        {"hidden_size": 4, "layout": 1, "activations": ["Relu"]},
    ),
]

# A second shape for each elementwise operator proven in one: rank 4, odd sizes, the same range.
_ELEMENTWISE_OPS = (
    "Abs Acos Acosh Asin Asinh Atan Atanh Ceil Celu Cos Dropout Elu Erf Exp HardSigmoid HardSwish Identity Log Mish Neg "
    "Reciprocal Relu Round Selu Sigmoid Sign Sin Sinh Cosh Softplus Softsign Sqrt Tan Tanh ThresholdedRelu"
).split()
_FIRST = {c.op: c for c in reversed([*ACTIVATIONS, *ELEMENTWISE])}
SECOND_SHAPES = [
    replace(_FIRST[op], form="4-D odd sizes", inputs=(replace(_FIRST[op].inputs[0], shape=(3, 2, 3, 5)), *_FIRST[op].inputs[1:]))
    for op in _ELEMENTWISE_OPS
]
MORE_FORMS = [
    Case("CastLike", "like a double", (Data((3, 2, 5)), Const(np.array(0.0, np.float64)))),
    Case("Flatten", "negative axis", (Data((2, 3, 4, 2)),), {"axis": -3}),
    Case("GatherND", "whole rows, reordered", (Data((2, 4, 3)), Const(np.array([[1], [0]], I64)))),
    Case("GlobalMaxPool", "1-D", (Data((2, 3, 7)),)),
    Case("LogSoftmax", "axis 1", (Data((2, 4, 3)),), {"axis": 1}),
    Case("SoftmaxCrossEntropyLoss", "per sample", (Data((3, 4)), Const(np.array([1, 0, 3], I64))), {"reduction": "none"}),
    Case(
        "SoftmaxCrossEntropyLoss",
        "per token, padding ignored",
        (Data((2, 4, 3)), Const(np.array([[1, -100, 0], [3, 2, -100]], I64))),
        {"reduction": "none", "ignore_index": -100},
    ),
    Case("SoftmaxCrossEntropyLoss", "mean", (Data((3, 4)), Const(np.array([2, 0, 3], I64))), scalar=True),
    Case(
        "SoftmaxCrossEntropyLoss",
        "mean over the counted, log-probabilities out",
        (Data((3, 4)), Const(np.array([2, -1, 3], I64))),
        {"ignore_index": -1},
        outputs=2,
        scalar=True,
    ),
    Case(
        "NegativeLogLikelihoodLoss",
        "per sample",
        (Data((3, 4), low=-3.0, high=-0.1), Const(np.array([1, 0, 3], I64))),
        {"reduction": "none"},
    ),
    Case(
        "NegativeLogLikelihoodLoss",
        "sum",
        (Data((3, 4), low=-3.0, high=-0.1), Const(np.array([1, 2, 3], I64))),
        {"reduction": "sum"},
        scalar=True,
    ),
    Case("Mean", "three inputs", (Data((2, 5)), Data((2, 5)), Param((5,)))),
    Case("Min", "broadcast weight", (Data((2, 3, 4)), Param((3, 1)))),
    Case("Sub", "data minus broadcast data", (Data((2, 3, 4)), Data((2, 1, 4)))),
    Case("Sum", "two inputs broadcast", (Data((2, 3, 4)), Param((4,)))),
    Case("RMSNormalization", "two trailing axes", (Data((2, 3, 4, 5)), Param((4, 5))), {"axis": -2}, opset=23),
    Case("ReduceL1", "last axis kept", (Data((2, 4, 3)), ints(-1)), {"keepdims": 1}),
    Case("ReduceL2", "two axes", (Data((2, 3, 4, 2)), ints(1, 3)), {"keepdims": 0}),
    Case("ReduceLogSum", "axis 1", (Data((2, 3, 5), **POSITIVE), ints(1)), {"keepdims": 0}),
    Case("ReduceLogSumExp", "two axes kept", (Data((2, 3, 4, 2)), ints(2, 3)), {"keepdims": 1}),
    Case("ReduceMin", "axis 1 kept", (Data((2, 4, 3)), ints(1)), {"keepdims": 1}),
    Case("ReduceSumSquare", "last two axes", (Data((2, 3, 4, 2)), ints(-2, -1)), {"keepdims": 1}),
    Case("Reshape", "to 4-D", (Data((2, 6, 4)), ints(0, 2, 3, -1))),
    Case("SpaceToDepth", "block 3", (Data((2, 1, 6, 3)),), {"blocksize": 3}),
    Case("Squeeze", "negative axis", (Data((2, 3, 1)), ints(-1))),
    Case("Transpose", "3-D", (Data((2, 3, 4)),), {"perm": [0, 2, 1]}),
    Case("Unsqueeze", "a middle axis", (Data((2, 3, 4)), ints(2))),
]

CASES: list[Case] = [
    *CONVOLUTIONS,
    *ACTIVATIONS,
    *NORMALIZATIONS,
    *POOLS,
    *ELEMENTWISE,
    *REDUCTIONS,
    *SHAPES,
    *RECURRENT,
    *SECOND_SHAPES,
    *MORE_FORMS,
]
