"""Gradients TVM 0.27 lacks, gets wrong, or keeps more memory for, set as Relax's own op attributes.

Each is checked against float64 finite differences (tests/test_gradients.py) and, in the models
PyTorch exports, against PyTorch autograd (tests/test_pytorch_families.py). They are in force only
inside `installed()`, which the training graph builder holds while it builds: other TVM users in
the process keep TVM's gradients.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import tvm
from tvm import relax
from tvm.relax.op.grad import no_grad

# ReLU and Clip (ReLU6) take their mask from the output, as PyTorch's in-place ReLU does: TVM's
# own ReLU gradient reads the input, so the backward pass kept every pre-activation alive next to
# the activation itself — one activation tensor too many per ReLU, and the input of a fused
# conv + BN + ReLU kernel is exactly the tensor fusion would not otherwise have to write.


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


_TVM_CONV2D_GRAD = tvm.ir.Op.get("relax.nn.conv2d").get_attr("FPrimalGradient")


def _conv2d_grad(orig_var, orig_call, output_grad, ctx):
    """TVM's conv2d gradient, over the padding the convolution really reads.

    A strided convolution can leave its last padded rows and columns unread (3x3, stride 2, pad 1
    on an even size: the bottom and right padding). TVM's weight gradient is a convolution over the
    full padding that yields a 4x4 kernel and slices it to 3x3 — 16/9 of the work, and the
    slice a kernel of its own. The same convolution with the unread padding dropped has the same
    output and an exact weight gradient (and its input gradient needs no output padding).
    """
    a = orig_call.attrs
    data, weight = orig_call.args
    trimmed = list(a.padding)
    for axis, (before, after) in enumerate(((0, 2), (1, 3))):
        size, kernel = int(data.ty.shape[2 + axis]), int(weight.ty.shape[2 + axis])
        span = (kernel - 1) * int(a.dilation[axis]) + 1
        unread = (size + int(a.padding[before]) + int(a.padding[after]) - span) % int(a.strides[axis])
        trimmed[after] = int(a.padding[after]) - min(int(a.padding[after]), unread)
    if trimmed != [int(p) for p in a.padding]:
        orig_call = relax.op.nn.conv2d(
            data, weight, a.strides, trimmed, a.dilation, a.groups, a.data_layout, a.kernel_layout, a.out_layout, a.out_dtype
        )
    return _TVM_CONV2D_GRAD(orig_var, orig_call, output_grad, ctx)


def _shape(expr: relax.Expr) -> list[int]:
    return [int(d) for d in expr.ty.shape]


def _squeeze_grad(orig_var, orig_call, output_grad, ctx):
    """y = squeeze(x): dy/dx puts the removed unit axes back."""
    return [relax.op.reshape(output_grad, _shape(orig_call.args[0]))]


def _ints(expr: relax.Expr) -> list[int]:
    """The integers of a strided_slice argument (a tuple of PrimValues or a shape)."""
    items = expr.fields if isinstance(expr, relax.Tuple) else expr.values
    return [int(getattr(v, "value", v)) for v in items]


def _strided_slice_grad(orig_var, orig_call, output_grad, ctx):
    """y = x[begin:end:step] along `axes`: dy/dx is the output gradient put back where the slice
    came from, zeros elsewhere. Built from reshapes and padding only: along a strided axis each
    gradient value gets `step - 1` zeros after it (a unit axis padded, then merged), the run is
    cut or padded to the slice's end, then padded by its start. (TVM's slice_scatter would read
    past the end of its source for an even-sized `x[..., ::2]`.)"""
    x, axes, begin, end, *rest = orig_call.args
    shape = _shape(x)
    steps = _ints(rest[0]) if rest else [1] * len(_ints(axes))
    grad = output_grad
    current = _shape(output_grad)  # the shape of `grad` as each axis is put back
    for axis, b, e, step in zip(_ints(axes), _ints(begin), _ints(end), steps):
        axis %= len(shape)
        if step < 1:
            raise ValueError("planner has no gradient for a reversing slice (negative step)")
        start = min(max(b + shape[axis] if b < 0 else b, 0), shape[axis])
        stop = min(max(e + shape[axis] if e < 0 else e, 0), shape[axis])
        taken = len(range(start, stop, step))
        if step > 1 and taken > 0:  # value k at position k * step
            spread = [0] * (2 * (len(current) + 1))
            spread[2 * (axis + 1) + 1] = step - 1
            grad = relax.op.nn.pad(relax.op.expand_dims(grad, axis + 1), spread)
            current[axis] = taken * step
            grad = relax.op.reshape(grad, current)
        run = min(current[axis], shape[axis] - start)  # the last value's trailing zeros may overhang
        if run < current[axis]:
            grad = relax.op.strided_slice(grad, axes=[axis], begin=[0], end=[run])
        pad = [0] * (2 * len(shape))
        pad[2 * axis], pad[2 * axis + 1] = start, shape[axis] - start - run
        if any(pad):
            grad = relax.op.nn.pad(grad, pad)
        current[axis] = shape[axis]
    return [grad, no_grad(axes), no_grad(begin), no_grad(end), *(no_grad(r) for r in rest)]


def _take_grad(orig_var, orig_call, output_grad, ctx):
    """y = take(x, indices, axis). A constant scalar index (a class-token select, `qkv[0]`) puts
    the gradient back as one slice, zero-padded; an index tensor of any rank is flattened to the
    one-dimensional form TVM's scatter-add (`take_backward`) accepts."""
    x, indices = orig_call.args
    shape = _shape(x)
    axis = int(orig_call.attrs.axis) % len(shape)  # the ONNX frontend always gives one
    index_shape = _shape(indices)
    if not index_shape and isinstance(indices, tvm.ir.Constant):
        i = int(indices.value.numpy()) % shape[axis]
        pad = [0] * (2 * len(shape))
        pad[2 * axis], pad[2 * axis + 1] = i, shape[axis] - i - 1
        return [relax.op.nn.pad(relax.op.expand_dims(output_grad, axis), pad), no_grad(indices)]
    count = math.prod(index_shape)
    grad = relax.op.reshape(output_grad, [*shape[:axis], count, *shape[axis + 1 :]])
    flat = relax.op.clip(relax.op.reshape(indices, [count]), 0, shape[axis] - 1)  # as the forward clamps them
    return [relax.op.grad.take_backward(grad, x, flat, axis), no_grad(indices)]


