"""Candidate -> Relax training module.

The module holds two functions, both with the batch fixed to the candidate's batch size:

- `train_step(x, *frozen, *trainable, *optim_states, labels) -> (loss, *new_trainable, *new_states)`:
  forward, mean cross-entropy, backward and the optimizer update as ONE function, so the whole step
  is timed, planned for memory and shipped to a board as a unit. The last optimizer state is the
  learning rate, returned unchanged: one compiled step serves every lr of a candidate;
- `backbone(x, *frozen, *trainable) -> logits`: inference, for evaluation.

Frozen parameters are passed as *inputs* of the backbone (`relax.training` only differentiates
`param_num` trailing parameters), so they get no gradient and no optimizer state, and every
gradient they would have needed is dead code. BatchNorm is decomposed in inference form before
differentiation: frozen and trainable BN layers both use running statistics (scale and bias train).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx
from tvm.relax.training import SetupTrainer
from tvm.relax.training.loss import CrossEntropyLoss
from tvm.relax.training.optimizer import SGD, Adam, MomentumSGD, Optimizer

from planner.backend import gradients as grads
from planner.backend import recompute
from planner.backend.rewrites import for_training
from planner.backend.tir import accumulate_kernel, scale_kernel
from planner.backend.weights import adapter_shapes, head, int8, lora_a, lora_b, origin, scale, scale_shape, tail
from planner.errors import BadInput, CandidateFailed, last_line
from planner.inputs.model import Model
from planner.types import Candidate, FrozenWeights, ModeKind, Precision, Recompute, StepSignature
from planner.types import Optimizer as OptimizerName

STEP_FUNC = "train_step"
PREDICT_FUNC = "backbone"
LABEL_DTYPE = "int64"


# (model key, batch) -> the model imported for that batch, the least recently used dropped first:
# a study's candidates take a few batch sizes (a space lists three or four, gradient accumulation
# divides them), so 16 keep every one of a study's, with room for a second model, and a
# long-lived process does not keep every graph it ever imported.
_IMPORTED: OrderedDict[tuple[str, int], relax.Function] = OrderedDict()
_IMPORTS_KEPT = 16
_IMPORTED_LOCK = threading.Lock()  # builds run in several threads
_CHECK_BATCH = 2  # the batch `check_importable` imports at: the ops TVM must read are the same at any batch


def check_importable(model: Model) -> None:
    """Raise BadInput now, not in every trial, when TVM's ONNX frontend cannot read the model."""
    if model.unbound:  # a sequence length the data has not set yet: the ops TVM must read are the same at any
        model = model.bind([[d if isinstance(d, int) else _CHECK_BATCH for d in i.shape] for i in model.inputs], "a check")
    _imported(model, model.fixed_batch or _CHECK_BATCH)


def _imported(model: Model, batch: int) -> relax.Function:
    """The model as one Relax function `(*inputs, *parameters)` for a step of `batch` samples; imported
    once per model and batch while it is among the last `_IMPORTS_KEPT` used (shapes are folded for
    the batch, see `planner.fixups`)."""
    key = (model.key, batch)
    with _IMPORTED_LOCK:
        if key in _IMPORTED:
            _IMPORTED.move_to_end(key)
            return _IMPORTED[key]
    try:
        mod = from_onnx(model.import_proto(batch), keep_params_in_input=True)
    except Exception as exc:  # the frontend raises assorted types for ops it does not know
        raise BadInput(f"TVM cannot import {model.path.name}: {last_line(exc)}") from None
    mod, _ = relax.frontend.detach_params(mod)
    mod = _untangle_clip(mod)
    func = for_training(mod["main"])
    expected = len(model.inputs) + len(model.initializers)
    if len(func.params) != expected:  # the frontend keeps initializers in graph order
        raise CandidateFailed(f"ONNX import produced {len(func.params)} parameters, expected {expected}")
    func = func.without_attr("params").without_attr("num_input")
    with _IMPORTED_LOCK:
        _IMPORTED[key] = func
        if len(_IMPORTED) > _IMPORTS_KEPT:
            _IMPORTED.popitem(last=False)
    return func


@relax.expr_functor.mutator
class _ClipAsRelaxOps(relax.PyExprMutator):
    """`call_tir(maximum|minimum, (x, bound))` -> `R.maximum|R.minimum(x, bound)`.

    TVM's ONNX frontend lowers Clip with tensor bounds (every opset >= 11, so every ReLU6) straight
    to TIR, which the gradient pass cannot see through; the Relax ops it stands for have gradients.
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op.same_as(tvm.ir.Op.get("relax.call_tir")) and isinstance(call.args[0], relax.GlobalVar):
            name = call.args[0].name_hint
            operands = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else []
            if len(operands) == 2 and name.rstrip("0123456789") in ("maximum", "minimum"):
                op = relax.op.maximum if name.startswith("maximum") else relax.op.minimum
                return op(*operands)
        return call


def _scalar(expr: relax.Expr) -> float | None:
    if isinstance(expr, tvm.ir.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


@relax.expr_functor.mutator
class _ClampAsClip(relax.PyExprMutator):
    """`minimum(maximum(x, lo), hi)` with constant bounds -> `R.clip(x, lo, hi)`.

    Why: the gradients of maximum and minimum read their inputs, so ReLU6 kept both x and
    maximum(x, lo) alive for the backward pass; `R.clip`'s gradient (planner.grads) reads only
    its output, which the next layer keeps anyway.
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.minimum"):
            return call
        inner, hi = call.args
        bound = self.lookup_binding(inner) if isinstance(inner, relax.Var) else inner
        if not (isinstance(bound, relax.Call) and isinstance(bound.op, tvm.ir.Op) and bound.op.name == "relax.maximum"):
            return call
        x, lo = bound.args
        low, high = _scalar(lo), _scalar(hi)
        if low is None or high is None or x.ty.dtype != call.ty.dtype or x.ty.shape is None:
            return call
        return relax.op.clip(x, low, high)


