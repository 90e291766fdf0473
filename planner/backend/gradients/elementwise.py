"""Gradients of elementwise ops: activations and casts.

ReLU and Clip (ReLU6) take their mask from the output, as PyTorch's in-place ReLU does: TVM's own
ReLU gradient reads the input, so the backward pass kept every pre-activation alive next to the
activation itself — one activation tensor too many per ReLU, and the input of a fused
conv + BN + ReLU kernel is exactly the tensor fusion would not otherwise have to write.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.op.grad import no_grad

from planner.backend.gradients._common import Gradients, is_float


def _relu_grad(orig_var, orig_call, output_grad, ctx):
    """y = max(x, 0): dy/dx = 1 where y > 0."""
    zero = relax.const(0.0, orig_var.ty.dtype)
    return [relax.op.where(relax.op.greater(orig_var, zero), output_grad, relax.op.zeros_like(output_grad))]


def _clip_grad(orig_var, orig_call, output_grad, ctx):
    """y = clip(x, lo, hi): dy/dx = 1 where lo < y < hi (ReLU6, HardSwish, HardSigmoid)."""
    _, lo, hi = orig_call.args
    dtype = orig_var.ty.dtype

    def bound(prim: relax.PrimValue) -> relax.Constant:
        return relax.const(float(getattr(prim.value, "value", prim.value)), dtype)

    inside = relax.op.logical_and(relax.op.greater(orig_var, bound(lo)), relax.op.less(orig_var, bound(hi)))
    return [relax.op.where(inside, output_grad, relax.op.zeros_like(output_grad)), no_grad(lo), no_grad(hi)]


def _erf_grad(orig_var, orig_call, output_grad, ctx):
    """y = erf(x): dy/dx = 2/sqrt(pi) * exp(-x^2)."""
    x = orig_call.args[0]
    dtype = x.ty.dtype
    return [output_grad * relax.const(2.0 / math.sqrt(math.pi), dtype) * relax.op.exp(relax.op.negative(x * x))]


def _gelu_grad(orig_var, orig_call, output_grad, ctx):
    """y = x * Phi(x): dy/dx = Phi(x) + x * phi(x), Phi the normal CDF, phi its density."""
    x = orig_call.args[0]
    dtype = x.ty.dtype
    half = relax.const(0.5, dtype)
    cdf = half * (relax.const(1.0, dtype) + relax.op.erf(x * relax.const(1.0 / math.sqrt(2.0), dtype)))
    pdf = relax.const(1.0 / math.sqrt(2.0 * math.pi), dtype) * relax.op.exp(relax.op.negative(half * x * x))
    return [output_grad * (cdf + x * pdf)]


def _astype_grad(orig_var, orig_call, output_grad, ctx):
    """y = astype(x, dtype): between float types dy/dx casts the output gradient back to x's type;
    a cast to or from an integer or boolean type passes none. TVM's gradient casts the gradient
    into the integer type and hands it upstream, where an argmax (no gradient) behind the cast
    fails the whole pass, and a float -> int -> float round trip would pass a truncated gradient
    for what is a step function."""
    x = orig_call.args[0]
    if not (is_float(x) and is_float(orig_var)):
        return [no_grad(x)]
    return [relax.op.astype(output_grad, x.ty.dtype)]


GRADIENTS: Gradients = {
    "relax.clip": (_clip_grad, False),
    "relax.erf": (_erf_grad, False),
    "relax.nn.gelu": (_gelu_grad, False),
    "relax.nn.relu": (_relu_grad, True),  # from the output (see above)
    "relax.astype": (_astype_grad, True),  # TVM's passes gradients into integer paths
}
