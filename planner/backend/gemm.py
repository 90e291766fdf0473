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

Each kernel is one parallel region over TVM's pool threads (`pool_threads`), and each thread works
on its own tiles in its own part of one workspace: it builds a tile's columns, multiplies them
with a single-threaded sgemm and writes its own outputs, never waiting for another thread
(OpenBLAS runs inside TVM's pool, never beside it: their two pools fought over the cores). A tile
is whole images side by side when images are small, else a band of output rows (`Tiles`); all
the threads' tiles together stay within about `BAND_BYTES` whatever the batch, since the
workspace is counted in the step's planned memory like any other buffer. The forward and input
gradient deal out images (or rows) to threads; the weight gradient deals out its columns, so no
two threads accumulate into one weight.

The kernels are marked scheduled and opaque (`op_pattern` 8): no schedule or fusion touches them.
Their index arithmetic is written inline: TVM miscompiled the same lets under `T.vectorized`.
Everything else (grouped, dilated, other dtypes or layouts, symbolic shapes) falls back to the
lowering planner uses without OpenBLAS.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path

import tvm
from tvm import relax
from tvm.script import tirx as T

from planner import cachefile

GEMM = "scipy_cblas_sgemm"  # OpenBLAS's cblas_sgemm in scipy-openblas32's symbol namespace
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
BAND_BYTES = 1024 * 1024  # all threads' tiles: a quarter of this ran up to 2x slower on 4x4 and 2x2 maps
PRIVATE_BYTES = 256 * 1024  # every thread's own copy of dW, in all, when a weight gradient is split by tiles
NARROW = 128  # dW columns per thread under which a weight gradient split by columns multiplies too thin a product
MIN_PIXELS = 256  # output pixels per image from which that thin product costs measurably (16x16 maps)
MAX_KERNEL = 7  # a forward kernel larger than this is not a layer's: another GEMM shape entirely
FLOPS = "planner.flops"  # function attribute: the kernel's multiply-adds × 2, for the profile
CALLS = "planner.calls"  # function attribute: the library a kernel calls (the step must link it)
CONV = "planner.conv"  # function attribute: the `Conv` a kernel computes, field by field

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
    def p(self) -> int:  # output pixels per image
        return self.oh * self.ow

    @property
    def flops(self) -> int:
        return 2 * self.n * self.o * self.k * self.p


@dataclass(frozen=True)
class Tiles:
    """How a kernel's columns are cut into per-thread tiles of at most `BAND_BYTES` in all.

    A tile is either `images` whole images side by side (small feature maps: one image's few
    pixels would make a product too thin for sgemm to run fast), or a band of `rows` output rows
    of one image. `width` is a tile's column count as laid out in its workspace."""

    images: int
    rows: int
    width: int

    @classmethod
    def of(cls, s: Conv, threads: int, rows_per_column: int) -> Tiles:
        """Tiles for `threads` workspaces of `rows_per_column` floats per column each. Whole
        images are dealt out evenly: as many tiles as a multiple of the threads needs, each
        as wide as that allows (8 images of 4 pixels, 2 threads: 4 and 4, never 6 and 2)."""
        cols = max(s.ow, BAND_BYTES // (4 * threads * rows_per_column))
        if cols >= s.p:
            most = max(1, min(s.n, cols // s.p))
            rounds = -(-s.n // (threads * most))
            images = -(-s.n // (threads * rounds))
            return cls(images, s.oh, images * s.p)
        rows = max(1, cols // s.ow)
        return cls(1, rows, rows * s.ow)

    def groups(self, s: Conv) -> int:
        return -(-s.n // self.images)

    def bands(self, s: Conv) -> int:
        return -(-s.oh // self.rows)

    # A tile is image group g (its images side by side) by row band b; in TIR expressions:

    def count(self, s: Conv, g):
        """Images in group g (the last may hold fewer)."""
        return T.min(self.images, s.n - g * self.images)

    def image(self, g, j):
        return g * self.images + j

    def row(self, b):
        """Band b's first output row."""
        return b * self.rows

    def span(self, s: Conv, b):
        """Output rows in band b (the last may hold fewer)."""
        return T.min(self.rows, s.oh - b * self.rows)

    def run(self, s: Conv) -> int:
        """Columns between one image's columns and the next's within a tile."""
        return self.rows * s.ow

    def columns(self, s: Conv, g, b):
        """The tile's columns: several whole images, or one image's band (never both)."""
        return self.count(s, g) * self.span(s, b) * s.ow

    @property
    def single(self) -> bool:
        """Whether a tile is one image's band: its output (or output gradient) is then a matrix
        in place, channels `s.p` apart, and the product reads or writes it there, not a copy."""
        return self.images == 1

    def out(self, s: Conv, buf, g, b):
        """Where the tile's outputs start in `buf` (n, o, oh, ow), for a `single` tile."""
        return T.address_of(buf[self.image(g, 0), 0, self.row(b), 0])

    def ld(self, s: Conv) -> int:
        """Floats between one channel's outputs and the next's as a product reads or writes them:
        in place for a `single` tile, else in the workspace."""
        return s.p if self.single else self.width


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
    """Threads a kernel splits its work into: the target's cores (`num-cores`), else this machine's."""
    cores = target.attrs.get("num-cores")
    return max(1, int(cores) if cores else os.cpu_count() or 1)


def calls_openblas(mod: tvm.IRModule) -> bool:
    """Whether any kernel of `mod` calls OpenBLAS."""
    return any(isinstance(f, tvm.tirx.PrimFunc) and f.attrs.get(CALLS) == "openblas" for _, f in mod.functions_items())


def _attrs(s: Conv) -> dict:
    return {
        "tirx.noalias": True,
        "tirx.is_scheduled": True,
        "op_pattern": 8,
        FLOPS: s.flops,
        CALLS: "openblas",
        CONV: list(astuple(s)),
    }


def _macros(s: Conv):
    """The data movement around the products, each run by one thread on its own tile:

    - `im2col(x, ws, base, ld, ni, y0, r, off, k0, kt)`: rows k0 .. k0 + kt of image ni's
      columns for output rows y0 .. y0 + r, into ws[base + (kr - k0) * ld + off + pixel]; zero
      where a tap reads the padding (clamped loads and a select: no branch per element);
    - `gather(src, ws, base, ld, ni, off, y0, r)`: rows y0 .. y0 + r of src[ni] (channels ×
      pixels) into ws[base + ch * ld + off + pixel];
    - `scatter(ws, base, ld, dst, ni, off, y0, r)`: the reverse, into dst[ni];
    - `col2im(ws, base, ld, dx, ni, y0, r, off)`: each column entry added onto the input pixel
      its tap read (dx[ni] zeroed by the caller first)."""
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

    shifted = s.sh == s.sw == 1 and s.ow == s.w
    return im2col_shifted if shifted else im2col, gather, scatter, col2im


@T.macro
def _nothing(a0, a1, a2, a3, a4, a5, a6, a7):
    """In place of `gather` or `scatter` when a `single` tile's product reads or writes in place."""
    T.evaluate(0)


def _sgemm(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc):
    return T.call_extern("int32", GEMM, ROW_MAJOR, ta, tb, m, n, k, T.float32(1), a, lda, b, ldb, beta, c, ldc)


def forward_kernel(s: Conv, threads: int) -> tvm.tirx.PrimFunc:
    """y_n = W · col(x_n). The pool's threads take the tiles in turn (contiguous shares), each
    building its own tile's columns, multiplying them into its workspace and copying the product
    out image by image: one parallel region, no thread waits for another."""
    k, o = s.k, s.o
    t = Tiles.of(s, threads, k + o)
    per = t.width * (k + (0 if t.single else o))  # one thread's workspace: columns, then the product
    bands = t.bands(s)
    tiles = t.groups(s) * bands
    share = -(-tiles // threads)
    im2col, _, scatter, _ = _macros(s)
    scatter, product = _in_place(s, t, scatter, lambda th: th * per + k * t.width)

    @T.prim_func(private=True)
    def conv2d_gemm(
        x: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
        wt: T.Buffer((o, s.c, s.kh, s.kw), "float32"),
        y: T.Buffer((s.n, o, s.oh, s.ow), "float32"),
    ):
        T.func_attr(_attrs(s))
        ws = T.decl_buffer((threads * per,), "float32")
        for th in T.parallel(threads):
            for i in range(th * share, T.min((th + 1) * share, tiles)):
                for j in range(t.count(s, i // bands)):
                    im2col(
                        x,
                        ws,
                        th * per,
                        t.width,
                        t.image(i // bands, j),
                        t.row(i % bands),
                        t.span(s, i % bands),
                        j * t.run(s),
                        0,
                        k,
                    )
                T.evaluate(
                    _sgemm(
                        NO_TRANS,
                        NO_TRANS,
                        o,
                        t.columns(s, i // bands, i % bands),
                        k,
                        wt.data,
                        k,
                        T.address_of(ws[th * per]),
                        t.width,
                        T.float32(0),
                        product(y, ws, th, i // bands, i % bands),
                        t.ld(s),
                    )
                )
                for j in range(t.count(s, i // bands)):
                    scatter(
                        ws,
                        th * per + k * t.width,
                        t.width,
                        y,
                        t.image(i // bands, j),
                        j * t.run(s),
                        t.row(i % bands),
                        t.span(s, i % bands),
                    )

    return conv2d_gemm


def weight_grad_kernel(s: Conv, threads: int, accumulate: bool = False) -> tvm.tirx.PrimFunc:
    """dW = Σ_n dy_n · col(x_n)ᵀ (or, `accumulate`, dW += that: a micro-batch's gradient added
    to the running sum where it lies, see `accumulate_in_place`), in one of two ways so that no two threads add into one weight
    and none waits for another while multiplying:

    - split by its columns (kernel taps × input channels): each thread builds only its rows of
      every tile's columns and accumulates into only its part of dW — as its rows of dWᵀ,
      written out at the end, where all of dW fits in `PRIVATE_BYTES` (`_weight_grad_tile`);
    - split by tiles, where that split would leave each thread fewer than `NARROW` columns of
      dW (16 input channels of a 3×3 layer on 2 threads: 72) on maps of `MIN_PIXELS` or more,
      and every thread's own copy of dW fits in `PRIVATE_BYTES`: each thread builds
      whole columns of its own tiles and accumulates into its own dW; the copies are summed at
      the end. Why: ResNet-8's 16-channel weight gradients ran split by columns at a quarter of
      numpy's speed, a fifth of its batch-32 step; by tiles 1.3–1.6× faster. On small maps and
      wide dW it gained nothing measurable and costs the copies' memory (`_by_tiles`).

    A `single` tile's dy is multiplied in place; several images side by side are gathered."""
    k, o = s.k, s.o
    if _by_tiles(s, threads):
        return _weight_grad_by_tiles(s, threads, accumulate)
    kb = -(-k // threads)  # dW columns per thread
    t = Tiles.of(s, threads, kb + o)
    cols = t.width * (kb + (0 if t.single else o))  # one thread's workspace: its rows of the columns, then dy
    # where dW fits a copy of its rows per thread (dWᵀ, `_weight_grad_tile`): accumulated there and
    # written out at the end; else dW's columns, strided, accumulated where they belong
    transposed = o * k * 4 <= PRIVATE_BYTES
    per = cols + (kb * o if transposed else 0)
    tile = _weight_grad_tile(s, t, lambda th: th * per, lambda th: th * per + kb * t.width, transposed=transposed)

    def out(ws, dw, th):
        if transposed:
            return T.address_of(ws[th * per + cols])
        return T.address_of(dw[0, th * kb // (s.kh * s.kw), th * kb // s.kw % s.kh, th * kb % s.kw])

    @T.macro
    def write_out(ws, flat, th):
        for oi, kk in T.grid(o, T.min(kb, k - th * kb)):
            flat[oi * k + th * kb + kk] = ws[th * per + cols + kk * o + oi]

    @T.macro
    def add_out(ws, flat, th):
        for oi, kk in T.grid(o, T.min(kb, k - th * kb)):
            flat[oi * k + th * kb + kk] = flat[oi * k + th * kb + kk] + ws[th * per + cols + kk * o + oi]

    @T.macro
    def in_place(ws, flat, th):
        T.evaluate(0)

    finish = (add_out if accumulate else write_out) if transposed else in_place
    first = 1.0 if accumulate and not transposed else 0.0  # the first tile's beta: dW's own values kept, or not

    @T.prim_func(private=True)
    def conv2d_weight_grad_gemm(
        x: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
        dy: T.Buffer((s.n, o, s.oh, s.ow), "float32"),
        dw: T.Buffer((o, s.c, s.kh, s.kw), "float32"),
    ):
        T.func_attr(_attrs(s))
        ws = T.decl_buffer((threads * per,), "float32")
        flat = T.decl_buffer((o * k,), "float32", data=dw.data)
        for th in T.parallel(threads):
            if th * kb < k:
                for i in range(t.groups(s) * t.bands(s)):
                    tile(
                        x,
                        dy,
                        ws,
                        th,
                        i,
                        th * kb,
                        T.min(kb, k - th * kb),
                        T.Select(i == 0, T.float32(first), T.float32(1)),
                        out(ws, dw, th),
                    )
                finish(ws, flat, th)

    return conv2d_weight_grad_gemm


def _by_tiles(s: Conv, threads: int) -> bool:
    """Whether `weight_grad_kernel` splits dW by tiles (measured per shape, side by side with the
    column split, in docs/benchmarks.md)."""
    return threads > 1 and s.k // threads < NARROW and s.p >= MIN_PIXELS and threads * s.o * s.k * 4 <= PRIVATE_BYTES


def limits() -> tuple[int, ...]:
    """The module's tiling limits: a kernel made under other limits is another kernel."""
    return (BAND_BYTES, PRIVATE_BYTES, NARROW, MIN_PIXELS)


def _weight_grad_tile(s: Conv, t: Tiles, at: Callable, dy_at: Callable, *, transposed: bool = False):
    """A weight gradient's work on tile i for thread th: rows k0 .. k0 + kt of the tile's columns
    at workspace offset `at(th)`, its dy (gathered at `dy_at(th)` unless `single`), and their
    product added (`beta` 1, or 0: written) into `out`: dW's rows `s.k` apart, or `transposed`,
    dWᵀ's rows `s.o` apart. Why dWᵀ where it is free to lay out: col · dyᵀ (the columns as the
    product's long side) ran 1.3-1.45x faster in OpenBLAS than dy · colᵀ on 16-64 channels."""
    bands = t.bands(s)
    im2col, gather, _, _ = _macros(s)
    gather, gradient = _in_place(s, t, gather, dy_at)

    def product(dy, ws, th, i, kt, beta, out):
        """dW's rows (dy · colᵀ, rows `s.k` apart) or dWᵀ's (col · dyᵀ, rows `s.o` apart)."""
        g, b = i // bands, i % bands
        cols = (T.address_of(ws[at(th)]), t.width)
        dys = (gradient(dy, ws, th, g, b), t.ld(s))
        first, second, m, n, ldc = (cols, dys, kt, s.o, s.o) if transposed else (dys, cols, s.o, kt, s.k)
        return _sgemm(NO_TRANS, TRANS, m, n, t.columns(s, g, b), *first, *second, beta, out, ldc)

    @T.macro
    def tile(x, dy, ws, th, i, k0, kt, beta, out):
        for j in range(t.count(s, i // bands)):
            im2col(x, ws, at(th), t.width, t.image(i // bands, j), t.row(i % bands), t.span(s, i % bands), j * t.run(s), k0, kt)
            gather(dy, ws, dy_at(th), t.width, t.image(i // bands, j), j * t.run(s), t.row(i % bands), t.span(s, i % bands))
        T.evaluate(product(dy, ws, th, i, kt, beta, out))

    return tile


def _in_place(s: Conv, t: Tiles, copy, at: Callable):
    """How a product reads a tile's dy or writes its y: in place for a `single` tile (no copy),
    else through the copy `copy` (gather or scatter) at workspace offset `at(th)`. Returns (copy
    or `_nothing`, a function of (buf, ws, th, g, b) giving the operand's address; its leading
    dimension is `t.ld(s)`)."""
    if t.single:
        return _nothing, lambda buf, ws, th, g, b: t.out(s, buf, g, b)
    return copy, lambda buf, ws, th, g, b: T.address_of(ws[at(th)])


def _weight_grad_by_tiles(s: Conv, threads: int, accumulate: bool) -> tvm.tirx.PrimFunc:
    """`weight_grad_kernel` split by tiles: thread th takes a contiguous share of the tiles,
    accumulates col · dyᵀ into its own dWᵀ at the end of its workspace, and a second parallel
    loop sums the threads' copies, transposed, into dw."""
    k, o = s.k, s.o
    t = Tiles.of(s, threads, k + o)
    cols = t.width * (k + (0 if t.single else o))  # its tile's columns, then dy
    per = cols + o * k  # ... then its own dWᵀ
    tiles = t.groups(s) * t.bands(s)
    share = -(-tiles // threads)
    tile = _weight_grad_tile(s, t, lambda th: th * per, lambda th: th * per + k * t.width, transposed=True)

    @T.macro
    def write(flat, e, value):
        flat[e] = value

    @T.macro
    def add(flat, e, value):
        flat[e] = flat[e] + value

    start = add if accumulate else write

    @T.prim_func(private=True)
    def conv2d_weight_grad_gemm(
        x: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
        dy: T.Buffer((s.n, o, s.oh, s.ow), "float32"),
        dw: T.Buffer((o, s.c, s.kh, s.kw), "float32"),
    ):
        T.func_attr(_attrs(s))
        ws = T.decl_buffer((threads * per,), "float32")
        flat = T.decl_buffer((o * k,), "float32", data=dw.data)
        for th in T.parallel(threads):
            for e in range(o * k):
                ws[th * per + cols + e] = T.float32(0)
            for i in range(th * share, T.min((th + 1) * share, tiles)):
                tile(x, dy, ws, th, i, 0, k, T.float32(1), T.address_of(ws[th * per + cols]))
        for e in T.parallel(o * k):  # dW[oi, kk] = Σ_th dWᵀ_th[kk, oi]
            start(flat, e, ws[cols + e % k * o + e // k])
            for th in range(1, threads):
                flat[e] = flat[e] + ws[th * per + cols + e % k * o + e // k]

    return conv2d_weight_grad_gemm


def input_grad_kernel(s: Conv, threads: int) -> tvm.tirx.PrimFunc:
    """dx_n = col2im(Wᵀ · dy_n). The pool's threads take the images in turn, each gathering its
    tiles' dy, multiplying them into its own columns and adding those back onto its own images:
    a band's taps overlap the next band's rows, so an image is never split between threads."""
    k, o = s.k, s.o
    t = Tiles.of(s, threads, k + o)
    per = t.width * (k + (0 if t.single else o))  # one thread's workspace: columns, then the gathered dy
    groups, bands = t.groups(s), t.bands(s)
    share = -(-groups // threads)
    _, gather, _, col2im = _macros(s)
    gather, gradient = _in_place(s, t, gather, lambda th: th * per + k * t.width)

    @T.prim_func(private=True)
    def conv2d_input_grad_gemm(
        dy: T.Buffer((s.n, o, s.oh, s.ow), "float32"),
        wt: T.Buffer((o, s.c, s.kh, s.kw), "float32"),
        dx: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
    ):
        T.func_attr(_attrs(s))
        ws = T.decl_buffer((threads * per,), "float32")
        for th in T.parallel(threads):
            for g in range(th * share, T.min((th + 1) * share, groups)):
                for j, ci, y in T.grid(t.count(s, g), s.c, s.h):  # (a whole image as one vector: LLVM aborts)
                    for x in T.vectorized(s.w):
                        dx[t.image(g, j), ci, y, x] = T.float32(0)
                for b in range(bands):
                    for j in range(t.count(s, g)):
                        gather(dy, ws, th * per + k * t.width, t.width, t.image(g, j), j * t.run(s), t.row(b), t.span(s, b))
                    T.evaluate(
                        _sgemm(
                            TRANS,
                            NO_TRANS,
                            k,
                            t.columns(s, g, b),
                            o,
                            wt.data,
                            k,
                            gradient(dy, ws, th, g, b),
                            t.ld(s),
                            T.float32(0),
                            T.address_of(ws[th * per]),
                            t.width,
                        )
                    )
                    for j in range(t.count(s, g)):
                        col2im(ws, th * per, t.width, dx, t.image(g, j), t.row(b), t.span(s, b), j * t.run(s))

    return conv2d_input_grad_gemm


def _source_id() -> str:
    """This module's source and TVM's version (TVMScript's meaning): what a kernel is parsed from."""
    return hashlib.sha256(Path(__file__).read_bytes() + tvm.__version__.encode()).hexdigest()[:16]


_MADE_BY = _source_id()  # the source this process runs
# TVMScript's parser reads every frame of the stack that calls it (`inspect.stack()` once a
# kernel, `inspect.getouterframes` once a macro call), source lines included: from a compile deep
# in a caller's stack (pytest's is ~80 frames) a MobileNetV3 step's 95 kernels took 57 s, from a
# thread of their own (a dozen frames) 10 s. A thread per parse: one kept in a pool would not
# survive a fork.


@functools.lru_cache(maxsize=1024)
def _built(
    kernel: Callable[..., tvm.tirx.PrimFunc], s: Conv, threads: int, made: tuple[int, ...], cache: Path | None
) -> tvm.tirx.PrimFunc:
    """`kernel(s, threads)`, made once per process (under the `limits()` it was made with) and,
    given a `cache` directory, once per compile cache. Parsing a kernel's TVMScript takes
    100-200 ms, a third of a MobileNetV3 compile; a study legalizes the same convolutions for
    candidate after candidate, and workers, reruns and `compile` in other processes meet them
    again. The cache keeps TVM's JSON of the kernel (loaded in milliseconds) under a key of
    everything that made it, which the entry repeats, checked by its hash on every read; an entry
    that cannot be read or written costs only the parse.

    This process keeps the last 1,024 made: a study of one model meets at most a few kernels
    (forward, both gradients, the accumulating weight gradient) per distinct convolution at each
    of its few batch sizes, some hundreds; the cache directory serves one dropped since."""
    if cache is not None:
        name = getattr(kernel, "func", kernel).__name__ + repr(sorted(getattr(kernel, "keywords", {}).items()))
        made_of = json.loads(json.dumps([name, astuple(s), threads, made, _MADE_BY]))  # as it reads back
        key = hashlib.sha256(json.dumps(made_of).encode()).hexdigest()[:32]
        path = kernels_dir(cache) / f"{key}.json"
        cached = cachefile.read_json(path, key)
        if cached is not None and cached.get("made_of") == made_of and isinstance(cached.get("tir"), str):
            try:
                loaded = tvm.ir.load_json(cached["tir"])
            except Exception:  # noqa: BLE001 - TVM raises ValueError, RuntimeError, ...: the kernel is made again
                loaded = None
            if isinstance(loaded, tvm.tirx.PrimFunc) and _conv_of(loaded) == astuple(s):
                return loaded
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="planner-tvmscript") as parser:
        func = parser.submit(kernel, s, threads).result()
    # TVMScript parses the source on disk: if it is no longer the source this process runs (a
    # checkout during a study), the kernel is used here but not kept under this source's key
    if cache is not None and _source_id() == _MADE_BY:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            cachefile.write_json(path, {"made_of": made_of, "tir": tvm.ir.save_json(func)}, key)
        except OSError:
            pass
    return func


def _conv_of(func: tvm.tirx.PrimFunc) -> tuple[int, ...] | None:
    """The `Conv` fields an OpenBLAS kernel says it computes (`_attrs`); None for any other function."""
    attrs = func.attrs or {}
    conv = attrs.get(CONV)
    return tuple(int(d) for d in conv) if conv is not None and attrs.get(CALLS) == "openblas" else None


def kernels_dir(cache: Path) -> Path:
    """Where the compile cache `cache` keeps parsed kernels (`_built`)."""
    return cache / "kernels-tir"


def conv2d(bb: relax.BlockBuilder, call: relax.Call, *, fallback: Lowering, threads: int, cache: Path | None) -> relax.Expr:
    """`relax.nn.conv2d`: a layer's forward convolution, or TVM's weight gradient (x in a CNHW
    view convolved by dy in an IOHW view, dilated by the layer's stride), through OpenBLAS."""
    a = call.attrs
    if _static(call, ("CNHW", "IOHW", "CNHW")) and all(int(d) == 1 for d in a.strides):
        n, c, h, w = _ints(call.args[0].ty.shape)
        _, o, oh, ow = _ints(call.args[1].ty.shape)
        _, _, kh, kw = _ints(call.ty.shape)
        sh, sw = _ints(a.dilation)
        s = Conv(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))
        gv = bb.add_func(_built(weight_grad_kernel, s, threads, limits(), cache), "conv2d_weight_grad_gemm")
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
        gv = bb.add_func(_built(forward_kernel, s, threads, limits(), cache), "conv2d_gemm")
        return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)
    return fallback(bb, call)


def conv2d_transpose(
    bb: relax.BlockBuilder, call: relax.Call, *, fallback: Lowering, threads: int, cache: Path | None
) -> relax.Expr:
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
    gv = bb.add_func(_built(input_grad_kernel, s, threads, limits(), cache), "conv2d_input_grad_gemm")
    return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)


_weight_grad_accumulating = functools.partial(weight_grad_kernel, accumulate=True)


def accumulate_in_place(mod: tvm.IRModule, func: str, threads: int, *, cache: Path | None) -> tvm.IRModule:
    """`mod` with each micro-batch's weight gradient through OpenBLAS added by its own kernel to
    the running sum, where the sum lies, instead of written to a buffer of its own that an
    accumulation kernel then adds (`graph._in_place`): the step holds one dW, not two."""
    step = mod[func]
    if len(step.body.blocks) != 1:
        return mod
    bindings = list(step.body.blocks[0].bindings)
    uses: dict[relax.Var, int] = {}
    for b in bindings:
        for v in relax.analysis.free_vars(b.value):
            uses[v] = uses.get(v, 0) + 1
    for v in relax.analysis.free_vars(step.body.body):
        uses[v] = uses.get(v, 0) + 1
    bound = {b.var: b.value for b in bindings}
    builder = relax.BlockBuilder(mod)
    fused: dict[relax.Var, relax.Expr] = {}  # accumulation binding -> the gradient kernel that does it
    for b in bindings:
        call = b.value
        if not (isinstance(call, relax.Call) and call.op.same_as(tvm.ir.Op.get("relax.call_tir_inplace"))):
            continue
        if not call.args[0].name_hint.startswith("accumulate_"):
            continue
        total, grad = call.args[1].fields
        source = bound.get(grad)
        if uses.get(grad) != 1 or not (isinstance(source, relax.Call) and source.op.same_as(tvm.ir.Op.get("relax.call_tir"))):
            continue
        kernel = mod[source.args[0]]
        if not source.args[0].name_hint.startswith("conv2d_weight_grad_gemm") or kernel.attrs.get(CONV) is None:
            continue
        s = Conv(*(int(d) for d in kernel.attrs[CONV]))
        gv = builder.add_func(
            _built(_weight_grad_accumulating, s, threads, limits(), cache), "conv2d_weight_grad_gemm_accumulate"
        )
        x, dy = source.args[1].fields
        fused[b.var] = relax.op.call_tir_inplace(gv, relax.Tuple([x, dy, total]), 2, call.ty)
    if not fused:
        return mod
    dropped = {b.value.args[1].fields[1] for b in bindings if b.var in fused}
    order = [relax.VarBinding(b.var, fused[b.var]) if b.var in fused else b for b in bindings if b.var not in dropped]
    out = builder.get()
    out[func] = relax.Function(
        step.params, relax.SeqExpr([relax.DataflowBlock(order)], step.body.body), step.ret_ty, step.is_pure, step.attrs
    )
    return relax.transform.DeadCodeElimination([func])(out)