@relax.expr_functor.mutator
class _ClampedTake(relax.PyExprMutator):
    """`take(…, mode="fast")` -> `mode="clip"`.

    The ONNX frontend gathers in "fast" mode: an index out of range reads (and its gradient
    writes) out of bounds, and its lowering prints a warning on every compile saying so. The
    gathers of exported classifiers index with constants (a class token, `qkv[0]`); clamping
    costs a min and a max per index and makes any other safe."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.take" and call.attrs.mode == "fast":
            return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
        return call


_FOLDED: dict[str, Callable[..., np.ndarray]] = {"relax.isnan": np.isnan, "relax.where": np.where}


@relax.expr_functor.mutator
class _FoldGuards(relax.PyExprMutator):
    """`isnan` and `where` of constants computed here, in numpy, and every use of a value bound to
    a constant given the constant itself. TVM's FoldConstant does the same by compiling and
    running a kernel per folded op: 6 s per MobileNetV2 import (its 35 ReLU6 have 70 guards)."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        args = [self._constant(a) for a in call.args]
        if call.op.name in _FOLDED and all(isinstance(a, tvm.ir.Constant) for a in args):
            value = _FOLDED[call.op.name](*(a.value.numpy() for a in args))
            return relax.const(np.asarray(value).astype(str(call.ty.dtype)), str(call.ty.dtype))
        if any(a is not b for a, b in zip(args, call.args)):
            return relax.Call(call.op, args, call.attrs, call.ty_args)
        return call

    def _constant(self, arg: relax.Expr) -> relax.Expr:
        bound = self.lookup_binding(arg) if isinstance(arg, relax.Var) else None
        return bound if isinstance(bound, tvm.ir.Constant) else arg


def _foldable(func: relax.Function) -> bool:
    """Whether any op of `func` still has only constant operands (TVM's FoldConstant is needed)."""
    found = []

    @relax.expr_functor.visitor
    class _Find(relax.PyExprVisitor):
        def visit_call_(self, call: relax.Call) -> None:
            if isinstance(call.op, tvm.ir.Op) and call.args and all(isinstance(a, tvm.ir.Constant) for a in call.args):
                found.append(call)
            super().visit_call_(call)

    _Find().visit_expr(func)
    return bool(found)


def _untangle_clip(mod: tvm.IRModule) -> tvm.IRModule:
    """Clip as Relax ops, and its bounds' NaN guards (`where(isnan(c), inf, c)`) folded to the
    constants they are — low-precision passes would otherwise retype them (bf16 has no isnan);
    then a constant clamp as one `R.clip` (see `_ClampAsClip`); gathers clamped (`_ClampedTake`)."""
    mod["main"] = _FoldGuards().visit_expr(_ClampedTake().visit_expr(_ClipAsRelaxOps().visit_expr(mod["main"])))
    if _foldable(mod["main"]):  # anything else an exporter left constant
        mod = relax.transform.FoldConstant()(mod)
    mod["main"] = _ClampAsClip().visit_expr(mod["main"])
    return relax.transform.DeadCodeElimination(["main"])(mod)


FP16_LOSS_SCALE = 1024.0


def _retyped_attrs(attrs: tvm.ir.Attrs, old: str, new: str) -> tvm.ir.Attrs:
    """`attrs` with every `dtype`/`out_dtype` field equal to `old` set to `new`."""
    info = type(attrs).__tvm_ffi_type_info__
    fields = {f.name: getattr(attrs, f.name) for f in info.fields}
    if not any(k in ("dtype", "out_dtype") and str(v) == old for k, v in fields.items()):
        return attrs
    fields = {k: new if k in ("dtype", "out_dtype") and str(v) == old else v for k, v in fields.items()}
    return tvm.ir.make_node(info.type_key, **fields)