def _layer_norm_grad(orig_var, orig_call, output_grad, ctx):
    """y = (x - mean) * rstd * gamma + beta over the trailing `axes`, mean and rstd recomputed
    from x (in float32, whatever x is: a half-precision variance overflows): dx = rstd * (g -
    mean(g) - xhat * mean(g * xhat)) with g = dy * gamma; dgamma and dbeta are dy * xhat and dy
    summed over the leading axes. TVM's lowering always scales by gamma and shifts by beta
    (whatever the `scale`/`center` flags say), and so does this gradient."""
    x, gamma, beta = orig_call.args
    rank = len(_shape(x))
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
    dgamma = relax.op.reshape(relax.op.sum(dy * xhat, leading), _shape(gamma))
    dbeta = relax.op.reshape(relax.op.sum(dy, leading), _shape(beta))

    def back(e: relax.Expr, like: relax.Expr) -> relax.Expr:
        return e if like.ty.dtype == "float32" else relax.op.astype(e, like.ty.dtype)

    return [back(dx, x), back(dgamma, gamma), back(dbeta, beta)]


def _trilu_grad(orig_var, orig_call, output_grad, ctx):
    """y = tril(x, k) or triu(x, k): a mask of x's positions, so dy/dx is the same mask of the
    output gradient. TVM 0.27 has none for tril, and its triu gradient returns one partial for the
    op's two arguments (x and the PrimValue k), which its gradient pass rejects."""
    k = orig_call.args[1]
    return [relax.Call(orig_call.op, [output_grad, k]), no_grad(k)]


def _is_float(expr: relax.Expr) -> bool:
    return str(expr.ty.dtype).startswith(("float", "bfloat"))


