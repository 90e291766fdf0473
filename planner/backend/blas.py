"""Dense convolutions as im2col + OpenBLAS sgemm (prototype, issue 16).

A step's kernel calls `scipy_cblas_sgemm` (OpenBLAS from the `scipy-openblas32` wheel, x86-64 and
AArch64) through `call_extern`; the symbol stays undefined in the step's library and resolves
when the session has loaded OpenBLAS globally (`load`).
"""

from __future__ import annotations

import ctypes
import functools

import tvm
from tvm import relax
from tvm.script import tirx as T

GEMM = "scipy_cblas_sgemm"
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
BLOCKS = 2  # GEMM row blocks per image: the pool's threads on this host
MAX_KERNEL = 7  # larger "kernels" are weight gradients written as convolutions: another GEMM shape


@functools.cache
def load() -> bool:
    """OpenBLAS loaded into this process with its symbols global (False: not installed)."""
    try:
        import scipy_openblas32
    except ImportError:
        return False
    lib = ctypes.CDLL(f"{scipy_openblas32.get_lib_dir()}/libscipy_openblas.so", mode=ctypes.RTLD_GLOBAL)
    lib.scipy_openblas_set_num_threads(1)  # each call runs on one of TVM's pool threads
    return True


def _applies(call: relax.Call) -> bool:
    a = call.attrs
    shapes = [call.args[0].ty.shape, call.args[1].ty.shape, call.ty.shape]
    return (
        (a.data_layout, a.kernel_layout, a.out_layout) == ("NCHW", "OIHW", "NCHW")
        and int(a.groups) == 1
        and all(int(d) == 1 for d in a.dilation)
        and call.args[0].ty.dtype == call.args[1].ty.dtype == "float32"
        and all(isinstance(d, tvm.tirx.IntImm) for s in shapes for d in s)
        and max(int(d) for d in list(shapes[1])[2:]) <= MAX_KERNEL
    )