@relax.expr_functor.mutator
class _Fp16AsBf16(relax.PyExprMutator):
    """Every float16 cast, accumulator and constant becomes bfloat16.

    `ToMixedPrecision` decides which ops run in low precision but only knows float16; bf16 steps
    take its decisions and retype them. bf16 keeps fp32's exponent range, so it needs no loss
    scaling; on CPUs without bf16 units TVM computes in fp32 and stores bf16 (half the bytes).
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.attrs is not None:
            attrs = _retyped_attrs(call.attrs, "float16", "bfloat16")
            if not attrs.same_as(call.attrs):
                return relax.Call(call.op, call.args, attrs, call.ty_args)
        return call

    def visit_generic_const_(self, const: tvm.ir.Constant) -> relax.Expr:
        if str(const.value.dtype) == "float16":
            return relax.const(const.value.numpy().astype("float32"), "bfloat16")
        return const


def _low_precision(backbone: tvm.IRModule, precision: Precision) -> tuple[tvm.IRModule, float]:
    """The backbone with convolutions and matmuls (and what follows them) in `precision`, and the
    loss scale its gradients need.

    Parameters stay fp32 master copies, cast inside the graph, so updates accumulate in fp32.
    fp16's narrow exponent range flushes small gradients to zero: its loss is scaled, and the
    caller unscales. bf16 has fp32's range and trains unscaled.
    """
    if precision is Precision.FP32:
        return backbone, 1.0
    mixed = relax.transform.ToMixedPrecision(out_dtype="float16")(backbone)
    if precision is Precision.FP16:
        return mixed, FP16_LOSS_SCALE
    func = _Fp16AsBf16().visit_expr(mixed[PREDICT_FUNC])
    return tvm.IRModule({PREDICT_FUNC: func}, attrs=backbone.attrs), 1.0


class _ScaledCrossEntropy(CrossEntropyLoss):
    """Mean cross-entropy times a constant: static loss scaling for fp16 training."""

    def __init__(self, scale: float) -> None:
        super().__init__(reduction="mean")
        self.scale = scale

    def __call__(self, predictions, targets, weights=None) -> relax.Function:
        func = super().__call__(predictions, targets, weights)
        if self.scale == 1.0:
            return func
        bb = relax.BlockBuilder()
        params = [relax.Var(p.name, p.ty) for p in func.params]
        with bb.function(self._loss_name, params):
            with bb.dataflow():
                logits = bb.emit(relax.op.astype(params[0], "float32"))
                loss = bb.emit(relax.op.nn.nll_loss(relax.op.nn.log_softmax(logits), params[1], reduction="mean"))
                out = bb.emit_output(loss * relax.const(self.scale, "float32"))
            bb.emit_func_output(out)
        return bb.get()[self._loss_name]


class _Adam(Adam):
    """TVM 0.27's `Adam.init` hands NumPy a TVM dtype object; a dtype string works everywhere."""

    def _set_params_and_dtype(self, params: list[relax.Var]) -> None:
        super()._set_params_and_dtype(params)
        self.dtype: str = str(self.dtype)


_LR = float("nan")  # the learning rate TVM's optimizers are built with: a mark `_runtime_lr` replaces


def make_optimizer(candidate: Candidate) -> Optimizer:
    """`sgd`: plain SGD (no momentum, no weight decay); `momentum`: SGD with momentum 0.9; `adam`.

    Built with the `_LR` mark for a learning rate: the step takes its rate at run time
    (`update_lr`), so candidates that differ only in lr share one compiled step.
    """
    match candidate.optimizer:
        case OptimizerName.SGD:
            return SGD(_LR)
        case OptimizerName.MOMENTUM:
            return MomentumSGD(_LR, momentum=0.9)
        case OptimizerName.ADAM:
            return _Adam(_LR)


def update_lr(candidate: Candidate, loss_scale: float) -> float:
    """The rate the step's update multiplies by, its last optimizer state (`StepSignature`).

    Gradients arrive multiplied by `loss_scale`. SGD and momentum are linear in the gradient, so
    dividing their learning rate undoes the scale exactly; Adam is invariant to it.
    """
    return candidate.lr if candidate.optimizer == "adam" else candidate.lr / loss_scale


@relax.expr_functor.mutator
class _MarkedLr(relax.PyExprMutator):
    """Every `_LR` constant becomes the variable `lr`; `replaced` counts them."""

    def __init__(self, lr: relax.Var):
        super().__init__()
        self.lr, self.replaced = lr, 0

    def visit_generic_const_(self, const: tvm.ir.Constant) -> relax.Expr:
        value = const.value.numpy()
        if value.shape != () or not np.isnan(value) or str(const.value.dtype) != str(self.lr.ty.dtype):
            return const
        self.replaced += 1
        return self.lr


def _runtime_lr(optim: relax.Function, dtype: str) -> relax.Function:
    """TVM's optimizer function (built with `_LR`) taking its learning rate as a fourth argument,
    a scalar of the optimizer's dtype."""
    lr = relax.Var("lr", relax.TensorType((), dtype))
    marked = _MarkedLr(lr)
    body = marked.visit_expr(optim.body)
    if not marked.replaced:
        raise CandidateFailed("the optimizer does not use its learning rate")
    return relax.Function([*optim.params, lr], body, optim.ret_ty, optim.is_pure, optim.attrs)


def _fill(tensor) -> float:
    """Optimizer states start constant (zeros; Adam's running beta products at one)."""
    values = tensor.numpy().ravel()
    if values.size and not (values == values[0]).all():
        raise CandidateFailed("optimizer state does not start constant")
    return float(values[0]) if values.size else 0.0


