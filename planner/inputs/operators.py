"""The operator table: every ONNX operator planner knows, and what it does with it.

Each operator (and, where its attributes matter, each form of it) is one of:

- **trains**: a gradient flows through it to the inputs named in `grads`, and a parameter in one
  of those inputs trains (a convolution's weight, a PReLU's slope); the gradient is proven
  against central finite differences of ONNX's own reference runtime in float64
  (tests/test_operators.py, several attribute and shape forms each);
- **frozen only**: it runs in a frozen part of the model (before every trained layer, or beside
  the trained path), where no gradient is needed; a layer whose gradient would have to pass
  through it is untrainable, and `inspect` says which node stops it;
- **refused**: planner cannot run it at all; `load_model` refuses the model naming the node and
  the reason, before any compile.

An operator missing from the table is refused, so a model with an operator nobody checked never
reaches a trial. `planner operators` prints the table; docs/operators.md is its `--markdown` form,
which a test keeps current. This module reads ONNX only: loading a model never imports TVM.

Some operators reach TVM as other ONNX operators (`planner.inputs.decompose`): a padding as
slices and concatenations, a resize as gathers, an einsum as matrix products. Their rows describe
the operator the user's file holds; the proof runs through the decomposition.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from planner.errors import BadInput


class Support(enum.Enum):
    TRAINS = "trains"
    FROZEN = "frozen only"
    REFUSED = "refused"


@dataclass(frozen=True)
class Node:
    """An ONNX node with what the analysis knows around it: the values of constant tensors and
    the rank of every tensor shape inference could type (a form is told apart by these)."""

    proto: onnx.NodeProto
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)
    ranks: Mapping[str, int] = field(default_factory=dict)

    def attr(self, name: str, default=None):
        for a in self.proto.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def const(self, slot: int) -> np.ndarray | None:
        """The value of input `slot` when it is a constant (None when absent or computed)."""
        if slot >= len(self.proto.input) or not self.proto.input[slot]:
            return None
        return self.constants.get(self.proto.input[slot])

    def rank(self, slot: int) -> int | None:
        if slot >= len(self.proto.input):
            return None
        return self.ranks.get(self.proto.input[slot])

    def text(self, name: str, default: str) -> str:
        value = self.attr(name, default)
        return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Form:
    """An attribute form of an operator whose support is less than the operator's."""

    support: Support
    what: str  # the form, as docs and `inspect` name it: "a 3-D convolution"
    why: str  # why it is not supported further
    applies: Callable[[Node], bool]


@dataclass(frozen=True)
class Operator:
    """One row of the table."""

    name: str  # the ONNX op type
    support: Support
    what: str  # what PyTorch writes it for (docs)
    # the inputs a gradient flows into (None: every input; integer and boolean inputs never carry one)
    grads: tuple[int, ...] | None = None
    # the inputs that are a layer's weight and bias when they hold parameters (a convolution's 1 and 2)
    layer: tuple[int | None, int | None] | None = None
    forms: tuple[Form, ...] = ()
    why: str = ""  # for a frozen-only or refused operator: why
    folded: bool = False  # computed once at import, from shapes and constants (it never reaches TVM)
    section: str = ""  # set by the table: where docs list it

    def passes_to(self, slot: int) -> bool:
        return self.grads is None or slot in self.grads

    def limits(self) -> list[str]:
        """What the row says beyond its support: why not further, each lesser form, which inputs a gradient reaches."""
        out = [self.why] if self.why else []
        out += [f"{f.what}: {f.support.value} ({f.why})" for f in self.forms]
        if self.grads is not None and self.support is Support.TRAINS:
            out.append(f"gradient to input{'s' if len(self.grads) > 1 else ''} {', '.join(map(str, self.grads))} only")
        return out

    def to_json(self) -> dict:
        return {
            "operator": self.name,
            "support": self.support.value,
            "section": self.section,
            "pytorch": self.what,
            "limits": self.limits(),
        }


# --- forms -------------------------------------------------------------------------------------


def _spatial_rank(node: Node) -> int | None:
    rank = node.rank(0)
    return None if rank is None else rank - 2