def _kernel(n: int, c: int, h: int, w: int, o: int, kh: int, kw: int, oh: int, ow: int, sh: int, sw: int, pt: int, pl: int):
    """One image at a time: im2col into a workspace of one image's columns (parallel over channel
    and kernel row, vectorized along the output row; the index arithmetic written inline, since
    TVM miscompiles a vectorized let), then the GEMM in `BLOCKS` row blocks of the output
    channels, one per pool thread, each a single-threaded sgemm (OpenBLAS runs inside TVM's pool,
    never beside it)."""
    k, p = c * kh * kw, oh * ow
    ob = -(-o // BLOCKS)

    @T.prim_func(private=True)
    def conv2d_gemm(
        x: T.Buffer((n, c, h, w), "float32"), wt: T.Buffer((o, c, kh, kw), "float32"), y: T.Buffer((n, o, oh, ow), "float32")
    ):
        T.func_attr({"tir.noalias": True, "tir.is_scheduled": True, "op_pattern": 8})  # opaque: never fused
        for ni in range(n):
            col = T.decl_buffer((k * p,), "float32")
            for ck in T.parallel(c * kh):
                for kj in range(kw):
                    for yi in range(oh):
                        for xi in T.vectorized(ow):
                            col[((ck * kw + kj) * oh + yi) * ow + xi] = T.if_then_else(
                                (yi * sh - pt + ck % kh >= 0)
                                and (yi * sh - pt + ck % kh < h)
                                and (xi * sw - pl + kj >= 0)
                                and (xi * sw - pl + kj < w),
                                x[
                                    ni,
                                    ck // kh,
                                    T.max(T.min(yi * sh - pt + ck % kh, h - 1), 0),
                                    T.max(T.min(xi * sw - pl + kj, w - 1), 0),
                                ],
                                T.float32(0),
                            )
            for b in T.parallel(BLOCKS):
                T.evaluate(
                    T.call_extern(
                        "int32",
                        GEMM,
                        ROW_MAJOR,
                        NO_TRANS,
                        NO_TRANS,
                        T.min(ob, o - b * ob),
                        p,
                        k,
                        T.float32(1),
                        T.address_of(wt[b * ob, 0, 0, 0]),
                        k,
                        col.data,
                        p,
                        T.float32(0),
                        T.address_of(y[ni, b * ob, 0, 0]),
                        p,
                    )
                )

    return conv2d_gemm


def _weight_grad_kernel(
    n: int, c: int, h: int, w: int, o: int, kh: int, kw: int, oh: int, ow: int, sh: int, sw: int, pt: int, pl: int
):
    """The weight gradient dW[o, c, i, j] = sum over images and output pixels of dy[n, o, y, x] *
    xpad[n, c, y*sh + i, x*sw + j] (TVM writes it as a CNHW/IOHW convolution of x by dy): per
    image, the forward im2col of x for a (kh, kw) kernel, then dW += dy_n . col^T as row blocks of
    output channels, one single-threaded sgemm per pool thread (beta 0 for the first image)."""
    k, p = c * kh * kw, oh * ow
    ob = -(-o // BLOCKS)

    @T.prim_func(private=True)
    def conv2d_weight_grad_gemm(
        x: T.Buffer((n, c, h, w), "float32"), dy: T.Buffer((n, o, oh, ow), "float32"), dw: T.Buffer((o, c, kh, kw), "float32")
    ):
        T.func_attr({"tir.noalias": True, "tir.is_scheduled": True, "op_pattern": 8})  # opaque: never fused
        for ni in range(n):
            col = T.decl_buffer((k * p,), "float32")
            for ck in T.parallel(c * kh):
                for kj in range(kw):
                    for yi in range(oh):
                        for xi in T.vectorized(ow):
                            col[((ck * kw + kj) * oh + yi) * ow + xi] = T.if_then_else(
                                (yi * sh - pt + ck % kh >= 0)
                                and (yi * sh - pt + ck % kh < h)
                                and (xi * sw - pl + kj >= 0)
                                and (xi * sw - pl + kj < w),
                                x[
                                    ni,
                                    ck // kh,
                                    T.max(T.min(yi * sh - pt + ck % kh, h - 1), 0),
                                    T.max(T.min(xi * sw - pl + kj, w - 1), 0),
                                ],
                                T.float32(0),
                            )
            for b in T.parallel(BLOCKS):
                T.evaluate(
                    T.call_extern(
                        "int32",
                        GEMM,
                        ROW_MAJOR,
                        NO_TRANS,
                        TRANS,
                        T.min(ob, o - b * ob),
                        k,
                        p,
                        T.float32(1),
                        T.address_of(dy[ni, b * ob, 0, 0]),
                        p,
                        col.data,
                        p,
                        T.Select(ni == 0, T.float32(0), T.float32(1)),
                        T.address_of(dw[b * ob, 0, 0, 0]),
                        k,
                    )
                )

    return conv2d_weight_grad_gemm


def _input_grad_kernel(
    n: int, c: int, h: int, w: int, o: int, kh: int, kw: int, oh: int, ow: int, sh: int, sw: int, pt: int, pl: int
):
    """The input gradient (TVM's conv2d_transpose of dy by the OIHW weight): per image, the column
    gradient W^T . dy_n (row blocks of the columns, one single-threaded sgemm per pool thread),
    then col2im as a gather: each input pixel sums the column entries of the taps that read it,
    parallel over channel rows, the index arithmetic inline."""
    k, p = c * kh * kw, oh * ow
    kb = -(-k // BLOCKS)

    @T.prim_func(private=True)
    def conv2d_input_grad_gemm(
        dy: T.Buffer((n, o, oh, ow), "float32"), wt: T.Buffer((o, c, kh, kw), "float32"), dx: T.Buffer((n, c, h, w), "float32")
    ):
        T.func_attr({"tir.noalias": True, "tir.is_scheduled": True, "op_pattern": 8})  # opaque: never fused
        for ni in range(n):
            col = T.decl_buffer((k * p,), "float32")
            for b in T.parallel(BLOCKS):
                T.evaluate(
                    T.call_extern(
                        "int32",
                        GEMM,
                        ROW_MAJOR,
                        TRANS,
                        NO_TRANS,
                        T.min(kb, k - b * kb),
                        p,
                        o,
                        T.float32(1),
                        T.address_of(wt[0, (b * kb) // (kh * kw), (b * kb) // kw % kh, (b * kb) % kw]),
                        k,
                        T.address_of(dy[ni, 0, 0, 0]),
                        p,
                        T.float32(0),
                        T.address_of(col[b * kb * p]),
                        p,
                    )
                )
            for cy in T.parallel(c * h):
                for xi in range(w):
                    dx[ni, cy // h, cy % h, xi] = T.float32(0)
                    for ki in range(kh):
                        for kj in range(kw):
                            dx[ni, cy // h, cy % h, xi] = dx[ni, cy // h, cy % h, xi] + T.if_then_else(
                                ((cy % h + pt - ki) % sh == 0)
                                and (cy % h + pt - ki >= 0)
                                and ((cy % h + pt - ki) // sh < oh)
                                and ((xi + pl - kj) % sw == 0)
                                and (xi + pl - kj >= 0)
                                and ((xi + pl - kj) // sw < ow),
                                col[
                                    (((cy // h) * kh + ki) * kw + kj) * p
                                    + T.max(T.min((cy % h + pt - ki) // sh, oh - 1), 0) * ow
                                    + T.max(T.min((xi + pl - kj) // sw, ow - 1), 0)
                                ],
                                T.float32(0),
                            )

    return conv2d_input_grad_gemm


def conv2d_transpose(bb: relax.BlockBuilder, call: relax.Call, fallback) -> relax.Expr:
    """TVM's conv2d input gradient (NCHW dy, IOHW view of the OIHW weight) through OpenBLAS;
    anything else to `fallback`."""
    a = call.attrs
    shapes = [call.args[0].ty.shape, call.args[1].ty.shape, call.ty.shape]
    if not (
        (a.data_layout, a.kernel_layout, a.out_layout) == ("NCHW", "IOHW", "NCHW")
        and int(a.groups) == 1
        and all(int(d) == 1 for d in a.dilation)
        and call.args[0].ty.dtype == call.args[1].ty.dtype == "float32"
        and all(isinstance(d, tvm.tirx.IntImm) for s in shapes for d in s)
    ):
        return fallback(bb, call)
    n, o, oh, ow = (int(d) for d in call.args[0].ty.shape)
    _, c, kh, kw = (int(d) for d in call.args[1].ty.shape)
    _, _, h, w = (int(d) for d in call.ty.shape)
    sh, sw = (int(s) for s in a.strides)
    func = _input_grad_kernel(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))
    gv = bb.add_func(func, "conv2d_input_grad_gemm")
    return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)


def _weight_grad(call: relax.Call) -> bool:
    """TVM's conv2d weight gradient: x (CNHW view) convolved by dy (IOHW view), CNHW out."""
    a = call.attrs
    shapes = [call.args[0].ty.shape, call.args[1].ty.shape, call.ty.shape]
    return (
        (a.data_layout, a.kernel_layout, a.out_layout) == ("CNHW", "IOHW", "CNHW")
        and int(a.groups) == 1
        and all(int(s) == 1 for s in a.strides)
        and call.args[0].ty.dtype == call.args[1].ty.dtype == "float32"
        and all(isinstance(d, tvm.tirx.IntImm) for s in shapes for d in s)
    )


def conv2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """`relax.nn.conv2d` as im2col + OpenBLAS sgemm (see `_kernel`); anything else falls back to
    TVM's own legalization."""
    a = call.attrs
    if _weight_grad(call):
        n, c, h, w = (int(d) for d in call.args[0].ty.shape)
        _, o, oh, ow = (int(d) for d in call.args[1].ty.shape)
        _, _, kh, kw = (int(d) for d in call.ty.shape)
        sh, sw = (int(d) for d in a.dilation)
        func = _weight_grad_kernel(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))
        gv = bb.add_func(func, "conv2d_weight_grad_gemm")
        return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)
    if not _applies(call):
        return tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")(bb, call)
    n, c, h, w = (int(d) for d in call.args[0].ty.shape)
    o, _, kh, kw = (int(d) for d in call.args[1].ty.shape)
    _, _, oh, ow = (int(d) for d in call.ty.shape)
    sh, sw = (int(s) for s in a.strides)
    gv = bb.add_func(_kernel(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1])), "conv2d_gemm")
    return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)