@grads.installed()  # for the whole build: which ops have a gradient also decides the frozen prefix
def build_training_module(model: Model, candidate: Candidate) -> tuple[tvm.IRModule, StepSignature]:
    """The candidate's training module (unlegalized) and the signature of its step."""
    adapters = _adapters(model, candidate)
    trainable_set = {p for name, mode in candidate.trainable for p in model.layer(name).params_for(mode) if p not in adapters}
    splits = _channel_splits(model, candidate)
    names = list(model.initializers)
    trainable = [
        stored
        for n in names
        for stored in ((head(n),) if n in splits else (lora_a(n), lora_b(n)) if n in adapters else (n,))
        if n in trainable_set or n in adapters
    ]
    quantized = _quantized_weights(model, candidate, [n for n in names if n not in trainable_set])
    frozen = [stored for n in names if n not in trainable_set for stored in ((int8(n), scale(n)) if n in quantized else (n,))] + [
        tail(n) for n in names if n in splits
    ]
    if not trainable:
        raise CandidateFailed("candidate freezes every layer: nothing to train")

    B = candidate.batch_size
    if model.fixed_batch not in (None, B):
        raise CandidateFailed(f"model has a fixed batch size {model.fixed_batch}; cannot use batch {B}")
    func = _imported(model, B)
    n_inputs = len(model.inputs)
    if splits or quantized or adapters:
        func, names = _with_stored_weights(func, n_inputs, names, splits, quantized, adapters)
    xs, pvars = func.params[:n_inputs], func.params[n_inputs:]
    by_name = dict(zip(names, pvars))
    params = [*xs] + [by_name[n] for n in frozen] + [by_name[n] for n in trainable]
    func = relax.Function(params, func.body, func.ret_ty, func.is_pure, func.attrs)
    func = func.with_attr("global_symbol", PREDICT_FUNC)
    backbone = tvm.IRModule({PREDICT_FUNC: func}).with_attrs({"param_num": len(trainable), "state_num": 0})
    backbone = relax.transform.DecomposeOpsForInference(PREDICT_FUNC)(backbone)
    # BatchNorm decomposes into `(y, mean, var)[0]`: a tuple between its output and the next op,
    # which fusion does not look through, so every ReLU6 after a BatchNorm was a kernel of its
    # own in the prediction function — kernels of no use to the step, compiled for every
    # candidate (a third of a classifier-only MobileNetV2 candidate's). Read through, the
    # prediction function's kernels are the step's forward kernels.
    backbone = relax.transform.CanonicalizeBindings()(backbone)
    backbone, loss_scale = _low_precision(backbone, candidate.precision)

    optimizer = make_optimizer(candidate)
    labels = relax.TensorType((B,), LABEL_DTYPE)
    full = backbone[PREDICT_FUNC]
    prefix, differentiated = _frozen_prefix(full, n_inputs, len(trainable))

    def differentiate(func: relax.Function) -> tvm.IRModule:
        try:
            return SetupTrainer(_ScaledCrossEntropy(loss_scale), optimizer, [full.ret_ty, labels], legalize=False)(
                tvm.IRModule({PREDICT_FUNC: func}, attrs=backbone.attrs)
            )
        except Exception as exc:  # TVM reports missing gradients etc. as generic errors
            raise CandidateFailed(f"gradient construction failed: {last_line(exc)}") from None

    kept: tuple[str, ...] = ()
    n_leading = n_inputs if prefix is None else len(prefix.ret_ty.fields)  # the differentiated part's non-weight inputs
    if candidate.recompute != Recompute.NONE:
        differentiated, kept = _recomputing(model, candidate, differentiated, n_leading, [*frozen, *trainable], differentiate)
    differentiated = _weights_rebuilt_in_backward(differentiated, n_leading)
    trainer = differentiate(differentiated)

    lr_dtype = str(optimizer.dtype)
    step, state_types, kernels = _fused_step(
        trainer, prefix, full.params[:n_inputs], n_trainable=len(trainable), lr_dtype=lr_dtype, accum=candidate.grad_accum
    )
    out = tvm.IRModule({PREDICT_FUNC: full, STEP_FUNC: step})
    for gv, kernel in kernels.items():
        out[gv] = kernel
    sig = StepSignature(
        inputs=model.inputs,
        batch_size=B * candidate.grad_accum,
        micro_batch=B,
        frozen=tuple(frozen),
        trainable=tuple(trainable),
        splits={n: splits[n] for n in splits},
        adapters=adapters,
        quantized=quantized,
        loss_scale=loss_scale,
        optim_states=(
            *((tuple(int(d) for d in t.shape), str(t.dtype), _fill(init)) for t, init in zip(state_types, optimizer.state)),
            ((), lr_dtype, update_lr(candidate, loss_scale)),
        ),
        n_classes=model.n_classes,
        kept=kept,
    )
    return out, sig