def _three_d(node: Node) -> bool:
    return (_spatial_rank(node) or 0) > 2


_THREE_D = Form(
    Support.REFUSED, "3-D (volumes)", "planner builds 1-D and 2-D convolutions and pools only; a 3-D one is not tested", _three_d
)


def _negative_steps(node: Node) -> bool:
    steps = node.const(4)
    return steps is not None and bool((np.asarray(steps) < 0).any())


def _negative_pads(node: Node) -> bool:
    pads = node.const(1)
    return pads is not None and bool((np.asarray(pads) < 0).any())


def _computed_exponent(node: Node) -> bool:
    return node.const(1) is None


def _pad_mode(node: Node) -> str:
    return node.text("mode", "constant")


def _resize_mode(node: Node) -> str:
    return node.text("mode", "nearest")


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
_QUANTIZED = "quantized graphs are not supported yet: export the float model"
_DYNAMIC = "its output shape depends on the data; a step needs fixed shapes"
_FOLDED = "computed once at import: a step's shapes are fixed, so this is a constant"

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
        _t("MaxPool", "`nn.MaxPool1d`, `nn.MaxPool2d`: any stride, padding, dilation, ceil mode", forms=(_THREE_D,), grads=(0,)),
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
        _t(
            "Pow",
            "`x ** e` with a constant exponent (RMSNorm's square, tanh-GELU's cube)",
            grads=(0,),
            forms=(
                Form(
                    Support.FROZEN,
                    "a computed exponent",
                    "planner differentiates `x ** constant` only: `e ** x` is `Exp` of a product",
                    _computed_exponent,
                ),
            ),
        ),
        _t("Exp", "`torch.exp`"),
        _t("Log", "`torch.log`, `nn.LogSigmoid`"),
        _t("Erf", "exact GELU as the legacy exporter writes it"),
        _t("Sin", "`torch.sin`"),
        _t("Cos", "`torch.cos`"),
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
        _f("Floor", "`torch.floor`", _STEP),
        _f("Ceil", "`torch.ceil`", _STEP),
        _f("Round", "`torch.round`", _STEP),
        _f("Sign", "`torch.sign`", _STEP),
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
            "`F.pad`, `nn.*Pad*d`: constant, reflect, replicate (edge) and circular (wrap)",
            grads=(0,),
            forms=(
                Form(
                    Support.REFUSED,
                    "negative pads (a crop)",
                    "not checked against a reference: crop with a slice",
                    _negative_pads,
                ),
            ),
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
        _f("Mod", "`%` on indices", _NOT_FLOAT),
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
    "Refused": (
        _r("Loop", "`nn.EmbeddingBag` (legacy exporter), scripted loops", _CONTROL),
        _r("If", "scripted branches", _CONTROL),
        _r("Scan", "scripted scans", _CONTROL),
        _r("SequenceConstruct", "lists of tensors", _CONTROL),
        _r("SequenceAt", "lists of tensors", _CONTROL),
        _r("ConcatFromSequence", "lists of tensors", _CONTROL),
        _r("SplitToSequence", "lists of tensors", _CONTROL),
        _r("NonZero", "`nonzero`, boolean masking `x[mask]`", _DYNAMIC),
        _r("Unique", "`unique`", _DYNAMIC),
        _r("Compress", "boolean masking", _DYNAMIC),
        _r("NonMaxSuppression", "detection post-processing", _DYNAMIC),
        _r("QuantizeLinear", "quantized graphs", _QUANTIZED),
        _r("DequantizeLinear", "quantized graphs", _QUANTIZED),
        _r("DynamicQuantizeLinear", "quantized graphs", _QUANTIZED),
        _r("MatMulInteger", "quantized graphs", _QUANTIZED),
        _r("ConvInteger", "quantized graphs", _QUANTIZED),
        _r("QLinearConv", "quantized graphs", _QUANTIZED),
        _r("QLinearMatMul", "quantized graphs", _QUANTIZED),
        _r("Attention", "opset 23's fused attention", "TVM 0.27 cannot import it: export at opset 18-21"),
        _r("GridSample", "`F.grid_sample`", "not tested by planner"),
        _r("RoiAlign", "detection heads", "not tested by planner"),
        _r("MaxUnpool", "`nn.MaxUnpool*d`", "not tested by planner"),
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
_STANDARD_DOMAINS = ("", "ai.onnx")


def operator(node: onnx.NodeProto) -> Operator | None:
    """The table's row for `node` (None: an operator planner does not know)."""
    if node.domain not in _STANDARD_DOMAINS:
        return None
    return OPERATORS.get(node.op_type)


def support(node: Node) -> tuple[Support, str]:
    """How planner supports this node (its form included), and why not further ('' when it trains)."""
    op = operator(node.proto)
    if op is None:
        domain = f" of domain '{node.proto.domain}'" if node.proto.domain not in _STANDARD_DOMAINS else ""
        return Support.REFUSED, f"planner does not know the operator{domain} (see `planner operators`)"
    for form in op.forms:
        if form.applies(node):
            return form.support, f"{form.what}: {form.why}"
    return op.support, op.why


def refused(node: Node) -> str | None:
    """Why planner cannot run `node` at all, or None when it can."""
    level, why = support(node)
    if level is Support.REFUSED:
        return f"node '{node.proto.name}' ({node.proto.op_type}) is refused: {why}"
    return None


def gradient_problem(node: Node, slot: int) -> str | None:
    """Why a gradient cannot flow from `node`'s output into its input `slot`, or None when it can."""
    level, why = support(node)
    name = f"node '{node.proto.name}' ({node.proto.op_type})"
    if level is not Support.TRAINS:
        return f"{name} has no gradient in planner: {why}"
    op = operator(node.proto)
    if op is not None and not op.passes_to(slot):
        return f"{name} passes no gradient to its input {slot} ('{node.proto.input[slot]}')"
    return None


def layer_slots(node: onnx.NodeProto) -> tuple[int | None, int | None] | None:
    """The (weight, bias) inputs of a layer operator, None for any other."""
    op = operator(node)
    return op.layer if op is not None else None


# --- the published table ------------------------------------------------------------------


def rows() -> Iterable[tuple[str, Operator]]:
    """(section, operator) in the order docs list them."""
    for section, ops in _SECTIONS.items():
        for op in ops:
            yield section, OPERATORS[op.name]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/operators.md: the table, one section per kind of operator."""
    counts = {s: sum(1 for op in OPERATORS.values() if op.support is s) for s in Support}
    lines = [
        "# Operators",
        "",
        "<!-- Generated by `planner operators --markdown > docs/operators.md`; tests/test_operators.py keeps it current. -->",
        "",
        "What planner does with each ONNX operator PyTorch's exporters write. **trains**: a gradient flows",
        "through it (and into its parameters, where it has some), proven against central finite differences",
        "of ONNX's reference runtime in float64 over several attribute and shape forms (tests/test_operators.py).",
        "**frozen only**: it compiles and runs in a frozen part of the model (tested for every row);",
        "a layer whose gradient would pass through it cannot train, and `planner inspect` names the node.",
        "**refused**: a model holding it is refused when it is loaded, naming the node. An operator not listed is refused.",
        "",
        f"{counts[Support.TRAINS]} operators train, {counts[Support.FROZEN]} are frozen only, {counts[Support.REFUSED]} are refused.",
    ]
    for section, ops in _SECTIONS.items():
        lines += ["", f"## {section}", "", "| operator | support | PyTorch | limits |", "|---|---|---|---|"]
        for op in ops:
            lines.append(f"| `{op.name}` | {op.support.value} | {_cell(op.what)} | {_cell('; '.join(op.limits()))} |")
    return "\n".join(lines) + "\n"


def select(names: Sequence[str] | None = None) -> list[Operator]:
    """The rows named (all, in docs order, when none are), or BadInput naming an unknown one."""
    if not names:
        return [op for _, op in rows()]
    lowered = {n.lower(): op for n, op in OPERATORS.items()}
    missing = [n for n in names if n.lower() not in lowered]
    if missing:
        raise BadInput(f"no operator {', '.join(map(repr, missing))} in the table: planner refuses it (see `planner operators`)")
    return [lowered[n.lower()] for n in names]
