"""Gradients of convolutions."""

from __future__ import annotations

from tvm import relax

from planner.backend.graph.gradients._common import Gradients, dims


def _conv2d_grad(orig_var, orig_call, output_grad, ctx):
    """y = conv2d(x, w) (NCHW, OIHW; any stride, padding, dilation, groups): dx is the transposed
    convolution of dy, dw the convolution of x by dy with stride and dilation swapped (TVM's
    recipe), both over the padding the convolution really reads.

    TVM 0.27's own gradient leaves the dilation out of the transposed convolution's output
    padding, so every dilated convolution failed to build. And a strided convolution can leave its
    last padded rows and columns unread (3x3, stride 2, pad 1 on an even size: the bottom and right
    padding): TVM's weight gradient is then a convolution over the full padding that yields a 4x4
    kernel sliced to 3x3 — 16/9 of the work, and the slice a kernel of its own. Dropping the unread
    padding gives the same output, an exact weight gradient and an input gradient without it.
    """
    a = orig_call.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "OIHW", "NCHW"):
        raise ValueError(f"planner's conv2d gradient takes NCHW/OIHW, not {a.data_layout}/{a.kernel_layout}")
    data, weight = orig_call.args
    n, c, *size = dims(data)
    o, _, *kernel = dims(weight)
    _, _, *out = dims(orig_var)
    strides, dilation, groups = [int(v) for v in a.strides], [int(v) for v in a.dilation], int(a.groups)
    padding = [int(p) for p in a.padding]
    for axis, (before, after) in enumerate(((0, 2), (1, 3))):
        span = (kernel[axis] - 1) * dilation[axis] + 1
        unread = (size[axis] + padding[before] + padding[after] - span) % strides[axis]
        padding[after] -= min(padding[after], unread)
    reached = [(out[i] - 1) * strides[i] - padding[i] - padding[i + 2] + (kernel[i] - 1) * dilation[i] + 1 for i in range(2)]
    data_grad = relax.op.nn.conv2d_transpose(
        output_grad,
        weight,
        strides,
        padding,
        [size[i] - reached[i] for i in range(2)],  # input rows past the last window: no gradient
        dilation,
        groups,
        "NCHW",
        "IOHW",
        "NCHW",
        a.out_dtype,
    )
    if groups != 1:
        data = relax.op.reshape(data, (n, groups, c // groups, *size))
        data = relax.op.reshape(relax.op.permute_dims(data, [1, 0, 2, 3, 4]), (n * groups, c // groups, *size))
    weight_grad = relax.op.nn.conv2d(
        data,
        output_grad,
        strides=dilation,
        padding=padding,
        dilation=strides,
        groups=groups,
        out_dtype=a.out_dtype,
        data_layout="CNHW",
        kernel_layout="IOHW",
        out_layout="CNHW",
    )
    full = [(size[i] + padding[i] + padding[i + 2] - (out[i] - 1) * strides[i] - 1) // dilation[i] + 1 for i in range(2)]
    if full != kernel:  # taps past the kernel's reach, where the padding is long
        weight_grad = relax.op.strided_slice(weight_grad, axes=[0, 1, 2, 3], begin=[0, 0, 0, 0], end=[o, c // groups, *kernel])
    return [data_grad, weight_grad]


def _conv2d_transpose_grad(orig_var, orig_call, output_grad, ctx):
    """y = conv2d_transpose(x, w) (NCHW, IOHW): the adjoint of a convolution, so dx is the
    convolution of dy by w (same stride, dilation and groups) and dw the weight gradient of that
    convolution with x as its output gradient — `_conv2d_grad`'s recipe with the roles swapped.

    y is the full transposed convolution cropped by the padding, the last rows kept longer by the
    output padding: its adjoint pads dy back (crops it, where the output padding runs past the
    full result) before the convolution reads it."""
    a = orig_call.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "IOHW", "NCHW"):
        raise ValueError(f"planner's conv2d_transpose gradient takes NCHW/IOHW, not {a.data_layout}/{a.kernel_layout}")
    x, weight = orig_call.args
    pads = [int(p) for p in a.padding]
    extra = [int(p) for p in a.output_padding]
    grad = output_grad
    after = [pads[2] - extra[0], pads[3] - extra[1]]
    if any(v < 0 for v in after):  # output rows past the full result: they got nothing from x
        out = dims(output_grad)
        grad = relax.op.strided_slice(grad, axes=[2, 3], begin=[0, 0], end=[out[2] + min(after[0], 0), out[3] + min(after[1], 0)])
    padding = [pads[0], pads[1], max(after[0], 0), max(after[1], 0)]
    conv = ctx.normalize(
        relax.op.nn.conv2d(grad, weight, a.strides, padding, a.dilation, int(a.groups), "NCHW", "OIHW", "NCHW", a.out_dtype)
    )
    weight_grad = _conv2d_grad(conv, conv, x, ctx)[1]
    return [conv, weight_grad]


GRADIENTS: Gradients = {
    "relax.nn.conv2d": (_conv2d_grad, True),  # dilated ones, over the padding the convolution reads
    "relax.nn.conv2d_transpose": (_conv2d_transpose_grad, False),
}