def _recomputing(
    model: Model,
    candidate: Candidate,
    func: relax.Function,
    n_inputs: int,
    stored: list[str],
    differentiate: Callable[[relax.Function], tvm.IRModule],
) -> tuple[relax.Function, tuple[str, ...]]:
    """`func(*inputs, *weights)` (`stored`: the weights' names) with its inputs and the kept
    activations marked for the gradient pass: the inputs of the layers `candidate.recompute`
    lists, or those `recompute.choose` picks for `auto` (`differentiate`: the gradient pass).
    Also returns the layers whose inputs are kept, in model order."""
    layer_of = {p: layer.name for layer in model.layers for p in layer.param_shapes}
    weights = func.params[n_inputs:]
    owners = {v: layer_of[origin(n)] for v, n in zip(weights, stored) if origin(n) in layer_of}
    inputs = recompute.layer_inputs(func, n_inputs, owners)
    if candidate.recompute == Recompute.AUTO:
        cuts = recompute.cut_points(func, n_inputs) & set(inputs.values())
        picked = recompute.choose(func, n_inputs, cuts, _saved(func, differentiate))
        if picked is None:  # nothing to gain: the step keeps every activation
            return func, ()
        chosen = set(picked)
    else:
        # a listed layer before the first trained one reads an activation the backward pass never needs
        chosen = {inputs[model.layer(name).name] for name in candidate.recompute if model.layer(name).name in inputs}
    layers = tuple(name for name, var in inputs.items() if var in chosen and var not in func.params[:n_inputs])
    return _copy(func, kept=frozenset([*func.params[:n_inputs], *chosen])), layers


def _weights_rebuilt_in_backward(func: relax.Function, n_inputs: int) -> relax.Function:
    """`func(*inputs, *weights)` with every value computed from weights alone (a dequantized
    int8 weight, a ratio-split weight concatenated, W + B·A of a LoRA adapter, a BatchNorm's
    scale) computed again where the backward pass needs it instead of kept from the forward pass.

    Why: the backward pass reads each weight again for the gradient of its layer's input; a
    rebuilt weight kept for that lives at fp32 from its forward use to its backward one, so int8
    storage held more than fp32 storage did (MobileNetV2-w0.35 at 64², first and last layers
    trained, batch 4: 7.89 MiB against 7.20 MiB). The weights these values come from are marked
    `start_checkpoint` and the values read by activations `end_checkpoint`, so the gradient pass
    keeps every activation as before and recomputes only the rebuilds (see
    `planner.backend.recompute`).
    """
    inputs = set(func.params[:n_inputs])
    activation: set[relax.Var] = set(inputs)
    weight_only: set[relax.Var] = set()
    started: set[relax.Var] = set()
    ended: set[relax.Var] = set()
    for b in func.body.blocks[0].bindings:
        used = set(relax.analysis.free_vars(b.value))
        if used & activation:
            activation.add(b.var)
            ended |= used & weight_only
        else:
            weight_only.add(b.var)
            started |= used - weight_only
    if not ended:
        return func
    return _copy(func, kept=frozenset(started), ended=frozenset(ended))


def _copy(func: relax.Function, **options) -> relax.Function:
    """`func` re-emitted by `_function` with `options`."""
    params = [relax.Var(v.name, v.ty) for v in func.params]
    bindings = list(func.body.blocks[0].bindings)
    copy = _function(PREDICT_FUNC, params, bindings, func.body.body, dict(zip(func.params, params)), **options)
    return copy.with_attr("global_symbol", PREDICT_FUNC)


_FORWARD = "forward_"  # the names `_saved` gives the forward pass's bindings


def _saved(func: relax.Function, differentiate: Callable[[relax.Function], tvm.IRModule]) -> set[relax.Var]:
    """The bindings of `func` whose values its backward pass reads, found by differentiating a
    copy whose bindings are numbered (the gradient pass keeps forward names, not variables)."""
    adjoint = differentiate(_copy(func, numbered=_FORWARD))["backbone_loss_adjoint"]
    forward = {f"{_FORWARD}{i}": b.var for i, b in enumerate(func.body.blocks[0].bindings)}
    read = {
        v.name for b in adjoint.body.blocks[0].bindings if b.var.name not in forward for v in relax.analysis.free_vars(b.value)
    }
    return {forward[n] for n in read if n in forward}


def _channel_splits(model: Model, candidate: Candidate) -> dict[str, tuple[int, int]]:
    """weight -> (output-channel axis, channels updated) for every `ratio:r` layer."""
    splits = {}
    for name, mode in candidate.trainable:
        if mode.kind is not ModeKind.RATIO:
            continue
        layer = model.layer(name)
        if layer.out_axis is None or layer.weight is None:
            raise CandidateFailed(f"ratio updates need a Conv, Gemm or MatMul weight; layer '{name}' is {layer.op}")
        channels = layer.param_shapes[layer.weight][layer.out_axis]
        assert mode.ratio is not None, "a `ratio` mode carries its ratio (`Mode`)"
        k = max(1, min(channels, round(mode.ratio * channels)))
        if k < channels:
            splits[layer.weight] = (layer.out_axis, k)
    return splits


def _adapters(model: Model, candidate: Candidate) -> dict[str, tuple[int, int]]:
    """weight -> (output-channel axis, rank) for every `lora:r` layer."""
    adapters = {}
    for name, mode in candidate.trainable:
        if mode.kind is not ModeKind.LORA:
            continue
        layer = model.layer(name)
        assert mode.rank is not None, "a `lora` mode carries its rank (`Mode`)"
        if mode.rank > layer.max_rank or layer.weight is None or layer.out_axis is None:
            raise CandidateFailed(f"layer '{name}' ({layer.op}) takes LoRA adapters up to rank {layer.max_rank}, not {mode.rank}")
        adapters[layer.weight] = (layer.out_axis, mode.rank)
    return adapters


