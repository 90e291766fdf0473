"""One dense convolution as im2col + OpenBLAS sgemm in a TVM kernel, against PyTorch's conv2d.

The kernel the `issue-16-gemm` prototype emits for `relax.nn.conv2d`: per image, im2col into a
one-image workspace (parallel over channel and kernel row, vectorized along the output row), then
the GEMM in two row blocks of output channels, each a single-threaded `scipy_cblas_sgemm` on one
of TVM's pool threads. Checked against PyTorch, then timed (best of 5 rounds of 30 calls).

    pip install -e '.[bench]'
    TVM_NUM_THREADS=2 python benchmarks/conv_gemm_layer.py N C H O K STRIDE PAD   # e.g. 8 64 16 64 3 1 1
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import scipy_openblas32
import torch
import tvm
from kernel_libraries import best  # same folder: the scripts run as `python benchmarks/NAME.py`
from tvm.script import tirx as T

BLOCKS = 2


def kernel(n: int, c: int, h: int, o: int, k: int, s: int, pad: int):
    oh = (h + 2 * pad - k) // s + 1
    kk, p, ob = c * k * k, oh * oh, -(-o // BLOCKS)

    @T.prim_func
    def conv(x: T.Buffer((n, c, h, h), "float32"), w: T.Buffer((o, c, k, k), "float32"), y: T.Buffer((n, o, oh, oh), "float32")):
        T.func_attr({"tir.noalias": True})
        for ni in range(n):
            col = T.decl_buffer((kk * p,), "float32")
            for ck in T.parallel(c * k):
                for kw in range(k):
                    for oy in range(oh):
                        for ox in T.vectorized(oh):  # index math inline: TVM miscompiles vectorized lets
                            col[((ck * k + kw) * oh + oy) * oh + ox] = T.if_then_else(
                                (oy * s - pad + ck % k >= 0)
                                and (oy * s - pad + ck % k < h)
                                and (ox * s - pad + kw >= 0)
                                and (ox * s - pad + kw < h),
                                x[
                                    ni,
                                    ck // k,
                                    T.max(T.min(oy * s - pad + ck % k, h - 1), 0),
                                    T.max(T.min(ox * s - pad + kw, h - 1), 0),
                                ],
                                T.float32(0),
                            )
            for b in T.parallel(BLOCKS):
                T.evaluate(
                    T.call_extern(
                        "int32",
                        "scipy_cblas_sgemm",
                        101,
                        111,
                        111,
                        T.min(ob, o - b * ob),
                        p,
                        kk,
                        T.float32(1),
                        T.address_of(w[b * ob, 0, 0, 0]),
                        kk,
                        col.data,
                        p,
                        T.float32(0),
                        T.address_of(y[ni, b * ob, 0, 0]),
                        p,
                    )  # fmt: skip
                )

    return conv, oh


def main() -> None:
    n, c, h, o, k, s, pad = (int(v) for v in sys.argv[1:8])
    blas = ctypes.CDLL(f"{scipy_openblas32.get_lib_dir()}/libscipy_openblas.so", mode=ctypes.RTLD_GLOBAL)
    blas.scipy_openblas_set_num_threads(1)
    conv, oh = kernel(n, c, h, o, k, s, pad)
    fn = tvm.compile(tvm.IRModule({"main": conv}), target="llvm")["main"]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((n, c, h, h)).astype("float32"), rng.standard_normal((o, c, k, k)).astype("float32")
    tx, tw, ty = tvm.runtime.tensor(x), tvm.runtime.tensor(w), tvm.runtime.tensor(np.zeros((n, o, oh, oh), "float32"))
    fn(tx, tw, ty)
    torch.set_num_threads(2)
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    ref = torch.nn.functional.conv2d(xt, wt, stride=s, padding=pad).numpy()
    np.testing.assert_allclose(ty.numpy(), ref, rtol=1e-4, atol=1e-3)
    flops = 2 * n * o * oh * oh * c * k * k
    ours, theirs = best(lambda: fn(tx, tw, ty)), best(lambda: torch.nn.functional.conv2d(xt, wt, stride=s, padding=pad))
    print(
        f"N{n} C{c} H{h} O{o} K{k} S{s} P{pad}: im2col + sgemm {ours * 1e3:.3f} ms ({flops / ours / 1e9:.1f} GFLOP/s), "
        f"PyTorch {theirs * 1e3:.3f} ms ({flops / theirs / 1e9:.1f} GFLOP/s), workspace {c * k * k * oh * oh * 4 / 1024:.0f} KiB"
    )


if __name__ == "__main__":
    main()
