"""Gradients of normalizations."""

from __future__ import annotations

from tvm import relax

from planner.backend.graph.gradients._common import Gradients, dims


def _layer_norm_grad(orig_var, orig_call, output_grad, ctx):
    """y = (x - mean) * rstd * gamma + beta over the trailing `axes`, mean and rstd recomputed
    from x (in float32, whatever x is: a half-precision variance overflows): dx = rstd * (g -
    mean(g) - xhat * mean(g * xhat)) with g = dy * gamma; dgamma and dbeta are dy * xhat and dy
    summed over the leading axes. TVM's lowering always scales by gamma and shifts by beta
    (whatever the `scale`/`center` flags say), and so does this gradient."""
    x, gamma, beta = orig_call.args
    rank = len(dims(x))
    axes = sorted(int(d) % rank for d in orig_call.attrs.axes)
    if axes != list(range(rank - len(axes), rank)):
        raise ValueError(f"planner's layer_norm gradient normalises trailing axes only, not {axes}")
    dtype = x.ty.dtype

    def f32(e: relax.Expr) -> relax.Expr:
        return e if dtype == "float32" else relax.op.astype(e, "float32")

    xf, dy = f32(x), f32(output_grad)
    mean = relax.op.mean(xf, axes, keepdims=True)
    centred = xf - mean
    eps = relax.const(float(orig_call.attrs.epsilon), "float32")
    rstd = relax.op.rsqrt(relax.op.mean(centred * centred, axes, keepdims=True) + eps)
    xhat = centred * rstd
    g = dy * f32(gamma)
    dx = rstd * (g - relax.op.mean(g, axes, keepdims=True) - xhat * relax.op.mean(g * xhat, axes, keepdims=True))
    leading = list(range(rank - len(axes)))
    dgamma = relax.op.reshape(relax.op.sum(dy * xhat, leading), dims(gamma))
    dbeta = relax.op.reshape(relax.op.sum(dy, leading), dims(beta))

    def back(e: relax.Expr, like: relax.Expr) -> relax.Expr:
        return e if like.ty.dtype == "float32" else relax.op.astype(e, like.ty.dtype)

    return [back(dx, x), back(dgamma, gamma), back(dbeta, beta)]


GRADIENTS: Gradients = {"relax.nn.layer_norm": (_layer_norm_grad, False)}