def _quantized_weights(model: Model, candidate: Candidate, frozen: list[str]) -> dict[str, int]:
    """weight -> output-channel axis, for every frozen Conv/Gemm/MatMul weight stored as int8."""
    if candidate.frozen_weights is FrozenWeights.FP32:
        return {}
    frozen_set = set(frozen)
    return {layer.weight: layer.out_axis for layer in model.layers if layer.weight in frozen_set and layer.out_axis is not None}


@relax.expr_functor.mutator
class _RebuildAtUse(relax.PyExprMutator):
    """Each use of a weight becomes a rebuild from its stored parts, emitted right before the use,
    so a dequantized or concatenated weight lives only as long as the op that needs it."""

    def __init__(self, rebuild: dict[relax.Var, Callable[..., relax.Expr]]):
        super().__init__()
        self.rebuild = rebuild

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        make = self.rebuild.get(var)
        return self.builder_.emit(make()) if make else var


def _with_stored_weights(
    func: relax.Function,
    n_inputs: int,
    names: list[str],
    splits: dict[str, tuple[int, int]],
    quantized: dict[str, int],
    adapters: dict[str, tuple[int, int]],
) -> tuple[relax.Function, list[str]]:
    """`func(*inputs, *initializers)` (`n_inputs` inputs) taking each weight the way `planner.backend.weights` stores it,
    and the stored names of its weight parameters in order (TVM's own names for the weights it
    imported are not always the initializers', `onnx::MatMul_430`).

    A split weight is taken as head and tail, concatenated where it is used, so only the head —
    the first k output channels — can receive a gradient and optimizer state: a sparse update of
    that layer. A quantized weight is taken as int8 values and fp32 scales, dequantized where it
    is used. A weight with an adapter is taken with its factors B and A, and B·A is added to it
    where it is used: the gradient reaches the factors only.
    """
    pvars = func.params[n_inputs:]
    new_params: list[relax.Var] = list(func.params[:n_inputs])
    stored: list[str] = []
    rebuild: dict[relax.Var, Callable[..., relax.Expr]] = {}
    for name, var in zip(names, pvars):
        shape = [int(d) for d in var.ty.shape]
        dtype = var.ty.dtype
        base: Callable[[], relax.Expr]
        if name in splits:
            axis, k = splits[name]
            h_shape, t_shape = list(shape), list(shape)
            h_shape[axis], t_shape[axis] = k, shape[axis] - k
            h = relax.Var(head(name), relax.TensorType(h_shape, dtype))
            t = relax.Var(tail(name), relax.TensorType(t_shape, dtype))
            new_params += [h, t]
            stored += [head(name), tail(name)]
            base = partial(relax.op.concat, [h, t], axis=axis)
        elif name in quantized:
            q = relax.Var(int8(name), relax.TensorType(shape, "int8"))
            s = relax.Var(scale(name), relax.TensorType(scale_shape(shape, quantized[name]), dtype))
            new_params += [q, s]
            stored += [int8(name), scale(name)]
            base = partial(_dequantized, q, s, dtype)
        else:
            new_params.append(var)
            stored.append(name)
            base = partial(_itself, var)
        if name in adapters:
            axis, rank = adapters[name]
            b_shape, a_shape = adapter_shapes(shape, axis, rank)
            a = relax.Var(lora_a(name), relax.TensorType(a_shape, dtype))
            b = relax.Var(lora_b(name), relax.TensorType(b_shape, dtype))
            new_params += [a, b]
            stored += [lora_a(name), lora_b(name)]
            rebuild[var] = partial(_adapted, base, b, a, shape, axis)
        elif name in splits or name in quantized:
            rebuild[var] = base
    body = _RebuildAtUse(rebuild).visit_expr(func.body)
    return relax.Function(new_params, body, func.ret_ty, func.is_pure, func.attrs), stored


def _itself(var: relax.Var) -> relax.Expr:
    return var


def _dequantized(q: relax.Var, s: relax.Var, dtype: str) -> relax.Expr:
    return relax.op.astype(q, dtype) * s


def _adapted(base: Callable[[], relax.Expr], b: relax.Var, a: relax.Var, shape: list[int], axis: int) -> relax.Expr:
    """The weight with its adapter's B·A added."""
    return base() + _delta(b, a, shape, axis)


def _delta(b: relax.Expr, a: relax.Expr, shape: list[int], axis: int) -> relax.Expr:
    """B·A laid out as the weight (`weights.adapter_delta` in Relax)."""
    others = [d for i, d in enumerate(shape) if i != axis]
    product = relax.op.reshape(relax.op.matmul(b, a), [shape[axis], *others])
    if axis == 0:
        return product
    order = list(range(1, len(shape)))
    order.insert(axis, 0)
    return relax.op.permute_dims(product, order)


@relax.expr_functor.mutator
class _Renamed(relax.PyExprMutator):
    """An expression with variables replaced (moving bindings into a new function)."""

    def __init__(self, mapping: dict[relax.Var, relax.Expr]):
        super().__init__()
        self.mapping = mapping

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.mapping.get(var, var)

    def visit_dataflow_var_(self, var: relax.Var) -> relax.Expr:
        return self.mapping.get(var, var)


