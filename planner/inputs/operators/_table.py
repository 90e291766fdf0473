"""The operator table's rows, by section, with the forms that get less than their operator."""

from __future__ import annotations

from planner.inputs.operators._base import Form, Node, Operator, Support

# --- forms -------------------------------------------------------------------------------------


def _spatial_rank(node: Node) -> int | None:
    rank = node.rank(0)
    return None if rank is None else rank - 2


def _three_d(node: Node) -> bool:
    return (_spatial_rank(node) or 0) > 2


_THREE_D = Form(
    Support.REFUSED, "3-D (volumes)", "planner builds 1-D and 2-D convolutions and pools only; a 3-D one is not tested", _three_d
)


def _indices(node: Node) -> bool:
    return len(node.proto.output) > 1 and bool(node.proto.output[1])


def _batch_dims(node: Node) -> bool:
    return bool(node.attr("batch_dims", 0))


def _repeated_index(node: Node) -> bool:
    terms = node.text("equation", "").replace(" ", "").partition("->")[0].replace("...", "").split(",")
    return any(len(set(t)) != len(t) for t in terms)


def _computed_input(node: Node) -> bool:
    return any(name and name not in node.constants for name in node.proto.input)


_DATA_SHAPED = Form(Support.REFUSED, "computed from the data", "its output's shape would depend on the data", _computed_input)


