"""Dense convolutions, forward and both gradients, as im2col + OpenBLAS `sgemm`.

TVM's default lowering of a 3×3 convolution reached 7–20 % of numpy's float32 matmul speed on this
host, and its weight gradient (a convolution by the output gradient) less; OpenBLAS's sgemm
reaches numpy's own speed on the same shapes (docs/benchmarks.md, "Kernel libraries for dense
convolutions"). So a float32 NCHW convolution, ungrouped and undilated, becomes one kernel that
writes the input's columns (im2col) into a workspace and multiplies them by the weight:

- forward: y_n = W · col(x_n);
- weight gradient (TVM writes it as a CNHW/IOHW convolution of x by dy): dW += dy_n · col(x_n)ᵀ;
- input gradient (TVM's `conv2d_transpose` of dy by the IOHW view of W): col = Wᵀ · dy_n, then
  each column entry added back onto the input pixel it came from (col2im).

The columns are built a band of output rows at a time, at most `BAND_BYTES` per kernel whatever
the batch or image size: the workspace is counted in the step's planned memory like any other, so
it must stay small. Each product is split into one block of rows per pool thread, each block one
single-threaded sgemm call (`T.parallel`): OpenBLAS runs inside TVM's thread pool, never beside it.

The kernels are marked scheduled and opaque (`op_pattern` 8): no schedule or fusion touches them.
Their index arithmetic is written inline: TVM miscompiled the same lets under `T.vectorized`.
Everything else (grouped, dilated, other dtypes or layouts, symbolic shapes) falls back to the
lowering planner uses without OpenBLAS.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.script import tirx as T

GEMM = "scipy_cblas_sgemm"  # OpenBLAS's cblas_sgemm in scipy-openblas32's symbol namespace
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
BAND_BYTES = 256 * 1024  # the column workspace of one band (an L2 cache's worth)
MAX_KERNEL = 7  # a forward kernel larger than this is not a layer's: another GEMM shape entirely
FLOPS = "planner.flops"  # function attribute: the kernel's multiply-adds × 2, for the profile
CALLS = "planner.calls"  # function attribute: the library a kernel calls (the step must link it)

Lowering = Callable[[relax.BlockBuilder, relax.Call], relax.Expr]


@dataclass(frozen=True)
class Conv:
    """One convolution's sizes: x (n, c, h, w) by w (o, c, kh, kw) into y (n, o, oh, ow), with
    strides (sh, sw) and leading padding (pt, pl); the trailing padding follows from the sizes."""

    n: int
    c: int
    h: int
    w: int
    o: int
    kh: int
    kw: int
    oh: int
    ow: int
    sh: int
    sw: int
    pt: int
    pl: int

    @property
    def k(self) -> int:  # the GEMM's inner dimension: one column's length
        return self.c * self.kh * self.kw

    @property
    def rows(self) -> int:
        """Output rows per band: as many as fit `BAND_BYTES` of columns (at least one)."""
        return max(1, min(self.oh, BAND_BYTES // (4 * self.k * self.ow)))

    @property
    def flops(self) -> int:
        return 2 * self.n * self.o * self.k * self.oh * self.ow


def _static(call: relax.Call, layouts: tuple[str, str, str]) -> bool:
    """float32, ungrouped, in `layouts`, every shape known."""
    a = call.attrs
    shapes = [call.args[0].ty.shape, call.args[1].ty.shape, call.ty.shape]
    return (
        (a.data_layout, a.kernel_layout, a.out_layout) == layouts
        and int(a.groups) == 1
        and call.args[0].ty.dtype == call.args[1].ty.dtype == "float32"
        and all(isinstance(d, tvm.tirx.IntImm) for s in shapes for d in s)
    )


def _ints(shape) -> list[int]:
    return [int(d) for d in shape]


def pool_threads(target: tvm.target.Target) -> int:
    """GEMM blocks per product: the target's cores (`num-cores`), else this machine's."""
    cores = target.attrs.get("num-cores")
    return max(1, int(cores) if cores else os.cpu_count() or 1)


def calls_openblas(mod: tvm.IRModule) -> bool:
    """Whether any kernel of `mod` calls OpenBLAS."""
    return any(isinstance(f, tvm.tirx.PrimFunc) and f.attrs.get(CALLS) == "openblas" for _, f in mod.functions_items())


def _blocks(rows: int, threads: int) -> int:
    return -(-rows // threads)


def _im2col_macro(s: Conv):
    """Writes the columns of image `ni`, output rows y0 .. y0 + r, into `col` (k rows of
    `s.rows * ow`): zero where a tap reads the padding. Parallel over channel and kernel row,
    vectorized along the output row."""
    rows = s.rows

    @T.macro
    def im2col(x, col, ni, y0, r):
        for ck in T.parallel(s.c * s.kh):
            for kj in range(s.kw):
                for yi in range(r):
                    for xi in T.vectorized(s.ow):
                        col[((ck * s.kw + kj) * rows + yi) * s.ow + xi] = T.if_then_else(
                            ((y0 + yi) * s.sh - s.pt + ck % s.kh >= 0)
                            and ((y0 + yi) * s.sh - s.pt + ck % s.kh < s.h)
                            and (xi * s.sw - s.pl + kj >= 0)
                            and (xi * s.sw - s.pl + kj < s.w),
                            x[
                                ni,
                                ck // s.kh,
                                T.max(T.min((y0 + yi) * s.sh - s.pt + ck % s.kh, s.h - 1), 0),
                                T.max(T.min(xi * s.sw - s.pl + kj, s.w - 1), 0),
                            ],
                            T.float32(0),
                        )

    return im2col


def forward_kernel(s: Conv, threads: int) -> tvm.tirx.PrimFunc:
    """y_n = W · col(x_n), band by band; blocks of output channels on the pool's threads."""
    k, p, rows, band = s.k, s.oh * s.ow, s.rows, s.rows * s.ow
    bands, ob = -(-s.oh // rows), _blocks(s.o, threads)
    im2col = _im2col_macro(s)

    @T.prim_func(private=True)
    def conv2d_gemm(
        x: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
        wt: T.Buffer((s.o, s.c, s.kh, s.kw), "float32"),
        y: T.Buffer((s.n, s.o, s.oh, s.ow), "float32"),
    ):
        T.func_attr({"tir.noalias": True, "tir.is_scheduled": True, "op_pattern": 8, FLOPS: s.flops, CALLS: "openblas"})
        col = T.decl_buffer((k * band,), "float32")
        for ni in range(s.n):
            for bi in range(bands):
                im2col(x, col, ni, bi * rows, T.min(rows, s.oh - bi * rows))
                for b in T.parallel(threads):
                    T.evaluate(
                        T.call_extern(
                            "int32",
                            GEMM,
                            ROW_MAJOR,
                            NO_TRANS,
                            NO_TRANS,
                            T.max(T.min(ob, s.o - b * ob), 0),
                            T.min(rows, s.oh - bi * rows) * s.ow,
                            k,
                            T.float32(1),
                            T.address_of(wt[T.min(b * ob, s.o - 1), 0, 0, 0]),
                            k,
                            col.data,
                            band,
                            T.float32(0),
                            T.address_of(y[ni, T.min(b * ob, s.o - 1), bi * rows, 0]),
                            p,
                        )
                    )

    return conv2d_gemm


def weight_grad_kernel(s: Conv, threads: int) -> tvm.tirx.PrimFunc:
    """dW = Σ_n dy_n · col(x_n)ᵀ, band by band (beta 0 for the first band of the first image);
    blocks of output channels on the pool's threads."""
    k, p, rows, band = s.k, s.oh * s.ow, s.rows, s.rows * s.ow
    bands, ob = -(-s.oh // rows), _blocks(s.o, threads)
    im2col = _im2col_macro(s)

    @T.prim_func(private=True)
    def conv2d_weight_grad_gemm(
        x: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
        dy: T.Buffer((s.n, s.o, s.oh, s.ow), "float32"),
        dw: T.Buffer((s.o, s.c, s.kh, s.kw), "float32"),
    ):
        T.func_attr({"tir.noalias": True, "tir.is_scheduled": True, "op_pattern": 8, FLOPS: s.flops, CALLS: "openblas"})
        col = T.decl_buffer((k * band,), "float32")
        for ni in range(s.n):
            for bi in range(bands):
                im2col(x, col, ni, bi * rows, T.min(rows, s.oh - bi * rows))
                for b in T.parallel(threads):
                    T.evaluate(
                        T.call_extern(
                            "int32",
                            GEMM,
                            ROW_MAJOR,
                            NO_TRANS,
                            TRANS,
                            T.max(T.min(ob, s.o - b * ob), 0),
                            k,
                            T.min(rows, s.oh - bi * rows) * s.ow,
                            T.float32(1),
                            T.address_of(dy[ni, T.min(b * ob, s.o - 1), bi * rows, 0]),
                            p,
                            col.data,
                            band,
                            T.Select(ni + bi == 0, T.float32(0), T.float32(1)),
                            T.address_of(dw[T.min(b * ob, s.o - 1), 0, 0, 0]),
                            k,
                        )
                    )

    return conv2d_weight_grad_gemm


def input_grad_kernel(s: Conv, threads: int) -> tvm.tirx.PrimFunc:
    """dx_n = col2im(Wᵀ · dy_n), band by band: blocks of column rows on the pool's threads, then
    each column entry added onto the input pixel its tap read, parallel over input channels (a
    channel's entries land only in that channel: no two threads add into one pixel)."""
    k, p, rows, band = s.k, s.oh * s.ow, s.rows, s.rows * s.ow
    bands, kb = -(-s.oh // rows), _blocks(k, threads)
    taps = s.kh * s.kw

    @T.prim_func(private=True)
    def conv2d_input_grad_gemm(
        dy: T.Buffer((s.n, s.o, s.oh, s.ow), "float32"),
        wt: T.Buffer((s.o, s.c, s.kh, s.kw), "float32"),
        dx: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
    ):
        T.func_attr({"tir.noalias": True, "tir.is_scheduled": True, "op_pattern": 8, FLOPS: s.flops, CALLS: "openblas"})
        col = T.decl_buffer((k * band,), "float32")
        for ni in range(s.n):
            for cy in T.parallel(s.c * s.h):
                for xi in T.vectorized(s.w):
                    dx[ni, cy // s.h, cy % s.h, xi] = T.float32(0)
            for bi in range(bands):
                for b in T.parallel(threads):
                    T.evaluate(
                        T.call_extern(
                            "int32",
                            GEMM,
                            ROW_MAJOR,
                            TRANS,
                            NO_TRANS,
                            T.max(T.min(kb, k - b * kb), 0),
                            T.min(rows, s.oh - bi * rows) * s.ow,
                            s.o,
                            T.float32(1),
                            T.address_of(
                                wt[
                                    0,
                                    T.min(b * kb, k - 1) // taps,
                                    T.min(b * kb, k - 1) // s.kw % s.kh,
                                    T.min(b * kb, k - 1) % s.kw,
                                ]
                            ),
                            k,
                            T.address_of(dy[ni, 0, bi * rows, 0]),
                            p,
                            T.float32(0),
                            T.address_of(col[T.min(b * kb, k - 1) * band]),
                            band,
                        )
                    )
                for ci in T.parallel(s.c):
                    for ki in range(s.kh):
                        for kj in range(s.kw):
                            for yi in range(T.min(rows, s.oh - bi * rows)):
                                if (bi * rows + yi) * s.sh - s.pt + ki >= 0 and (bi * rows + yi) * s.sh - s.pt + ki < s.h:
                                    for xi in range(s.ow):
                                        if xi * s.sw - s.pl + kj >= 0 and xi * s.sw - s.pl + kj < s.w:
                                            dx[ni, ci, (bi * rows + yi) * s.sh - s.pt + ki, xi * s.sw - s.pl + kj] = (
                                                dx[ni, ci, (bi * rows + yi) * s.sh - s.pt + ki, xi * s.sw - s.pl + kj]
                                                + col[((ci * s.kh + ki) * s.kw + kj) * band + yi * s.ow + xi]
                                            )

    return conv2d_input_grad_gemm


def conv2d(bb: relax.BlockBuilder, call: relax.Call, *, fallback: Lowering, threads: int) -> relax.Expr:
    """`relax.nn.conv2d`: a layer's forward convolution, or TVM's weight gradient (x in a CNHW
    view convolved by dy in an IOHW view, dilated by the layer's stride), through OpenBLAS."""
    a = call.attrs
    if _static(call, ("CNHW", "IOHW", "CNHW")) and all(int(d) == 1 for d in a.strides):
        n, c, h, w = _ints(call.args[0].ty.shape)
        _, o, oh, ow = _ints(call.args[1].ty.shape)
        _, _, kh, kw = _ints(call.ty.shape)
        sh, sw = _ints(a.dilation)
        s = Conv(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))
        gv = bb.add_func(weight_grad_kernel(s, threads), "conv2d_weight_grad_gemm")
        return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)
    if (
        _static(call, ("NCHW", "OIHW", "NCHW"))
        and all(int(d) == 1 for d in a.dilation)
        and max(_ints(call.args[1].ty.shape)[2:]) <= MAX_KERNEL
    ):
        n, c, h, w = _ints(call.args[0].ty.shape)
        o, _, kh, kw = _ints(call.args[1].ty.shape)
        _, _, oh, ow = _ints(call.ty.shape)
        sh, sw = _ints(a.strides)
        s = Conv(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))
        gv = bb.add_func(forward_kernel(s, threads), "conv2d_gemm")
        return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)
    return fallback(bb, call)


def conv2d_transpose(bb: relax.BlockBuilder, call: relax.Call, *, fallback: Lowering, threads: int) -> relax.Expr:
    """`relax.nn.conv2d_transpose` as TVM's input gradient writes it (NCHW dy, the IOHW view of
    the layer's OIHW weight) through OpenBLAS."""
    a = call.attrs
    if not (_static(call, ("NCHW", "IOHW", "NCHW")) and all(int(d) == 1 for d in a.dilation)):
        return fallback(bb, call)
    n, o, oh, ow = _ints(call.args[0].ty.shape)
    _, c, kh, kw = _ints(call.args[1].ty.shape)
    _, _, h, w = _ints(call.ty.shape)
    sh, sw = _ints(a.strides)
    s = Conv(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))
    gv = bb.add_func(input_grad_kernel(s, threads), "conv2d_input_grad_gemm")
    return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)