def _astype_grad(orig_var, orig_call, output_grad, ctx):
    """y = astype(x, dtype): between float types dy/dx casts the output gradient back to x's type;
    a cast to or from an integer or boolean type passes none. TVM's gradient casts the gradient
    into the integer type and hands it upstream, where an argmax (no gradient) behind the cast
    fails the whole pass, and a float -> int -> float round trip would pass a truncated gradient
    for what is a step function."""
    x = orig_call.args[0]
    if not (_is_float(x) and _is_float(orig_var)):
        return [no_grad(x)]
    return [relax.op.astype(output_grad, x.ty.dtype)]


def _gather_nd_grad(orig_var, orig_call, output_grad, ctx):
    """y = gather_nd(x, indices) (batch_dims 0): each index tuple picks a slice of x, so dx is
    the output gradient scatter-added into zeros of x's shape (a slice picked twice gets both).
    Each index is clamped to its axis first: TVM's scatter_nd writes wherever an index points."""
    x, indices = orig_call.args
    if int(orig_call.attrs.batch_dims) != 0:
        raise ValueError("planner's gather_nd gradient takes batch_dims 0 only")
    depth = _shape(indices)[-1]
    dtype = str(indices.ty.dtype)
    last = relax.const([d - 1 for d in _shape(x)[:depth]], dtype)
    clamped = relax.op.minimum(relax.op.maximum(indices, relax.const(0, dtype)), last)
    return [relax.op.scatter_nd(relax.op.zeros_like(x), clamped, output_grad, "add"), no_grad(indices)]


# op -> (planner's gradient, whether it replaces TVM's own): the others fill gaps in TVM 0.27 and
# leave a gradient a later TVM has alone.
_GRADIENTS = {
    "relax.clip": (_clip_grad, False),
    "relax.erf": (_erf_grad, False),
    "relax.nn.gelu": (_gelu_grad, False),
    "relax.squeeze": (_squeeze_grad, False),
    "relax.strided_slice": (_strided_slice_grad, False),
    "relax.nn.layer_norm": (_layer_norm_grad, False),
    "relax.tril": (_trilu_grad, False),
    "relax.gather_nd": (_gather_nd_grad, False),
    "relax.nn.relu": (_relu_grad, True),  # from the output (see above)
    "relax.nn.conv2d": (_conv2d_grad, True),  # over the padding the convolution reads
    "relax.take": (_take_grad, True),  # TVM's takes one-dimensional indices only
    "relax.triu": (_trilu_grad, True),  # TVM's returns too few partials
    "relax.astype": (_astype_grad, True),  # TVM's passes gradients into integer paths
}
_ATTR = "FPrimalGradient"
_TVM_LEVEL = 10  # the level TVM registers its own gradients at (`register_gradient`'s default)

_lock = threading.Lock()
_users = 0  # planner differentiations in progress, in any thread
_theirs: dict[str, object | None] = {}  # while installed: what each op planner set had before (None: nothing)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Planner's gradients in force for the duration, TVM's own again after, even on an exception.

    Relax keeps one gradient per op for the whole process, so registering planner's for good
    (`register_gradient`) changed TVM's ReLU, conv2d, take, triu and astype gradients for every
    other TVM user in the process. The first of planner's differentiations in progress (in any
    thread: planner builds in several, and nests this freely) sets planner's gradients; the last to
    end puts back exactly what each op had, or none where TVM has none. Between the two no gradient
    changes, so a gradient pass running in another planner thread never sees one half set.
    """
    global _users
    with _lock:
        if not _users:
            _install()
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if not _users:
                _restore()


def _install() -> None:
    try:
        for name, (grad, replaces) in _GRADIENTS.items():
            op = tvm.ir.Op.get(name)
            theirs = op.get_attr(_ATTR)
            if theirs is not None and not replaces:
                continue
            _theirs[name] = theirs
            op.reset_attr(_ATTR)  # (TVM refuses a second value at the same level and ignores one at a lower)
            op.set_attr(_ATTR, grad, _TVM_LEVEL + 1)
    except BaseException:
        _restore()
        raise


def _restore() -> None:
    for name, theirs in _theirs.items():
        op = tvm.ir.Op.get(name)
        op.reset_attr(_ATTR)
        if theirs is not None:
            op.set_attr(_ATTR, theirs, _TVM_LEVEL)
    _theirs.clear()