def _resize_unsupported(node: Node) -> bool:
    return (
        node.text("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize"
        or node.text("keep_aspect_ratio_policy", "stretch") != "stretch"
    )


def _weighted(node: Node) -> bool:
    return len(node.proto.input) > 2 and bool(node.proto.input[2])


_WEIGHTED = Form(Support.REFUSED, "class weights", "planner writes these losses without class weights", _weighted)


# --- the table --------------------------------------------------------------------------------


def _t(name: str, what: str, **kw) -> Operator:
    return Operator(name, Support.TRAINS, what, **kw)


def _f(name: str, what: str, why: str, **kw) -> Operator:
    return Operator(name, Support.FROZEN, what, why=why, **kw)


def _r(name: str, what: str, why: str) -> Operator:
    return Operator(name, Support.REFUSED, what, why=why)


_NOT_FLOAT = "its output is an integer or boolean tensor: no gradient exists"
_STEP = "a step function: its gradient is zero wherever it exists, so nothing before it would learn"
_CONTROL = "control flow and sequences are not supported: export the model without data-dependent loops"
_QUANTIZED = "integer operators are not supported: quantize the model in the QDQ format, or export the float model"
_DYNAMIC = "its output shape depends on the data; a step needs fixed shapes"
_FOLDED = "computed once at import: a step's shapes are fixed, so this is a constant"

_QDQ = (
    "fake quantization: the values quantized and dequantized at once, the gradient straight-through where they "
    "are inside the integers' range, zero outside (PyTorch's `fake_quantize`); proven against PyTorch in tests/test_qdq.py"
)

_SECTIONS: dict[str, tuple[Operator, ...]] = {
    "Linear algebra and convolutions": (
        _t(
            "Conv",
            "`nn.Conv1d`, `nn.Conv2d`: any stride, padding (`same` included), dilation, groups",
            layer=(1, 2),
            forms=(_THREE_D,),
        ),
        _t(
            "ConvTranspose",
            "`nn.ConvTranspose1d`, `nn.ConvTranspose2d`: any stride, padding, output padding, dilation, groups",
            layer=(1, 2),
            forms=(_THREE_D,),
        ),
        _t("Gemm", "`nn.Linear` on 2-D inputs", layer=(1, 2)),
        _t("MatMul", "`nn.Linear` on 3-D inputs (with an `Add` of its bias), `@`, attention's products", layer=(1, None)),
        _t(
            "Einsum",
            "`torch.einsum`: written as transposes, sums and matrix products",
            forms=(
                Form(
                    Support.FROZEN,
                    "an operand repeating an index (a diagonal, a trace)",
                    "not written as products",
                    _repeated_index,
                ),
            ),
        ),
    ),
    "Activations": (
        _t("Relu", "`nn.ReLU`"),
        _t("LeakyRelu", "`nn.LeakyReLU`"),
        _t("PRelu", "`nn.PReLU`: its slope is a parameter", layer=(1, None)),
        _t("Elu", "`nn.ELU`"),
        _t("Selu", "`nn.SELU`"),
        _t("Celu", "`nn.CELU` (written as `Elu`-like elementwise ops)"),
        _t("Gelu", "`nn.GELU`, exact and `approximate='tanh'`"),
        _t("Sigmoid", "`nn.Sigmoid`, SiLU's gate"),
        _t("HardSigmoid", "`nn.Hardsigmoid`"),
        _t("HardSwish", "`nn.Hardswish`"),
        _t("Tanh", "`nn.Tanh`, tanh-GELU"),
        _t("Softplus", "`nn.Softplus`, `nn.Mish`'s inner part"),
        _t("Softsign", "`nn.Softsign`"),
        _t("Mish", "`nn.Mish`"),
        _t("ThresholdedRelu", "`nn.Threshold` with value 0"),
        _t("Shrink", "`nn.Hardshrink`, `nn.Softshrink`"),
        _t("Softmax", "`nn.Softmax`, attention"),
        _t("LogSoftmax", "`nn.LogSoftmax`"),
        _t(
            "SoftmaxCrossEntropyLoss",
            "`F.cross_entropy` inside a model that computes its own loss (written as LogSoftmax and a one-hot sum)",
            grads=(0,),
            forms=(_WEIGHTED,),
        ),
        _t("NegativeLogLikelihoodLoss", "`F.nll_loss` inside a model that computes its own loss", grads=(0,), forms=(_WEIGHTED,)),
        _f("Hardmax", "`F.one_hot(x.argmax())`-like selections", _STEP),
    ),
    "Normalization": (
        _t(
            "BatchNormalization",
            "`nn.BatchNorm*d` in eval mode (running statistics; scale and shift train)",
            layer=(1, 2),
            grads=(0, 1, 2),
        ),
        _t("LayerNormalization", "`nn.LayerNorm` over trailing axes", layer=(1, 2)),
        _t("InstanceNormalization", "`nn.InstanceNorm*d`, and `nn.GroupNorm` as both exporters write it", layer=(1, 2)),
        _t("GroupNormalization", "`nn.GroupNorm` (opset 18 and 21 forms)", layer=(1, 2)),
        _t("RMSNormalization", "`nn.RMSNorm` (opset 23)", layer=(1, None)),
        _f("LRN", "`nn.LocalResponseNorm`", "planner has no gradient for its 3-D pooling"),
    ),
    "Pooling and resampling": (
        _t(
            "MaxPool",
            "`nn.MaxPool1d`, `nn.MaxPool2d`: any stride, padding, dilation, ceil mode",
            forms=(
                _THREE_D,
                Form(Support.REFUSED, "with its indices output (`return_indices=True`)", "TVM 0.27 cannot import it", _indices),
            ),
            grads=(0,),
        ),
        _t(
            "AveragePool",
            "`nn.AvgPool1d`, `nn.AvgPool2d`: any stride, padding, ceil mode, `count_include_pad`",
            forms=(_THREE_D,),
        ),
        _t("GlobalAveragePool", "`nn.AdaptiveAvgPool2d(1)`"),
        _t("GlobalMaxPool", "`nn.AdaptiveMaxPool2d(1)`"),
        _t(
            "Resize",
            "`nn.Upsample`, `F.interpolate`: nearest, linear and cubic, any coordinate mode (written as gathers)",
            grads=(0,),
            forms=(
                Form(
                    Support.FROZEN,
                    "crop-and-resize, or sizes with a kept aspect ratio",
                    "planner writes per-axis resizes only",
                    _resize_unsupported,
                ),
            ),
        ),
        _t("DepthToSpace", "`nn.PixelShuffle`"),
        _t("SpaceToDepth", "`nn.PixelUnshuffle`"),
    ),
    "Elementwise arithmetic": (
        _t("Add", "`+`, a bias"),
        _t("Sub", "`-`"),
        _t("Mul", "`*`, a scale"),
        _t("Div", "`/`"),
        _t("Neg", "unary `-`"),
        _t("Abs", "`torch.abs`"),
        _t("Reciprocal", "`1 / x`"),
        _t("Sqrt", "`torch.sqrt`"),
        _t("Pow", "`x ** e` (RMSNorm's square, tanh-GELU's cube, `2 ** x`: d/de = x ** e ln x, NaN where x <= 0, as PyTorch's)"),
        _t("Exp", "`torch.exp`"),
        _t("Log", "`torch.log`, `nn.LogSigmoid`"),
        _t("Erf", "exact GELU as the legacy exporter writes it"),
        _t("Sin", "`torch.sin`"),
        _t("Cos", "`torch.cos`"),
        _t("Tan", "`torch.tan`"),
        _t("Asin", "`torch.asin`"),
        _t("Acos", "`torch.acos`"),
        _t("Atan", "`torch.atan`, `torch.atan2`"),
        _t("Sinh", "`torch.sinh` (written with `Exp`)"),
        _t("Cosh", "`torch.cosh` (written with `Exp`)"),
        _t("Asinh", "`torch.asinh`"),
        _t("Acosh", "`torch.acosh`"),
        _t("Atanh", "`torch.atanh`"),
        _t("Max", "`torch.maximum`, `clamp` with tensor bounds"),
        _t("Min", "`torch.minimum`, `clamp` with tensor bounds"),
        _t("Sum", "a sum of several tensors"),
        _t("Mean", "a mean of several tensors"),
        _t("Clip", "`clamp`, `nn.ReLU6`, `nn.Hardtanh` with constant bounds", grads=(0,)),
        _t("Where", "`torch.where`, attention masks filled with `-inf`", grads=(1, 2)),
        _t("Cast", "dtype conversions between float types (a gradient never crosses an integer cast)"),
        _t("CastLike", "dtype conversions as `Cast`"),
        _t("Identity", "a tensor passed on (a shared weight's second use is tied to the first, not copied)"),
        _t("Dropout", "`nn.Dropout` in eval mode: the identity", grads=(0,)),
        _t("Floor", "`torch.floor`", zero_gradient=True),
        _t("Ceil", "`torch.ceil`", zero_gradient=True),
        _t("Round", "`torch.round`", zero_gradient=True),
        _t("Sign", "`torch.sign`", zero_gradient=True),
    ),
    "Reductions and scans": (
        _t("ReduceMean", "`mean(dim)`, a global average pool"),
        _t("ReduceSum", "`sum(dim)`, masked mean pooling"),
        _t("ReduceMax", "`amax(dim)`, `max(dim).values` (ties share the gradient)"),
        _t("ReduceMin", "`amin(dim)` (ties share the gradient)"),
        _t("ReduceL2", "`norm(dim)`, weight norm kept in the graph"),
        _t("ReduceL1", "`norm(p=1, dim)`"),
        _t("ReduceSumSquare", "`(x ** 2).sum(dim)`"),
        _t("ReduceLogSumExp", "`logsumexp(dim)`"),
        _t("ReduceLogSum", "`log(sum(dim))`"),
        _f("ReduceProd", "`prod(dim)`", "its gradient divides by the input: planner has none"),
        _t("CumSum", "`cumsum`, exclusive and reversed included", grads=(0,)),
        _t("TopK", "`topk`: the values carry a gradient, the indices none", grads=(0,)),
        _f("ArgMax", "`argmax`", _NOT_FLOAT),
        _f("ArgMin", "`argmin`", _NOT_FLOAT),
    ),
    "Shapes and indexing": (
        _t("Reshape", "`view`, `reshape`", grads=(0,)),
        _t("Flatten", "`flatten`"),
        _t("Transpose", "`permute`, `transpose`"),
        _t("Squeeze", "`squeeze`", grads=(0,)),
        _t("Unsqueeze", "`unsqueeze`", grads=(0,)),
        _t("Expand", "`expand`, a class token broadcast to the batch", grads=(0,)),
        _t("Concat", "`torch.cat`"),
        _t("Split", "`split`, `chunk`", grads=(0,)),
        _t("Slice", "`x[a:b:s]`, negative steps (`flip`) included", grads=(0,)),
        _t("Gather", "`x[i]`, `nn.Embedding` (its table is a parameter)", grads=(0,)),
        _t(
            "GatherND",
            "advanced indexing, a last-token pick",
            grads=(0,),
            forms=(Form(Support.FROZEN, "`batch_dims` > 0", "planner differentiates `batch_dims` 0 only", _batch_dims),),
        ),
        _t("GatherElements", "`torch.gather`, relative-position attention", grads=(0,)),
        _f("ScatterElements", "`scatter`", "planner has no gradient for scatters"),
        _f("ScatterND", "index assignment `x[i] = v`", "planner has no gradient for scatters"),
        _t("Tile", "`repeat`", grads=(0,)),
        _t(
            "Pad",
            "`F.pad`, `nn.*Pad*d`: constant, reflect, replicate (edge), circular (wrap); a negative width crops",
            grads=(0,),
        ),
        _t("Trilu", "`tril`, `triu`", grads=(0,)),
        _f("Equal", "`==`", _NOT_FLOAT),
        _f("Less", "`<`", _NOT_FLOAT),
        _f("LessOrEqual", "`<=`", _NOT_FLOAT),
        _f("Greater", "`>`", _NOT_FLOAT),
        _f("GreaterOrEqual", "`>=`", _NOT_FLOAT),
        _f("And", "`&` of masks", _NOT_FLOAT),
        _f("Or", "`|` of masks", _NOT_FLOAT),
        _f("Xor", "`^` of masks", _NOT_FLOAT),
        _f("Not", "`~` of a mask", _NOT_FLOAT),
        _f("IsNaN", "`isnan`", _NOT_FLOAT),
        _f("IsInf", "`isinf`", _NOT_FLOAT),
        _t("Mod", "`%`, `torch.fmod`, `torch.remainder` (an index's, or a float's)", grads=(0,)),
        _f("OneHot", "`F.one_hot`", _NOT_FLOAT),
        _f("Shape", "`x.shape`", _FOLDED, folded=True),
        _f("Size", "`x.numel()`", _FOLDED, folded=True),
        _f("Range", "`arange`", _FOLDED, folded=True, forms=(_DATA_SHAPED,)),
        _f("ConstantOfShape", "`zeros`, `full`", _FOLDED, folded=True, forms=(_DATA_SHAPED,)),
        _f("Constant", "a constant tensor", _FOLDED, folded=True),
    ),
    "Recurrent layers": (
        _t("GRU", "`nn.GRU` (unrolled over its fixed sequence)"),
        _t("LSTM", "`nn.LSTM` (unrolled over its fixed sequence)"),
        _t("RNN", "`nn.RNN` (unrolled over its fixed sequence)"),
    ),
    "Quantization (QDQ models)": (
        Operator(
            "QuantizeLinear",
            Support.TRAINS,
            "a QDQ model's activation quantized (ONNX Runtime's `quantize_static`, PyTorch's PT2E export)",
            grads=(0,),
            why=_QDQ,
            straight_through=True,
        ),
        Operator(
            "DequantizeLinear",
            Support.TRAINS,
            "a QDQ model's weight (read as the float values it stands for, which train) or activation dequantized",
            grads=(0,),
            why=_QDQ,
            straight_through=True,
        ),
    ),
    "Refused": (
        _r("Loop", "`nn.EmbeddingBag` (legacy exporter), scripted loops", _CONTROL),
        _r("If", "scripted branches (one whose condition is a constant once shapes are fixed is its branch)", _CONTROL),
        _r("Scan", "scripted scans", _CONTROL),
        _r("SequenceConstruct", "lists of tensors", _CONTROL),
        _r("SequenceAt", "lists of tensors", _CONTROL),
        _r("ConcatFromSequence", "lists of tensors", _CONTROL),
        _r("SplitToSequence", "lists of tensors", _CONTROL),
        _r("NonZero", "`nonzero`, boolean masking `x[mask]`", _DYNAMIC),
        _r("Unique", "`unique`", _DYNAMIC),
        _r("Compress", "boolean masking", _DYNAMIC),
        _r("NonMaxSuppression", "detection post-processing", _DYNAMIC),
        _r("DynamicQuantizeLinear", "dynamic quantization", _QUANTIZED),
        _r("MatMulInteger", "quantized graphs", _QUANTIZED),
        _r("ConvInteger", "quantized graphs", _QUANTIZED),
        _r("QLinearConv", "quantized graphs", _QUANTIZED),
        _r("QLinearMatMul", "quantized graphs", _QUANTIZED),
        _r("Attention", "opset 23's fused attention", "TVM 0.27 cannot import it: export at opset 18-21"),
        _r("GridSample", "`F.grid_sample`", "not tested by planner"),
        _r("RoiAlign", "detection heads", "not tested by planner"),
        _r("MaxUnpool", "`nn.MaxUnpool*d`", "not tested by planner"),
        _r("Col2Im", "`nn.Fold`, `F.fold`", "not supported: planner has not checked TVM's lowering of it"),
        _r("AffineGrid", "`F.affine_grid`", "not tested by planner"),
        _r("SequenceEmpty", "lists of tensors", _CONTROL),
        _r("SequenceInsert", "lists of tensors", _CONTROL),
        _r("LpPool", "`nn.LPPool*d` written as one operator", "not tested by planner"),
        _r("MeanVarianceNormalization", "not written by PyTorch's exporters", "not tested by planner"),
        _r(
            "Upsample",
            "the deprecated form of `Resize` (opsets 7-9)",
            "export at opset 11 or later: PyTorch then writes `Resize`",
        ),
    ),
}

OPERATORS: dict[str, Operator] = {
    op.name: Operator(**{**op.__dict__, "section": section}) for section, ops in _SECTIONS.items() for op in ops
}