def _function(
    name: str,
    params: list[relax.Var],
    bindings: list,
    output: relax.Expr,
    mapping: dict,
    kept: frozenset = frozenset(),
    ended: frozenset = frozenset(),
    numbered: str | None = None,
) -> relax.Function:
    """A dataflow function of `params` that re-emits `bindings` and returns `output`, the old
    variables of the params (and of each binding) replaced through `mapping`. Old variables in
    `kept` (params or bindings) are marked `start_checkpoint`, those in `ended` (bindings)
    `end_checkpoint`, and read through the mark (see `planner.backend.recompute`); with
    `numbered`, the i-th binding is named `{numbered}{i}`."""

    def mark(old: relax.Var, new: relax.Expr) -> relax.Expr:
        if old in ended:
            return bb.emit(relax.op.grad.end_checkpoint(new), f"{old.name}_rebuilt")
        return bb.emit(relax.op.grad.start_checkpoint(new), f"{old.name}_kept") if old in kept else new

    bb = relax.BlockBuilder()
    with bb.function(name, params):
        with bb.dataflow():
            for old in [v for v in mapping if v in kept]:  # params
                mapping[old] = mark(old, mapping[old])
            for i, binding in enumerate(bindings):
                var_name = binding.var.name if numbered is None else f"{numbered}{i}"
                mapping[binding.var] = mark(binding.var, bb.emit(_Renamed(mapping).visit_expr(binding.value), var_name))
            out = bb.emit_output(_Renamed(mapping).visit_expr(output))
        bb.emit_func_output(out)
    return bb.get()[name]


def _undifferentiable(binding: relax.VarBinding) -> bool:
    """Whether a binding calls an op Relax has no gradient for."""
    value = binding.value
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.get_attr("FPrimalGradient") is None


def _frozen_prefix(func: relax.Function, n_inputs: int, n_trainable: int) -> tuple[relax.Function | None, relax.Function]:
    """`func(*inputs, *frozen, *trainable)` (`n_inputs` model inputs) split where the trainable
    parameters first come in: the prefix `(*inputs, *frozen) -> (t1, …, tk)` computes the tensors before the first op that depends on
    a trainable parameter, in program order; the rest becomes `(t1, …, tk, *frozen, *trainable)`.

    Why: Relax's gradient pass asks every op between the input and the loss for its gradient, even
    where no parameter lies upstream. That was most of a compile's time for a sparse update
    (MobileNetV2 training its last layers: 0.48 of 2.3 s, every op of the frozen backbone asked),
    and a model with an op planner cannot differentiate (a Floor, an argmax) could not train the
    layers after it. Program order keeps the step's order, so its memory plan, as it was. An op
    without a gradient after the first trained layer that no trained layer feeds goes into the
    prefix too: every tensor independent of the trainable parameters then is computed there.
    Returns (None, func) when no op comes before the first trained layer.
    """
    blocks = func.body.blocks
    if len(blocks) != 1 or not all(isinstance(b, relax.VarBinding) for b in blocks[0].bindings):
        return None, func
    bindings = list(blocks[0].bindings)
    xs, weights = list(func.params[:n_inputs]), list(func.params[n_inputs:])
    trainable = set(weights[len(weights) - n_trainable :])
    depends: set[relax.Var] = set(trainable)
    for b in bindings:
        if any(v in depends for v in relax.analysis.free_vars(b.value)):
            depends.add(b.var)
    first = next((i for i, b in enumerate(bindings) if b.var in depends), len(bindings))
    before, after = bindings[:first], bindings[first:]
    if any(_undifferentiable(b) and b.var not in depends for b in after):
        before = [b for b in bindings if b.var not in depends]
        after = [b for b in bindings if b.var in depends]
    if not before:
        return None, func
    used = {v for b in after for v in relax.analysis.free_vars(b.value)} | set(relax.analysis.free_vars(func.body.body))
    boundary = [v for v in [*xs, *(b.var for b in before)] if v in used]
    frozen = weights[: len(weights) - n_trainable]
    fresh = [relax.Var(v.name, v.ty) for v in (*xs, *frozen)]
    prefix = _function("frozen_prefix", fresh, before, relax.Tuple(boundary), dict(zip([*xs, *frozen], fresh)))
    inputs = [relax.Var(v.name, v.ty) for v in boundary]
    params = [relax.Var(v.name, v.ty) for v in weights]
    mapping = dict(zip([*boundary, *weights], [*inputs, *params]))
    rest = _function(PREDICT_FUNC, [*inputs, *params], after, func.body.body, mapping)
    return prefix, rest.with_attr("global_symbol", PREDICT_FUNC)


