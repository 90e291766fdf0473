"""The OpenBLAS convolution kernels, in TVMScript: a float32 NCHW convolution, ungrouped and
undilated, forward and both gradients, as one kernel each that writes the input's columns
(im2col) into a workspace and multiplies them by the weight with OpenBLAS's sgemm:

- forward: y_n = W · col(x_n);
- weight gradient (TVM writes it as a CNHW/IOHW convolution of x by dy): dW += dy_n · col(x_n)ᵀ;
- input gradient (TVM's `conv2d_transpose` of dy by the IOHW view of W): col = Wᵀ · dy_n, then
  each column entry added back onto the input pixel it came from (col2im).

Each kernel is one parallel region over TVM's pool threads (`gemm.pool_threads`), and each thread
works on its own tiles in its own part of one workspace: it builds a tile's columns, multiplies
them with a single-threaded sgemm and writes its own outputs, never waiting for another thread
(OpenBLAS runs inside TVM's pool, never beside it: their two pools fought over the cores). A tile
is whole images side by side when images are small, else a band of output rows (`Tiles`); all
the threads' tiles together stay within about `Limits.band_bytes` whatever the batch, since the
workspace is counted in the step's planned memory like any other buffer. The forward and input
gradient deal out images (or rows) to threads; the weight gradient deals out its columns, so no
two threads accumulate into one weight.

The kernels are marked scheduled and opaque (`op_pattern` 8): no schedule or fusion touches them.
Their index arithmetic is written inline: TVM miscompiled the same lets under `T.vectorized`.
This module is how a kernel is made, its tiling and its products; the data moved around the
products is `im2col`'s macros, and which Relax call gets which kernel, made once, is `gemm`'s.
TVMScript parses this module as it is on disk, so `gemm._source_id` hashes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass

import tvm
from tvm.script import tirx as T

from planner.backend.sgemm.blas import NO_TRANS, PANEL, TRANS, int8_operands, sgemm
from planner.backend.sgemm.im2col import Conv, col2im_macro, copy_macros, im2col_macro, no_copy, no_im2col, no_zeroing

# the kernels' attributes (`_attrs`), all but CONV shared with `matmul`'s kernels
FLOPS = "planner.flops"  # function attribute: the kernel's multiply-adds × 2, for the profile
CALLS = "planner.calls"  # function attribute: the library a kernel calls (the step must link it)
CONV = "planner.conv"  # function attribute: the `Conv` a kernel computes, field by field
NARROW = 128  # dW columns per thread under which a weight gradient split by columns multiplies too thin a product
MIN_PIXELS = 256  # output pixels per image from which that thin product costs measurably (16x16 maps)


@dataclass(frozen=True)
class Limits:
    """How much workspace a kernel's tiling may take: a kernel made under other limits is another
    kernel (`gemm.built` keys them by these)."""

    band_bytes: int  # all threads' tiles
    private_bytes: int  # every thread's own copy of dW, in all, when a weight gradient is split by tiles


# A Linux board's: a quarter of the band ran up to 2x slower on 4x4 and 2x2 maps.
LIMITS = Limits(band_bytes=1024 * 1024, private_bytes=256 * 1024)
# A microcontroller's: its SRAM is kilobytes. Bands of 16 KiB cut the weight gradients' products so
# short that the portable sgemm's per-block work showed (4.0 instructions per MAC on a Cortex-M4);
# 32 KiB ran every dense kernel at 2.6-3.8 (benchmarks/mcu_kernels.py, docs/benchmarks.md).
MICRO_LIMITS = Limits(band_bytes=32 * 1024, private_bytes=16 * 1024)


@dataclass(frozen=True)
class Tiles:
    """How a kernel's columns are cut into per-thread tiles of at most `Limits.band_bytes` in all.

    A tile is either `images` whole images side by side (small feature maps: one image's few
    pixels would make a product too thin for sgemm to run fast), or a band of `rows` output rows
    of one image. `width` is a tile's column count as laid out in its workspace."""

    images: int
    rows: int
    width: int

    @classmethod
    def of(cls, s: Conv, threads: int, rows_per_column: int, limits: Limits) -> Tiles:
        """Tiles for `threads` workspaces of `rows_per_column` floats per column each. Whole
        images are dealt out evenly: as many tiles as a multiple of the threads needs, each
        as wide as that allows (8 images of 4 pixels, 2 threads: 4 and 4, never 6 and 2)."""
        cols = max(s.ow, limits.band_bytes // (4 * threads * rows_per_column))
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


def _attrs(s: Conv) -> dict:
    return {
        "tirx.noalias": True,
        "tirx.is_scheduled": True,
        "op_pattern": 8,
        FLOPS: s.flops,
        CALLS: "openblas",
        CONV: list(astuple(s)),
    }


def forward_kernel(s: Conv, threads: int, limits: Limits, quantized: bool = False) -> tvm.tirx.PrimFunc:
    """y_n = W · col(x_n). The pool's threads take the tiles in turn (contiguous shares), each
    building its own tile's columns, multiplying them into its workspace and copying the product
    out image by image: one parallel region, no thread waits for another. `quantized`: W is int8
    with a scale per output channel, the kernel `(x, w, scale, y)` (`GEMM_S8`). A `pointwise`
    convolution's `single` tile multiplies its columns where they lie in x: no im2col, no copy."""
    k, o = s.k, s.o
    t = Tiles.of(s, threads, k + o, limits)
    direct = s.pointwise and t.single
    # one thread's workspace: columns, then the product, then (an int8 weight) its converted rows
    per = t.width * ((0 if direct else k) + (0 if t.single else o)) + (PANEL * k if quantized else 0)
    bands = t.bands(s)
    share = -(-t.groups(s) * bands // threads)
    im2col = no_im2col if direct else im2col_macro(s)
    _, scatter = copy_macros(s)
    scatter, product = _in_place(s, t, scatter, lambda th: th * per + k * t.width)
    columns = _columns(s, t, direct, lambda th: th * per)
    int8 = int8_operands(quantized, k, per)

    @T.macro
    def forward(x, wt, sc, y, ws):
        for th in T.parallel(threads):
            for i in range(th * share, T.min((th + 1) * share, t.groups(s) * bands)):
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
                    sgemm(
                        (NO_TRANS, NO_TRANS),
                        (o, t.columns(s, i // bands, i % bands), k),
                        (wt.data, k),
                        (columns[0](x, ws, th, i // bands, i % bands), columns[1]),
                        T.float32(0),
                        (product(y, ws, th, i // bands, i % bands), t.ld(s)),
                        int8(sc, ws, th),
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

    if quantized:

        @T.prim_func(private=True)
        def conv2d_gemm_s8(
            x: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
            wt: T.Buffer((o, s.c, s.kh, s.kw), "int8"),
            sc: T.Buffer((o, 1, 1, 1), "float32"),
            y: T.Buffer((s.n, o, s.oh, s.ow), "float32"),
        ):
            T.func_attr(_attrs(s))
            ws = T.decl_buffer((max(1, threads * per),), "float32")
            forward(x, wt, sc, y, ws)

        return conv2d_gemm_s8

    @T.prim_func(private=True)
    def conv2d_gemm(
        x: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
        wt: T.Buffer((o, s.c, s.kh, s.kw), "float32"),
        y: T.Buffer((s.n, o, s.oh, s.ow), "float32"),
    ):
        T.func_attr(_attrs(s))
        ws = T.decl_buffer((max(1, threads * per),), "float32")
        forward(x, wt, wt, y, ws)

    return conv2d_gemm


def weight_grad_kernel(s: Conv, threads: int, limits: Limits, accumulate: bool = False) -> tvm.tirx.PrimFunc:
    """dW = Σ_n dy_n · col(x_n)ᵀ (or, `accumulate`, dW += that: a micro-batch's gradient added
    to the running sum where it lies, see `gemm.accumulate_in_place`), in one of two ways so
    that no two threads add into one weight and none waits for another while multiplying:

    - split by its columns (kernel taps × input channels): each thread builds only its rows of
      every tile's columns and accumulates into only its part of dW — as its rows of dWᵀ,
      written out at the end, where all of dW fits in `Limits.private_bytes` (`_weight_grad_tile`);
    - split by tiles, where that split would leave each thread fewer than `NARROW` columns of
      dW (16 input channels of a 3×3 layer on 2 threads: 72) on maps of `MIN_PIXELS` or more,
      and every thread's own copy of dW fits in `Limits.private_bytes`: each thread builds
      whole columns of its own tiles and accumulates into its own dW; the copies are summed at
      the end. Why: ResNet-8's 16-channel weight gradients ran split by columns at a quarter of
      numpy's speed, a fifth of its batch-32 step; by tiles 1.3–1.6× faster. On small maps and
      wide dW it gained nothing measurable and costs the copies' memory (`_by_tiles`).

    A `single` tile's dy is multiplied in place; several images side by side are gathered."""
    k, o = s.k, s.o
    if _by_tiles(s, threads, limits):
        return _weight_grad_by_tiles(s, threads, limits, accumulate)
    kb = -(-k // threads)  # dW columns per thread
    t = Tiles.of(s, threads, kb + o, limits)
    direct = s.pointwise and t.single  # its columns read in x, where they lie
    cols = t.width * ((0 if direct else kb) + (0 if t.single else o))  # one thread's workspace: its rows of the columns, then dy
    # where dW fits a copy of its rows per thread (dWᵀ, `_weight_grad_tile`): accumulated there and
    # written out at the end; else dW's columns, strided, accumulated where they belong
    transposed = o * k * 4 <= limits.private_bytes
    per = cols + (kb * o if transposed else 0)
    tile = _weight_grad_tile(s, t, lambda th: th * per, lambda th: th * per + kb * t.width, transposed=transposed, direct=direct)

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
        ws = T.decl_buffer((max(1, threads * per),), "float32")
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


def _by_tiles(s: Conv, threads: int, limits: Limits) -> bool:
    """Whether `weight_grad_kernel` splits dW by tiles (measured per shape, side by side with the
    column split, in docs/benchmarks.md)."""
    return threads > 1 and s.k // threads < NARROW and s.p >= MIN_PIXELS and threads * s.o * s.k * 4 <= limits.private_bytes


def constants() -> tuple[int, ...]:
    """The module's fixed choices among tilings: a kernel chosen under others is another kernel."""
    return (NARROW, MIN_PIXELS)


def _weight_grad_tile(s: Conv, t: Tiles, at: Callable, dy_at: Callable, *, transposed: bool = False, direct: bool = False):
    """A weight gradient's work on tile i for thread th: rows k0 .. k0 + kt of the tile's columns
    at workspace offset `at(th)`, its dy (gathered at `dy_at(th)` unless `single`), and their
    product added (`beta` 1, or 0: written) into `out`: dW's rows `s.k` apart, or `transposed`,
    dWᵀ's rows `s.o` apart. Why dWᵀ where it is free to lay out: col · dyᵀ (the columns as the
    product's long side) ran 1.3-1.45x faster in OpenBLAS than dy · colᵀ on 16-64 channels.
    `direct`: the columns are read where they lie in x (`_columns`)."""
    bands = t.bands(s)
    im2col = no_im2col if direct else im2col_macro(s)
    gather, _ = copy_macros(s)
    gather, gradient = _in_place(s, t, gather, dy_at)
    column, ld = _columns(s, t, direct, at)

    def product(x, dy, ws, th, i, k0, kt, beta, out):
        """dW's rows (dy · colᵀ, rows `s.k` apart) or dWᵀ's (col · dyᵀ, rows `s.o` apart)."""
        g, b = i // bands, i % bands
        cols = (column(x, ws, th, g, b, k0), ld)
        dys = (gradient(dy, ws, th, g, b), t.ld(s))
        first, second, m, n, ldc = (cols, dys, kt, s.o, s.o) if transposed else (dys, cols, s.o, kt, s.k)
        return sgemm((NO_TRANS, TRANS), (m, n, t.columns(s, g, b)), first, second, beta, (out, ldc))

    @T.macro
    def tile(x, dy, ws, th, i, k0, kt, beta, out):
        for j in range(t.count(s, i // bands)):
            im2col(x, ws, at(th), t.width, t.image(i // bands, j), t.row(i % bands), t.span(s, i % bands), j * t.run(s), k0, kt)
            gather(dy, ws, dy_at(th), t.width, t.image(i // bands, j), j * t.run(s), t.row(i % bands), t.span(s, i % bands))
        T.evaluate(product(x, dy, ws, th, i, k0, kt, beta, out))

    return tile


def _columns(s: Conv, t: Tiles, direct: bool, at: Callable):
    """Where a product finds a tile's columns: in the workspace at `at(th)`, `t.width` apart, or
    (`direct`: a `pointwise` convolution's `single` tile) where they lie in the image buffer, `s.p`
    apart. Returns ((buf, ws, th, g, b, k0) -> the address of column row k0, leading dimension)."""
    if direct:
        return (lambda buf, ws, th, g, b, k0=0: T.address_of(buf[t.image(g, 0), k0, t.row(b), 0])), s.p
    return (lambda buf, ws, th, g, b, k0=0: T.address_of(ws[at(th)])), t.width


def _in_place(s: Conv, t: Tiles, copy, at: Callable):
    """How a product reads a tile's dy or writes its y: in place for a `single` tile (no copy),
    else through the copy `copy` (gather or scatter) at workspace offset `at(th)`. Returns (copy
    or `no_copy`, a function of (buf, ws, th, g, b) giving the operand's address; its leading
    dimension is `t.ld(s)`)."""
    if t.single:
        return no_copy, lambda buf, ws, th, g, b: t.out(s, buf, g, b)
    return copy, lambda buf, ws, th, g, b: T.address_of(ws[at(th)])


def _weight_grad_by_tiles(s: Conv, threads: int, limits: Limits, accumulate: bool) -> tvm.tirx.PrimFunc:
    """`weight_grad_kernel` split by tiles: thread th takes a contiguous share of the tiles,
    accumulates col · dyᵀ into its own dWᵀ at the end of its workspace, and a second parallel
    loop sums the threads' copies, transposed, into dw."""
    k, o = s.k, s.o
    t = Tiles.of(s, threads, k + o, limits)
    direct = s.pointwise and t.single  # its columns read in x, where they lie
    cols = t.width * ((0 if direct else k) + (0 if t.single else o))  # its tile's columns, then dy
    per = cols + o * k  # ... then its own dWᵀ
    tiles = t.groups(s) * t.bands(s)
    share = -(-tiles // threads)
    tile = _weight_grad_tile(s, t, lambda th: th * per, lambda th: th * per + k * t.width, transposed=True, direct=direct)

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
        ws = T.decl_buffer((max(1, threads * per),), "float32")
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


def input_grad_kernel(s: Conv, threads: int, limits: Limits, quantized: bool = False) -> tvm.tirx.PrimFunc:
    """dx_n = col2im(Wᵀ · dy_n). The pool's threads take the images in turn, each gathering its
    tiles' dy, multiplying them into its own columns and adding those back onto its own images:
    a band's taps overlap the next band's rows, so an image is never split between threads.
    `quantized`: W is int8 with a scale per output channel, the kernel `(dy, w, scale, dx)`.
    A `pointwise` convolution's `single` tile writes its product in dx: no columns, no zeroing."""
    k, o = s.k, s.o
    t = Tiles.of(s, threads, k + o, limits)
    direct = s.pointwise and t.single
    # one thread's workspace: columns, then the gathered dy, then (an int8 weight) its converted rows
    per = t.width * ((0 if direct else k) + (0 if t.single else o)) + (PANEL * o if quantized else 0)
    groups, bands = t.groups(s), t.bands(s)
    share = -(-groups // threads)
    gather, _ = copy_macros(s)
    col2im = no_copy if direct else col2im_macro(s)
    gather, gradient = _in_place(s, t, gather, lambda th: th * per + k * t.width)
    columns = _columns(s, t, direct, lambda th: th * per)

    int8 = int8_operands(quantized, o, per)

    @T.macro
    def zeroed(dx, g):
        for j, ci, y in T.grid(t.count(s, g), s.c, s.h):  # (a whole image as one vector: LLVM aborts)
            for x in T.vectorized(s.w):
                dx[t.image(g, j), ci, y, x] = T.float32(0)

    clear = no_zeroing if direct else zeroed

    @T.macro
    def input_grad(dy, wt, sc, dx, ws):
        for th in T.parallel(threads):
            for g in range(th * share, T.min((th + 1) * share, groups)):
                clear(dx, g)
                for b in range(bands):
                    for j in range(t.count(s, g)):
                        gather(dy, ws, th * per + k * t.width, t.width, t.image(g, j), j * t.run(s), t.row(b), t.span(s, b))
                    T.evaluate(
                        sgemm(
                            (TRANS, NO_TRANS),
                            (k, t.columns(s, g, b), o),
                            (wt.data, k),
                            (gradient(dy, ws, th, g, b), t.ld(s)),
                            T.float32(0),
                            (columns[0](dx, ws, th, g, b), columns[1]),
                            int8(sc, ws, th),
                        )
                    )
                    for j in range(t.count(s, g)):
                        col2im(ws, th * per, t.width, dx, t.image(g, j), t.row(b), t.span(s, b), j * t.run(s))

    if quantized:

        @T.prim_func(private=True)
        def conv2d_input_grad_gemm_s8(
            dy: T.Buffer((s.n, o, s.oh, s.ow), "float32"),
            wt: T.Buffer((o, s.c, s.kh, s.kw), "int8"),
            sc: T.Buffer((o, 1, 1, 1), "float32"),
            dx: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
        ):
            T.func_attr(_attrs(s))
            ws = T.decl_buffer((max(1, threads * per),), "float32")
            input_grad(dy, wt, sc, dx, ws)

        return conv2d_input_grad_gemm_s8

    @T.prim_func(private=True)
    def conv2d_input_grad_gemm(
        dy: T.Buffer((s.n, o, s.oh, s.ow), "float32"),
        wt: T.Buffer((o, s.c, s.kh, s.kw), "float32"),
        dx: T.Buffer((s.n, s.c, s.h, s.w), "float32"),
    ):
        T.func_attr(_attrs(s))
        ws = T.decl_buffer((max(1, threads * per),), "float32")
        input_grad(dy, wt, wt, dx, ws)

    return conv2d_input_grad_gemm
