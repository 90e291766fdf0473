"""What TVM's ONNX frontend writes that Relax cannot differentiate, rewritten into what it can.

- 1-D convolutions (a sensor window's Conv1d, an audio frame's) as 2-D ones of height 1. TVM
  0.27's Relax has no gradient for `relax.nn.conv1d`. A `[N, C, L]` signal is a `[N, C, 1, L]`
  image and a `[O, C/g, K]` kernel a `[O, C/g, 1, K]` one: the same products in the same order,
  so the 2-D convolution computes exactly the 1-D one, and gets conv2d's gradient (planner's,
  over the padding it reads: `gradients._conv2d_grad`) and its kernels: OpenBLAS's im2col GEMMs
  and the schedules every 2-D convolution has, instead of scalar loops.
- 1-D pools and transposed convolutions as 2-D ones of height 1, for the same reason: Relax has
  gradients for neither `max_pool1d`, `avg_pool1d` nor `conv1d_transpose`, and planner's 2-D ones
  are proven (tests/test_operators.py).
- Group and RMS normalization (ONNX's `GroupNormalization`, `RMSNormalization`) as the means,
  variances and products they are: Relax has gradients for those, not for `group_norm` or
  `rms_norm`.
- BatchNorm (running statistics) as `x * a + b` per channel: the same function, one multiply-add
  per element rather than a subtraction, a division, a product and a sum.
- A concatenation of one tensor (GPT-2's attention concatenates the key with an empty cache) as
  the tensor: TVM's concat gradient returns a tensor where its gradient pass expects a tuple.
- A QDQ model's fake quantization of an activation, `dequantize(quantize(x, s, z), s, z)`, as
  `clip(x) + no_grad(dequantize(quantize(x)) - clip(x))` (clip to the range the integers span):
  the same values, and the straight-through gradient PyTorch's fake quantization has (the
  output's gradient where x is inside the range, zero outside), where the true one is zero
  almost everywhere and a model quantized for inference would learn nothing through it. Once
  the gradient is built, the forward takes `dequantize(quantize(x))` itself
  (`fake_quantized_values`): the sum is that value up to its last bit, and the kernels a
  microcontroller runs an int8 activation through compute exactly the quantized one.
"""

from __future__ import annotations

import tvm
from tvm import relax


@relax.expr_functor.mutator
class _Conv1dAsConv2d(relax.PyExprMutator):
    """`conv1d(x, w)` -> `reshape(conv2d(x[:, :, None], w[:, :, None]), [N, O, L_out])`."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.conv1d"):
            return call
        a = call.attrs
        if (a.data_layout, a.kernel_layout) != ("NCW", "OIW") or a.out_layout not in ("", "NCW"):
            return call  # the ONNX frontend writes NCW/OIW; any other layout is left to fail by name
        x, w = call.args
        conv = relax.op.nn.conv2d(
            relax.op.expand_dims(x, 2),
            relax.op.expand_dims(w, 2),
            strides=(1, int(a.strides[0])),
            padding=(0, int(a.padding[0]), 0, int(a.padding[1])),
            dilation=(1, int(a.dilation[0])),
            groups=int(a.groups),
            out_dtype=a.out_dtype or None,
        )
        return relax.op.reshape(conv, [int(d) for d in call.ty.shape])


def _pool1d_as_2d(call: relax.Call, op) -> relax.Expr:
    a = call.attrs
    pool = op(
        relax.op.expand_dims(call.args[0], 2),
        pool_size=(1, int(a.pool_size[0])),
        strides=(1, int(a.strides[0])),
        padding=(0, int(a.padding[0]), 0, int(a.padding[1])),
        dilation=(1, int(a.dilation[0])),
        ceil_mode=bool(a.ceil_mode),
        count_include_pad=bool(a.count_include_pad),
    )
    return relax.op.reshape(pool, [int(d) for d in call.ty.shape])


def _conv1d_transpose_as_2d(call: relax.Call) -> relax.Expr:
    a = call.attrs
    x, w = call.args
    conv = relax.op.nn.conv2d_transpose(
        relax.op.expand_dims(x, 2),
        relax.op.expand_dims(w, 2),
        strides=(1, int(a.strides[0])),
        padding=(0, int(a.padding[0]), 0, int(a.padding[1])),
        output_padding=(0, int(a.output_padding[0])),
        dilation=(1, int(a.dilation[0])),
        groups=int(a.groups),
        out_dtype=a.out_dtype or None,
    )
    return relax.op.reshape(conv, [int(d) for d in call.ty.shape])


@relax.expr_functor.mutator
class _OneDAsTwoD(relax.PyExprMutator):
    """`max_pool1d`, `avg_pool1d` and `conv1d_transpose` (NCW) as their 2-D ops over `[N, C, 1, W]`."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else ""
        if name in ("relax.nn.max_pool1d", "relax.nn.avg_pool1d") and call.attrs.layout == "NCW":
            return _pool1d_as_2d(call, relax.op.nn.max_pool2d if name.endswith("max_pool1d") else relax.op.nn.avg_pool2d)
        if name == "relax.nn.conv1d_transpose" and (call.attrs.data_layout, call.attrs.kernel_layout) == ("NCW", "IOW"):
            return _conv1d_transpose_as_2d(call)
        return call


