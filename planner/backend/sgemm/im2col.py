"""The data side of the OpenBLAS convolutions (`gemm_kernels`): a convolution's sizes (`Conv`) and
the TVMScript macros that move a tile's data between the tensors and a thread's workspace, where
sgemm reads and writes it: im2col (the input's columns), gather and scatter (a tile's output
gradient copied in, its output copied out), col2im (columns added back onto the input gradient).

They are apart from the kernels because they are the index arithmetic of padding, strides and
taps that all three kernels share; each group of macros is made per `Conv`, whose sizes are
constants in the TVMScript. TVMScript parses this module as it is on disk, so `gemm._source_id`
hashes it with the kernels' module.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

import planner.backend.tvmscript  # noqa: F401 - its macros then find their parser without reading source files


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
    def p(self) -> int:  # output pixels per image
        return self.oh * self.ow

    @property
    def pointwise(self) -> bool:
        """A 1x1 convolution of stride 1, unpadded: an image's columns are its input as it lies
        (channels `p` floats apart), so a product can read them there, with no im2col copy."""
        return (self.kh, self.kw, self.sh, self.sw, self.pt, self.pl, self.oh, self.ow) == (1, 1, 1, 1, 0, 0, self.h, self.w)

    @property
    def flops(self) -> int:
        return 2 * self.n * self.o * self.k * self.p


def im2col_macro(s: Conv):
    """`im2col(x, ws, base, ld, ni, y0, r, off, k0, kt)`: rows k0 .. k0 + kt of image ni's
    columns for output rows y0 .. y0 + r, into ws[base + (kr - k0) * ld + off + pixel]; zero
    where a tap reads the padding (clamped loads and a select: no branch per element). Run by
    one thread on its own tile."""
    taps = s.kh * s.kw

    @T.macro
    def im2col(x, ws, base, ld, ni, y0, r, off, k0, kt):
        # per column row (channel, tap) and output row: zeros left and right of the taps that
        # read the image, a strided copy between (affine loads: LLVM vectorizes the copy)
        for kr in range(kt):
            for yi in range(r):
                if (y0 + yi) * s.sh - s.pt + (k0 + kr) // s.kw % s.kh >= 0 and (y0 + yi) * s.sh - s.pt + (
                    k0 + kr
                ) // s.kw % s.kh < s.h:
                    for xi in range(T.min(T.max(s.pl - (k0 + kr) % s.kw + s.sw - 1, 0) // s.sw, s.ow)):
                        ws[base + kr * ld + off + yi * s.ow + xi] = T.float32(0)
                    for xi in range(
                        T.min(T.max(s.pl - (k0 + kr) % s.kw + s.sw - 1, 0) // s.sw, s.ow),
                        T.max(
                            T.min((s.w - 1 + s.pl - (k0 + kr) % s.kw) // s.sw + 1, s.ow),
                            T.min(T.max(s.pl - (k0 + kr) % s.kw + s.sw - 1, 0) // s.sw, s.ow),
                        ),
                    ):
                        ws[base + kr * ld + off + yi * s.ow + xi] = x[
                            ni,
                            (k0 + kr) // taps,
                            (y0 + yi) * s.sh - s.pt + (k0 + kr) // s.kw % s.kh,
                            xi * s.sw - s.pl + (k0 + kr) % s.kw,
                        ]
                    for xi in range(
                        T.max(
                            T.min((s.w - 1 + s.pl - (k0 + kr) % s.kw) // s.sw + 1, s.ow),
                            T.min(T.max(s.pl - (k0 + kr) % s.kw + s.sw - 1, 0) // s.sw, s.ow),
                        ),
                        s.ow,
                    ):
                        ws[base + kr * ld + off + yi * s.ow + xi] = T.float32(0)
                else:
                    for xi in T.vectorized(s.ow):
                        ws[base + kr * ld + off + yi * s.ow + xi] = T.float32(0)

    image = T.int64(s.n * s.c * s.h * s.w)

    @T.macro
    def im2col_shifted(x, ws, base, ld, ni, y0, r, off, k0, kt):
        # stride 1, as wide as the image: a tap's columns for output rows y0 .. y0 + r are the
        # channel's rows shifted by (ki - pt, kj - pl), one contiguous run in both. One flat copy
        # of the rows the tap reads, then zeros over the rows above or below the image and the
        # column the shift wrapped around from the neighbouring row. (Per output row, as above,
        # a third to a half of a 16-channel kernel's time went to rows 32 floats long.)
        flat = T.decl_buffer((image,), "float32", data=x.data)
        for kr in range(kt):
            ya = T.min(T.max(s.pt - (k0 + kr) // s.kw % s.kh - y0, 0), r)  # the first row the tap reads
            yb = T.max(T.min(s.h + s.pt - (k0 + kr) // s.kw % s.kh - y0, r), ya)  # ... and the last + 1
            left = T.max(s.pl - (k0 + kr) % s.kw, 0)  # columns of left padding the tap reads
            right = T.max((k0 + kr) % s.kw - s.pl, 0)  # ... of right padding
            for e in range(ya * s.ow):
                ws[base + kr * ld + off + e] = T.float32(0)
            for e in range(T.max((yb - ya) * s.ow - left - right, 0)):
                ws[base + kr * ld + off + ya * s.ow + left + e] = flat[
                    ((ni * s.c + (k0 + kr) // taps) * s.h + y0 - s.pt + (k0 + kr) // s.kw % s.kh + ya) * s.w
                    + left
                    + (k0 + kr) % s.kw
                    - s.pl
                    + e
                ]
            for e in range((r - yb) * s.ow):
                ws[base + kr * ld + off + yb * s.ow + e] = T.float32(0)
            for yi in range(yb - ya):
                for xi in range(left):
                    ws[base + kr * ld + off + (ya + yi) * s.ow + xi] = T.float32(0)
                for xi in range(right):
                    ws[base + kr * ld + off + (ya + yi) * s.ow + s.ow - right + xi] = T.float32(0)

    shifted = s.sh == s.sw == 1 and s.ow == s.w
    return im2col_shifted if shifted else im2col


def copy_macros(s: Conv):
    """(gather, scatter), each run by one thread on its own tile:

    - `gather(src, ws, base, ld, ni, off, y0, r)`: rows y0 .. y0 + r of src[ni] (channels ×
      pixels) into ws[base + ch * ld + off + pixel];
    - `scatter(ws, base, ld, dst, ni, off, y0, r)`: the reverse, into dst[ni]."""
    # rows y0 .. y0 + r of a channel are one contiguous run, in the image and in the workspace: one
    # flat loop each, which LLVM vectorizes at the machine's width. (Row by row, each row a
    # vector as wide as the image, LLVM unrolled a few channels' copies fully: a 1x1
    # convolution's kernel to 180 KiB in 5 s of code generation.)
    size = s.n * s.o * s.oh * s.ow

    @T.macro
    def gather(src, ws, base, ld, ni, off, y0, r):
        flat = T.decl_buffer((size,), "float32", data=src.data)
        for ch in range(s.o):
            for e in range(r * s.ow):
                ws[base + ch * ld + off + e] = flat[((ni * s.o + ch) * s.oh + y0) * s.ow + e]

    @T.macro
    def scatter(ws, base, ld, dst, ni, off, y0, r):
        flat = T.decl_buffer((size,), "float32", data=dst.data)
        for ch in range(s.o):
            for e in range(r * s.ow):
                flat[((ni * s.o + ch) * s.oh + y0) * s.ow + e] = ws[base + ch * ld + off + e]

    return gather, scatter


def col2im_macro(s: Conv):
    """`col2im(ws, base, ld, dx, ni, y0, r, off)`: each column entry added onto the input pixel
    its tap read (dx[ni] zeroed by the caller first). Run by one thread on its own tile."""

    @T.macro
    def col2im(ws, base, ld, dx, ni, y0, r, off):
        # per column row and output row: only the taps that read the image add (no test per element)
        for ci in range(s.c):
            for ki in range(s.kh):
                for kj in range(s.kw):
                    for yi in range(r):
                        if (y0 + yi) * s.sh - s.pt + ki >= 0 and (y0 + yi) * s.sh - s.pt + ki < s.h:
                            for xi in range(
                                T.min(T.max(s.pl - kj + s.sw - 1, 0) // s.sw, s.ow),
                                T.max(
                                    T.min((s.w - 1 + s.pl - kj) // s.sw + 1, s.ow),
                                    T.min(T.max(s.pl - kj + s.sw - 1, 0) // s.sw, s.ow),
                                ),
                            ):
                                dx[ni, ci, (y0 + yi) * s.sh - s.pt + ki, xi * s.sw - s.pl + kj] = (
                                    dx[ni, ci, (y0 + yi) * s.sh - s.pt + ki, xi * s.sw - s.pl + kj]
                                    + ws[base + ((ci * s.kh + ki) * s.kw + kj) * ld + off + yi * s.ow + xi]
                                )

    return col2im


@T.macro
def no_copy(a0, a1, a2, a3, a4, a5, a6, a7):
    """In place of `gather` or `scatter` when a `single` tile's product reads or writes in place."""
    T.evaluate(0)


@T.macro
def no_im2col(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
    """In place of `im2col` when a product reads a `pointwise` convolution's columns in x."""
    T.evaluate(0)


@T.macro
def no_zeroing(a0, a1):
    """In place of zeroing dx where a product writes it whole."""
    T.evaluate(0)
