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

from planner.backend.graph.gradients._common import Gradients, dims, is_float


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


def _gelu_tanh_grad(orig_var, orig_call, output_grad, ctx):
    """y = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3):
    dy/dx = (1 + t)/2 + x/2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(u)."""
    x = orig_call.args[0]
    dtype = x.ty.dtype

    def c(v: float) -> relax.Constant:
        return relax.const(v, dtype)

    x2 = x * x
    t = relax.op.tanh(c(math.sqrt(2.0 / math.pi)) * (x + c(0.044715) * x2 * x))
    slope = c(0.5) * (c(1.0) + t) + c(0.5) * x * (c(1.0) - t * t) * c(math.sqrt(2.0 / math.pi)) * (c(1.0) + c(3 * 0.044715) * x2)
    return [output_grad * slope]


def _leakyrelu_grad(orig_var, orig_call, output_grad, ctx):
    """y = x where x > 0, alpha x elsewhere (any alpha, one above 1 included)."""
    x = orig_call.args[0]
    dtype = x.ty.dtype
    alpha = relax.const(float(orig_call.attrs.alpha), dtype)
    return [relax.op.where(relax.op.greater(x, relax.const(0.0, dtype)), output_grad, output_grad * alpha)]


def _prelu_grad(orig_var, orig_call, output_grad, ctx):
    """y = x where x > 0, alpha[c] x elsewhere, alpha along `axis`: dx as a leaky ReLU's, and
    dalpha[c] the sum of x dy over the negative inputs of channel c (a one-element alpha: of all)."""
    x, alpha = orig_call.args
    dtype = x.ty.dtype
    rank = len(dims(x))
    axis = int(orig_call.attrs.axis) % rank
    channels = dims(alpha)[0]
    spread = [channels if i == axis else 1 for i in range(rank)]
    positive = relax.op.greater(x, relax.const(0.0, dtype))
    zero = relax.op.zeros_like(output_grad)
    slope = relax.op.reshape(alpha, spread)
    dx = relax.op.where(positive, output_grad, output_grad * slope)
    dalpha = relax.op.reshape(relax.op.collapse_sum_to(relax.op.where(positive, zero, x * output_grad), spread), [channels])
    return [dx, dalpha]


def _where_grad(orig_var, orig_call, output_grad, ctx):
    """y = where(c, a, b): da is dy where c holds, db where it does not, each summed over the
    axes it was broadcast along (TVM's keeps the output's shape, which a broadcast parameter — a
    bias, a filler constant — cannot take)."""
    cond, a, b = orig_call.args
    zero = relax.op.zeros_like(output_grad)

    def back(grad: relax.Expr, like: relax.Expr) -> relax.Expr:
        if dims(like) != dims(output_grad):
            grad = relax.op.collapse_sum_to(grad, dims(like))
        return grad if like.ty.dtype == output_grad.ty.dtype else relax.op.astype(grad, like.ty.dtype)

    return [no_grad(cond), back(relax.op.where(cond, output_grad, zero), a), back(relax.op.where(cond, zero, output_grad), b)]


def _zero_grad(orig_var, orig_call, output_grad, ctx):
    """A step function (floor, ceil, round, sign): its derivative is zero wherever it exists, as
    PyTorch's backward gives it."""
    return [relax.op.zeros_like(orig_call.args[0])]


def _mod_grad(orig_var, orig_call, output_grad, ctx):
    """y = x mod c (truncated or floored): dy/dx = 1 wherever y is continuous. The divisor gets
    none: the operator table passes no gradient to it, so no trained tensor lies behind it."""
    x, c = orig_call.args
    return [output_grad, relax.op.zeros_like(c)]


def _unary(derivative):
    """The gradient of y = f(x) with f'(x) = `derivative(x, one)` (`one`: 1 in x's dtype)."""

    def grad(orig_var, orig_call, output_grad, ctx):
        x = orig_call.args[0]
        return [output_grad * derivative(x, relax.const(1.0, x.ty.dtype))]

    return grad


_TRIGONOMETRY = {
    "relax.tan": lambda x, one: one + relax.op.tan(x) * relax.op.tan(x),
    "relax.atan": lambda x, one: one / (one + x * x),
    "relax.asin": lambda x, one: one / relax.op.sqrt(one - x * x),
    "relax.acos": lambda x, one: relax.op.negative(one / relax.op.sqrt(one - x * x)),
    "relax.asinh": lambda x, one: one / relax.op.sqrt(x * x + one),
    "relax.acosh": lambda x, one: one / relax.op.sqrt(x * x - one),
    "relax.atanh": lambda x, one: one / (one - x * x),
}


def _no_grad_grad(orig_var, orig_call, output_grad, ctx):
    """y = no_grad(x) in a forward pass: none for x. The mark stops the gradient pass where a
    value's gradient is given rather than derived (`planner.backend.graph.head`)."""
    return [no_grad(orig_call.args[0])]


GRADIENTS: Gradients = {
    "relax.grad.no_grad": (_no_grad_grad, False),
    **{op: (_unary(derivative), False) for op, derivative in _TRIGONOMETRY.items()},
    **{op: (_zero_grad, False) for op in ("relax.floor", "relax.ceil", "relax.round", "relax.sign")},
    "relax.mod": (_mod_grad, False),
    "relax.floor_mod": (_mod_grad, False),
    "relax.clip": (_clip_grad, False),
    "relax.erf": (_erf_grad, False),
    "relax.nn.gelu": (_gelu_grad, False),
    "relax.nn.gelu_tanh": (_gelu_tanh_grad, False),
    "relax.nn.leakyrelu": (_leakyrelu_grad, False),
    "relax.nn.prelu": (_prelu_grad, False),
    "relax.where": (_where_grad, True),  # TVM's ignores broadcasting
    "relax.nn.relu": (_relu_grad, True),  # from the output (see above)
    "relax.astype": (_astype_grad, True),  # TVM's passes gradients into integer paths
}
