"""Dense convolutions as im2col + OpenBLAS sgemm (prototype, issue 16).

A step's kernel calls `scipy_cblas_sgemm` (OpenBLAS from the `scipy-openblas32` wheel, x86-64 and
AArch64) through `call_extern`; the symbol stays undefined in the step's library and resolves
when the session has loaded OpenBLAS globally (`load`).
"""

from __future__ import annotations

import ctypes
import functools

import tvm
from tvm import relax, te, tirx

GEMM = "scipy_cblas_sgemm"
ROW_MAJOR, NO_TRANS = 101, 111
MAX_KERNEL = 7  # larger "kernels" are weight gradients written as convolutions: another GEMM shape


@functools.cache
def load() -> bool:
    """OpenBLAS loaded into this process with its symbols global (False: not installed)."""
    try:
        import scipy_openblas32
    except ImportError:
        return False
    ctypes.CDLL(f"{scipy_openblas32.get_lib_dir()}/libscipy_openblas.so", mode=ctypes.RTLD_GLOBAL)
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


def conv2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """`relax.nn.conv2d` as one kernel: im2col into a workspace, one sgemm over the batch, the
    result copied into NCHW. Anything else falls back to TVM's own legalization."""
    if not _applies(call):
        return tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")(bb, call)
    a = call.attrs
    n, c, h, w = (int(d) for d in call.args[0].ty.shape)
    o, _, kh, kw = (int(d) for d in call.args[1].ty.shape)
    _, _, oh, ow = (int(d) for d in call.ty.shape)
    sh, sw = (int(s) for s in a.strides)
    pt, pl = int(a.padding[0]), int(a.padding[1])
    k, p = c * kh * kw, oh * ow

    x = te.placeholder((n, c, h, w), "float32", "x")
    wt = te.placeholder((o, c, kh, kw), "float32", "w")

    def im2col(ci, ki, kj, ni, yi, xi):
        iy, ix = yi * sh - pt + ki, xi * sw - pl + kj
        inside = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        value = x[ni, ci, tirx.max(tirx.min(iy, h - 1), 0), tirx.max(tirx.min(ix, w - 1), 0)]
        return tirx.Select(inside, value, tirx.const(0, "float32"))

    col = te.compute((c, kh, kw, n, oh, ow), im2col, name="im2col")
    buffers = [
        tirx.decl_buffer(wt.shape, "float32", "wb", elem_offset=0),
        tirx.decl_buffer(col.shape, "float32", "cb", elem_offset=0),
        tirx.decl_buffer((o, n * p), "float32", "yb", elem_offset=0),
    ]

    def gemm(ins, outs):
        wb, cb = ins
        one, zero = tirx.const(1, "float32"), tirx.const(0, "float32")
        return tirx.Evaluate(
            tirx.call_extern(
                "int32",
                GEMM,
                ROW_MAJOR,
                NO_TRANS,
                NO_TRANS,
                o,
                n * p,
                k,
                one,
                wb.access_ptr("r"),
                k,
                cb.access_ptr("r"),
                n * p,
                zero,
                outs[0].access_ptr("w"),
                n * p,
            )
        )

    flat = te.extern((o, n * p), [wt, col], gemm, name="sgemm", dtype="float32", in_buffers=buffers[:2], out_buffers=[buffers[2]])
    y = te.compute((n, o, oh, ow), lambda ni, oi, yi, xi: flat[oi, ni * p + yi * ow + xi], name="nchw")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, wt, y]))
    loops = sch.get_loops(sch.get_sblock("im2col"))
    sch.parallel(sch.fuse(loops[0], loops[1]))
    sch.vectorize(loops[5])
    loops = sch.get_loops(sch.get_sblock("nchw"))
    sch.parallel(sch.fuse(loops[0], loops[1]))
    sch.vectorize(loops[3])
    func = sch.mod["main"].without_attr("global_symbol").with_attr("tir.is_scheduled", True)
    gv = bb.add_func(func, "conv2d_gemm")
    return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)