def _group_norm(call: relax.Call) -> relax.Expr:
    a = call.attrs
    x, gamma, beta = call.args
    shape = [int(d) for d in x.ty.shape]
    groups = int(a.num_groups)
    grouped = relax.op.reshape(x, [shape[0], groups, shape[1] // groups, *shape[2:]])
    axes = list(range(2, len(shape) + 1))
    mean = relax.op.mean(grouped, axes, keepdims=True)
    spread = relax.op.variance(grouped, axes, keepdims=True)
    eps = relax.const(float(a.epsilon), x.ty.dtype)
    y = relax.op.reshape((grouped - mean) / relax.op.sqrt(spread + eps), shape)
    channel = [shape[1] if i == 1 else 1 for i in range(len(shape))]
    if a.scale:
        y = y * relax.op.reshape(gamma, channel)
    if a.center:
        y = y + relax.op.reshape(beta, channel)
    return y


def _batch_norm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """Inference BatchNorm as one multiply-add per element, `x * a + b` with `a = gamma / sqrt(var
    + eps)` and `b = beta - mean * a` per channel — what PyTorch's CPU inference and BatchNorm
    folding compute — rather than TVM's `(x - mean) / sqrt(var + eps) * gamma + beta`, whose
    per-channel terms its fusion recomputes for every element (`planner.backend.lower.hoist`).
    The running statistics are those of an exported eval-mode model: they never change."""
    x, gamma, beta, mean, var = call.args
    ndim = int(x.ty.ndim)
    channel = [-1] + [1] * (ndim - int(call.attrs.axis) % ndim - 1)
    eps = relax.const(float(call.attrs.epsilon), x.ty.dtype)
    root = relax.op.sqrt(var + eps)
    a = bb.emit(gamma / root if call.attrs.scale else relax.op.divide(relax.const(1.0, x.ty.dtype), root))
    b = bb.emit(beta - mean * a if call.attrs.center else relax.op.negative(mean * a))
    y = bb.emit(x * relax.op.reshape(a, channel) + relax.op.reshape(b, channel))
    return relax.Tuple([y, mean, var])


def _rms_norm(call: relax.Call) -> relax.Expr:
    x, weight = call.args
    eps = relax.const(float(call.attrs.epsilon), x.ty.dtype)
    axes = [int(d) for d in call.attrs.axes]
    return x / relax.op.sqrt(relax.op.mean(x * x, axes, keepdims=True) + eps) * weight


@relax.expr_functor.mutator
class _NormsAsOps(relax.PyExprMutator):
    """`group_norm` (channels on axis 1) and `rms_norm` as means, variances, products and sums;
    `batch_norm` as a multiply-add per element."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else ""
        if name == "relax.nn.group_norm" and int(call.attrs.channel_axis) == 1:
            return _group_norm(call)
        if name == "relax.nn.rms_norm":
            return _rms_norm(call)
        if name == "relax.nn.batch_norm":
            return _batch_norm(self.builder_, call)
        return call


@relax.expr_functor.mutator
class _LoneConcat(relax.PyExprMutator):
    """`concat((x,))` -> `x`."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.concat":
            tensors = call.args[0]
            if isinstance(tensors, relax.Tuple) and len(tensors.fields) == 1:
                return tensors.fields[0]
        return call


_QUANTIZE, _DEQUANTIZE = tvm.ir.Op.get("relax.quantize"), tvm.ir.Op.get("relax.dequantize")


def scalar(expr: relax.Expr) -> float | None:
    """The value of a constant of one element, else None."""
    if isinstance(expr, tvm.ir.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


@relax.expr_functor.mutator
class _FakeQuantized(relax.PyExprMutator):
    """`dequantize(quantize(x, s, z), s, z)` with one constant scale and zero point ->
    `clip(x, lo, hi) + no_grad(dequantize(quantize(x, s, z), s, z) - clip(x, lo, hi))`."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not call.op.same_as(_DEQUANTIZE):
            return call
        q = self.lookup_binding(call.args[0]) if isinstance(call.args[0], relax.Var) else call.args[0]
        if not (isinstance(q, relax.Call) and q.op.same_as(_QUANTIZE)):
            return call
        x = q.args[0]
        s, z = scalar(call.args[1]), scalar(call.args[2])
        if s is None or z is None or (s, z) != (scalar(q.args[1]), scalar(q.args[2])):
            return call
        info = tvm.runtime.DataType(str(q.ty.dtype))
        lowest = -(2 ** (info.bits - 1)) if info.type_code == 0 else 0  # int8: -128; uint8: 0
        highest = lowest + 2**info.bits - 1
        clipped = self.builder_.emit(relax.op.clip(x, (lowest - z) * s, (highest - z) * s))
        gap = self.builder_.emit(relax.op.subtract(call, clipped))
        return relax.op.add(clipped, relax.op.grad.no_grad(gap))


def for_training(func: relax.Function) -> relax.Function:
    """`func` with every 1-D convolution, transposed convolution and pool a 2-D one of height 1,
    group and RMS norms as their ops, every lone concatenation its tensor and every fake
    quantization straight-through (see the module's docstring)."""
    for rewrite in (_Conv1dAsConv2d, _OneDAsTwoD, _NormsAsOps, _LoneConcat, _FakeQuantized):
        func = rewrite().visit_expr(func)
    return func


@relax.expr_functor.mutator
class _QuantizedValues(relax.PyExprMutator):
    """`clip(x) + no_grad(dequantize(quantize(x)) - clip(x))` -> `dequantize(quantize(x))`, where
    x is not in `kept` (values a gradient still has to pass through)."""

    def __init__(self, kept: frozenset[relax.Var] = frozenset()) -> None:
        super().__init__()
        self.kept, self.rewritten = kept, 0

    def _bound(self, expr: relax.Expr, op: tvm.ir.Op) -> relax.Call | None:
        value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
        return value if isinstance(value, relax.Call) and value.op.same_as(op) else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not call.op.same_as(_ADD) or (kept := self._bound(call.args[1], _NO_GRAD)) is None:
            return call
        gap = self._bound(kept.args[0], _SUBTRACT)
        if gap is None or not gap.args[1].same_as(call.args[0]):
            return call
        dequantized = self._bound(gap.args[0], _DEQUANTIZE)
        quantized = None if dequantized is None else self._bound(dequantized.args[0], _QUANTIZE)
        if quantized is None or quantized.args[0] in self.kept:
            return call
        self.rewritten += 1
        return gap.args[0]


_ADD, _SUBTRACT, _NO_GRAD = (tvm.ir.Op.get(f"relax.{name}") for name in ("add", "subtract", "grad.no_grad"))


def _quantizes(func: relax.Function) -> bool:
    """Whether `func` quantizes anything: a look at its bindings, not a rewrite of every
    expression of every model's step (a mutator in Python over a transformer's took seconds)."""
    body = func.body
    return isinstance(body, relax.SeqExpr) and any(
        isinstance(b.value, relax.Call) and b.value.op.same_as(_QUANTIZE) for block in body.blocks for b in block.bindings
    )


def fake_quantized_values(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` (a built step) with each straight-through fake quantization's forward value the
    quantized one, `dequantize(quantize(x))`: its gradient is built, and the sum it was equals
    that value only up to rounding (see the module's docstring)."""
    out, changed = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs), []
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or not _quantizes(func):
            continue
        rewrite = _QuantizedValues()
        new = rewrite.visit_expr(func)
        if rewrite.rewritten:
            out[gv] = relax.analysis.remove_all_unused(new)
            changed.append(gv)
    # each rewritten sum was bound to a name: that binding now an alias, which readers take directly
    return relax.transform.CanonicalizeBindings()(out) if changed else mod


def frozen_quantized_values(func: relax.Function, trainable: list[relax.Var]) -> relax.Function:
    """`func` (a forward, before its gradient is built) with the fake quantizations of values
    that no `trainable` parameter reaches taking their quantized values (`fake_quantized_values`):
    no gradient passes through them, and the row bands then see the step's int8 units whole
    (`planner.backend.graph.quantized`)."""
    if not _quantizes(func):
        return func
    reached = set(trainable)
    for block in func.body.blocks:
        for b in block.bindings:
            if any(v in reached for v in relax.analysis.free_vars(b.value)):
                reached.add(b.var)
    rewrite = _QuantizedValues(frozenset(reached))
    new = rewrite.visit_expr(func)
    if not rewrite.rewritten:
        return func
    mod = relax.transform.CanonicalizeBindings()(tvm.IRModule({"f": relax.analysis.remove_all_unused(new)}))
    return mod["f"]
