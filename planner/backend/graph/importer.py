"""ONNX -> Relax: a model imported by TVM's ONNX frontend, made ready to differentiate, once per batch.

TVM's frontend writes some ops in forms Relax cannot differentiate or planner's passes trip on (a
Clip as TIR with its bounds' NaN guards, a clamp as maximum/minimum, gathers in `fast` mode that
read out of range); they are rewritten here, once, as the model is imported for a batch size.
Others it writes as TIR kernels of its own (`call_tir` of a padding, a tile, an einsum): an
import is the Relax function *and* those kernels, which every module built from it must carry.
Imports are kept for the last few (model, batch) pairs: a study's candidates share a few batches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from planner.backend.graph.rewrites import for_training, scalar
from planner.errors import CandidateFailed, PlannerBug, last_line
from planner.inputs.model import Model


@dataclass(frozen=True)
class Imported:
    """A model as Relax: `func(*inputs, *parameters)`, and the TIR kernels its `call_tir`s name
    (the frontend's own lowering of a padding, a tile, an einsum), which every module holding
    `func` must hold too (`with_kernels`)."""

    func: relax.Function
    kernels: tuple[tuple[tvm.ir.GlobalVar, tvm.tirx.PrimFunc], ...] = ()

    def with_kernels(self, functions: dict[str, relax.Function], attrs: dict | None = None) -> tvm.IRModule:
        """A module of `functions` (by name) and the import's kernels."""
        mod = tvm.IRModule(functions, attrs=attrs)
        for gv, kernel in self.kernels:
            mod[gv] = kernel
        return mod


# (model key, batch) -> the model imported for that batch, the least recently used dropped first:
# a study's candidates take a few batch sizes (a space lists three or four, gradient accumulation
# divides them), so 16 keep every one of a study's, with room for a second model, and a
# long-lived process does not keep every graph it ever imported.
_IMPORTED: OrderedDict[tuple[str, int], Imported] = OrderedDict()
_IMPORTS_KEPT = 16
_IMPORTED_LOCK = threading.Lock()  # builds run in several threads
# Relax's Python block builder keeps one "current" builder per process, which every function built
# with `with bb.function(...)` sets: TVM's ONNX frontend, a task's loss, planner's own functions.
# Two trials building at once (parallel boards; a memory estimate beside a compile) broke each other
# ("BlockBuilder.current() must be self", an assertion in the frontend) and a candidate was blamed.
# Every such build holds this lock (re-entrant: a step's build imports its model inside it).
BUILDING = threading.RLock()
_CHECK_BATCH = 2  # the batch `check_importable` imports at: the ops TVM must read are the same at any batch


def check_importable(model: Model) -> None:
    """Raise now, not in every trial, when TVM's ONNX frontend cannot read the model: a planner
    bug (`PlannerBug`), as `load_model` has refused every operator the table does not accept."""
    if model.unbound:  # a sequence length the data has not set yet: the ops TVM must read are the same at any
        model = model.bind([[d if isinstance(d, int) else _CHECK_BATCH for d in i.shape] for i in model.inputs], "a check")
    imported(model, model.fixed_batch or _CHECK_BATCH)


def imported(model: Model, batch: int) -> Imported:
    """The model as one Relax function `(*inputs, *parameters)` for a step of `batch` samples; imported
    once per model and batch while it is among the last `_IMPORTS_KEPT` used (shapes are folded for
    the batch, see `planner.fixups`)."""
    key = (model.key, batch)
    with BUILDING:
        with _IMPORTED_LOCK:
            if key in _IMPORTED:
                _IMPORTED.move_to_end(key)
                return _IMPORTED[key]
        try:
            result = to_relax(model.import_proto(batch))
        except _FrontendError as exc:  # every operator of the model is one the operator table accepts
            raise PlannerBug(
                f"TVM could not import {model.path.name}, whose every operator the operator table accepts", str(exc)
            ) from None
        expected = len(model.inputs) + len(model.initializers)
        if len(result.func.params) != expected:  # the frontend keeps initializers in graph order
            raise CandidateFailed(f"ONNX import produced {len(result.func.params)} parameters, expected {expected}")
        with _IMPORTED_LOCK:
            _IMPORTED[key] = result
            if len(_IMPORTED) > _IMPORTS_KEPT:
                _IMPORTED.popitem(last=False)
    return result


class _FrontendError(Exception):
    """TVM's ONNX frontend refused the graph (the message is its last line)."""


def to_relax(proto: onnx.ModelProto) -> Imported:
    """An ONNX graph as planner differentiates it: TVM's import, every initializer left a
    parameter (`func(*inputs, *initializers)` in graph order), then planner's rewrites (here and
    in `planner.backend.graph.rewrites`). `proto` is a graph as `planner.inputs.fixups.for_import`
    writes it: shapes fixed, constants folded."""
    try:
        mod = from_onnx(proto, keep_params_in_input=True)
    except Exception as exc:  # the frontend raises assorted types for ops it does not know
        raise _FrontendError(last_line(exc)) from None
    mod, _ = relax.frontend.detach_params(mod)
    mod = _untangle_clip(mod)
    func = for_training(mod["main"]).without_attr("params").without_attr("num_input")
    kernels = tuple((gv, f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    return Imported(func, kernels)


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
        low, high = scalar(lo), scalar(hi)
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
