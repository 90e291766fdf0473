"""What TVM's ONNX frontend writes that Relax cannot differentiate, rewritten into what it can.

- 1-D convolutions (a sensor window's Conv1d, an audio frame's) as 2-D ones of height 1. TVM
  0.27's Relax has no gradient for `relax.nn.conv1d`. A `[N, C, L]` signal is a `[N, C, 1, L]`
  image and a `[O, C/g, K]` kernel a `[O, C/g, 1, K]` one: the same products in the same order,
  so the 2-D convolution computes exactly the 1-D one, and gets conv2d's gradient (planner's,
  over the padding it reads: `gradients._conv2d_grad`) and its kernels: OpenBLAS's im2col GEMMs
  and the schedules every 2-D convolution has, instead of scalar loops.
- A concatenation of one tensor (GPT-2's attention concatenates the key with an empty cache) as
  the tensor: TVM's concat gradient returns a tensor where its gradient pass expects a tuple.
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


def for_training(func: relax.Function) -> relax.Function:
    """`func` with every 1-D convolution a 2-D one of height 1 and every lone concatenation its
    tensor (see the module's docstring)."""
    return _LoneConcat().visit_expr(_Conv1dAsConv2d().visit_expr(func))