def _fused_step(
    trainer: tvm.IRModule,
    prefix: relax.Function | None,
    model_inputs: Sequence[relax.Var],
    n_trainable: int,
    lr_dtype: str,
    accum: int = 1,
) -> tuple[relax.Function, list[relax.TensorType], dict[tvm.ir.GlobalVar, tvm.tirx.PrimFunc]]:
    """`backbone_loss_adjoint` followed by `optimizer`, inlined into one flat function; the
    learning rate is the last optimizer state, returned as it came (`_runtime_lr`).

    Inlining lets fusion merge each weight-gradient kernel with its update, so many gradients
    are never materialised at all. With `accum` > 1 the step takes `accum` micro-batches at once
    and unrolls their forward/backward passes one after another, summing gradients: memory
    planning reuses one micro-batch's activations for the next, so the step holds the
    activations of one micro-batch plus the gradient accumulators. `model_inputs`: the
    model's inputs at one micro-batch, which the step takes at `accum` micro-batches.
    """
    adjoint = trainer["backbone_loss_adjoint"]
    optim = _runtime_lr(trainer["optimizer"], lr_dtype)
    adjoint_gv = trainer.get_global_var("backbone_loss_adjoint")
    n_inputs = len(model_inputs) if prefix is None else len(prefix.ret_ty.fields)  # the adjoint's leading non-weight inputs
    micro = [relax.Var(v.name, v.ty) for v in adjoint.params]
    y_ty = micro[-1].ty
    B = int(y_ty.shape[0])

    def whole(v: relax.Var) -> relax.Var:  # an input at every micro-batch of the step
        return relax.Var(v.name, relax.TensorType([B * accum, *[int(d) for d in v.ty.shape][1:]], v.ty.dtype))

    xs = [whole(v) for v in model_inputs]
    y = whole(micro[-1])
    weights = micro[n_inputs:-1]
    state_types = list(optim.params[2].ty.fields)
    states = [relax.Var(f"optim_state{i}", t) for i, t in enumerate(state_types)]
    lr = relax.Var("lr", optim.params[3].ty)
    first_trainable = len(weights) - n_trainable

    bb = relax.BlockBuilder(trainer)
    prefix_gv = bb.add_func(prefix, "frozen_prefix") if prefix is not None else None
    optim_gv = bb.add_func(optim, "update")
    with bb.function(STEP_FUNC, [*xs, *weights, *states, lr, y]):
        with bb.dataflow():
            loss, grads = None, None
            for i in range(accum):

                def part(v: relax.Var, i: int = i) -> relax.Expr:  # micro-batch i of a whole-step input
                    return v if accum == 1 else bb.emit(relax.op.strided_slice(v, axes=[0], begin=[i * B], end=[(i + 1) * B]))

                xi, yi = [part(v) for v in xs], part(y)
                if prefix is None:
                    inputs = xi
                else:  # what the frozen prefix computes, the differentiated rest's inputs
                    cut = bb.emit(relax.Call(prefix_gv, [*xi, *weights[: len(prefix.params) - len(xs)]]))
                    inputs = [bb.emit(relax.TupleGetItem(cut, j)) for j in range(n_inputs)]
                res = bb.emit(relax.Call(adjoint_gv, [*inputs, *weights, yi]))
                li = bb.emit(relax.TupleGetItem(res, 0))
                gi = [bb.emit(relax.TupleGetItem(bb.emit(relax.TupleGetItem(res, 1)), j)) for j in range(n_trainable)]
                loss = li if loss is None else _in_place(bb, accumulate_kernel, "accumulate", loss, li)
                grads = gi if grads is None else [_in_place(bb, accumulate_kernel, "accumulate", a, b) for a, b in zip(grads, gi)]
            assert grads is not None, "a step runs one micro-batch at least (accum >= 1)"
            if accum > 1:  # the mean over the effective batch, as one big batch would give
                loss = _in_place(bb, partial(scale_kernel, factor=1.0 / accum), "mean", loss)
                grads = [_in_place(bb, partial(scale_kernel, factor=1.0 / accum), "mean", g) for g in grads]
            old = relax.Tuple(weights[first_trainable:])
            upd = bb.emit(relax.Call(optim_gv, [old, relax.Tuple(grads), relax.Tuple(states), lr]))
            new_params = bb.emit(relax.TupleGetItem(upd, 0))
            new_states = bb.emit(relax.TupleGetItem(upd, 1))
            outs = [loss]
            outs += [bb.emit(relax.TupleGetItem(new_params, i)) for i in range(n_trainable)]
            outs += [bb.emit(relax.TupleGetItem(new_states, i)) for i in range(len(states))] + [lr]
            result = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(result)
    built = bb.get()
    inlined = {"backbone_loss_adjoint": adjoint, "update": optim} | ({"frozen_prefix": prefix} if prefix is not None else {})
    step = built[STEP_FUNC].inline_functions(inlined)
    kernels = {gv: f for gv, f in built.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    return step.with_attr("global_symbol", STEP_FUNC), state_types, kernels


def _in_place(
    bb: relax.BlockBuilder, kernel: Callable[..., tvm.tirx.PrimFunc], what: str, total: relax.Var, *more: relax.Var
) -> relax.Var:
    """`kernel` (`tir.accumulate_kernel`, `tir.scale_kernel`) run over `total` in place, one
    kernel per shape: micro-batch gradients summed, and made a mean, in the buffer they are in."""
    shape, dtype = [int(d) for d in total.ty.shape], str(total.ty.dtype)
    name = f"{what}_{dtype}_{'x'.join(map(str, shape)) or 'scalar'}"
    gv = next((g for g in bb.get().get_global_vars() if g.name_hint == name), None)
    if gv is None:
        gv = bb.add_func(kernel(shape, dtype, name=name), name)
    return bb.emit(relax.call_tir_inplace(gv, relax.Tuple([total, *more]), 0, out_ty=total.ty))
