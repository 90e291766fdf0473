"""What a step trains with: the loss, the optimizers, the learning rate taken at run time, and low precision.

TVM's `relax.training` builds the loss and optimizer functions; planner scales the loss for fp16,
retypes fp16 decisions as bf16, works around Adam's dtype, and replaces the learning rate compiled
into an optimizer by an argument, so that candidates differing only in lr share one compiled step.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.training.loss import Loss
from tvm.relax.training.optimizer import SGD, Adam, MomentumSGD, Optimizer

from planner.backend.graph.head import Head, cross_entropy
from planner.errors import CandidateFailed
from planner.tasks import Task
from planner.types import Candidate, Precision
from planner.types import Optimizer as OptimizerName

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


def low_precision(backbone: tvm.IRModule, precision: Precision, func: str) -> tuple[tvm.IRModule, float]:
    """The backbone (its function `func`) with convolutions and matmuls (and what follows them) in `precision`, and the
    loss scale its gradients need.

    Parameters stay fp32 master copies, cast inside the graph, so updates accumulate in fp32.
    fp16's narrow exponent range flushes small gradients to zero: its loss is scaled, and the
    caller unscales. bf16 has fp32's range and trains unscaled.
    """
    if precision in (Precision.FP32, Precision.INT8):  # int8: fake quantization, computed in fp32
        return backbone, 1.0
    mixed = relax.transform.ToMixedPrecision(out_dtype="float16")(backbone)
    if precision is Precision.FP16:
        return mixed, FP16_LOSS_SCALE
    out = tvm.IRModule(dict(mixed.functions_items()), attrs=backbone.attrs)  # the import's kernels too
    out[func] = _Fp16AsBf16().visit_expr(mixed[func])
    return out, 1.0


class _Graph:
    """What a task builds its loss with (`planner.tasks.LossGraph`): Relax's operators and a block builder."""

    op = relax.op

    def __init__(self, bb: relax.BlockBuilder) -> None:
        self.bb = bb

    def emit(self, expr: relax.Expr) -> relax.Var:
        return self.bb.emit(expr)

    def const(self, value: float, dtype: str = "float32") -> relax.Constant:
        return relax.const(value, dtype)

    def shape(self, expr: relax.Expr) -> tuple[int, ...]:
        return tuple(int(d) for d in expr.ty.shape)


class TaskLoss(Loss):
    """The task's mean loss (`planner.tasks.Task.loss`) times a constant: static loss scaling for
    fp16 training. With a `head` and its `chunk`, the backbone gives the head's input and weight
    (`head.Head.outputs`) and the loss is its token cross-entropy in chunks (`head.cross_entropy`)."""

    def __init__(self, task: Task, scale: float, head: Head | None = None, chunk: int = 0) -> None:
        super().__init__("loss", 1 if head is None else len(head.outputs), "mean")
        self.task, self.scale, self.head, self.chunk = task, scale, head, chunk
        self.kernels: dict[relax.GlobalVar, tvm.tirx.PrimFunc] = {}  # what the loss calls: `with_kernels` adds them

    def __call__(self, *types: relax.TensorType) -> relax.Function:
        bb = relax.BlockBuilder()
        values = [relax.Var(f"predictions{i}", t) for i, t in enumerate(types[:-1])]
        labels = relax.Var("targets", types[-1])
        with bb.function(self._loss_name, [*values, labels]):
            with bb.dataflow():
                if self.head is not None:
                    scale = relax.const(self.scale, "float32")
                    loss = cross_entropy(bb, self.head, values, labels, self.chunk, scale, self.kernels)
                else:
                    (outputs,) = values
                    floats = outputs if types[0].dtype == "float32" else bb.emit(relax.op.astype(outputs, "float32"))
                    loss = self.task.loss(_Graph(bb), floats, labels)
                    if self.scale != 1.0:
                        loss = bb.emit(loss * relax.const(self.scale, "float32"))
                out = bb.emit_output(loss)
            bb.emit_func_output(out)
        return bb.get()[self._loss_name]

    def with_kernels(self, mod: tvm.IRModule) -> tvm.IRModule:
        """`mod`, which holds this loss, with the kernels the loss calls."""
        for gv, kernel in self.kernels.items():
            mod[gv] = kernel
        return mod


class _Adam(Adam):
    """TVM 0.27's `Adam.init` hands NumPy a TVM dtype object; a dtype string works everywhere."""

    def _set_params_and_dtype(self, params: list[relax.Var]) -> None:
        super()._set_params_and_dtype(params)
        self.dtype: str = str(self.dtype)


_LR = float("nan")  # the learning rate TVM's optimizers are built with: a mark `runtime_lr` replaces


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


def runtime_lr(optim: relax.Function, dtype: str) -> relax.Function:
    """TVM's optimizer function (built with `_LR`) taking its learning rate as a fourth argument,
    a scalar of the optimizer's dtype."""
    lr = relax.Var("lr", relax.TensorType((), dtype))
    marked = _MarkedLr(lr)
    body = marked.visit_expr(optim.body)
    if not marked.replaced:
        raise CandidateFailed("the optimizer does not use its learning rate")
    return relax.Function([*optim.params, lr], body, optim.ret_ty, optim.is_pure, optim.attrs)


def fill(tensor) -> float:
    """Optimizer states start constant (zeros; Adam's running beta products at one)."""
    values = tensor.numpy().ravel()
    if values.size and not (values == values[0]).all():
        raise CandidateFailed("optimizer state does not start constant")
    return float(values[0]) if values.size else 0.0
