"""Which kernel library to link into training steps (issue 16): measured before choosing.

Two candidates, side by side with numpy's float32 matmul in the same run (the "peak" the
benchmarks compare against), on the dense-convolution shapes of resnet18 at 64x64:

- OpenBLAS (`pip install scipy-openblas32`, wheels for x86-64 and AArch64): a TIR kernel whose body
  is one `T.call_extern("scipy_cblas_sgemm", ...)`, compiled by TVM and linked against the
  library — the path a step would take (convolutions as im2col + GEMM; the im2col is not timed).
- oneDNN (Debian `libdnnl-dev` 2.6, amd64 and arm64; it links `libOpenCL.so.1` from
  `ocl-icd-libopencl1`): its direct convolution forward, backward-data and backward-weights
  (`kernel_libraries/onednn_conv.cpp`, built here with g++), plain layouts chosen by oneDNN.

    python benchmarks/kernel_libraries.py [--dnnl-root DIR]    # DIR holds usr/include, usr/lib/<triple>

Threads: `--threads` for both (OpenBLAS and OpenMP), 2 by default.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# (batch, in channels, size, out channels, kernel, stride, pad): resnet18@64's dense 3x3 layers
CONVS = [
    (8, 64, 16, 64, 3, 1, 1),
    (8, 128, 8, 128, 3, 1, 1),
    (8, 256, 4, 256, 3, 1, 1),
    (8, 64, 16, 128, 3, 2, 1),
    (32, 64, 16, 64, 3, 1, 1),
    (32, 128, 8, 128, 3, 1, 1),
]


def numpy_peak(n: int = 1024, reps: int = 20) -> float:
    a = np.random.default_rng(0).standard_normal((n, n)).astype("float32")
    a @ a
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ a
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def best(fn, reps: int = 30) -> float:
    """Seconds per call: the best of 5 rounds of `reps` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return min(times)


def openblas_gemms(shapes: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], float]]:
    """GFLOP/s of C[M,N] = A[M,K] B[K,N] through a TVM-compiled kernel that calls OpenBLAS."""
    import scipy_openblas32
    import tvm
    from tvm.script import tirx as T

    libdir = scipy_openblas32.get_lib_dir()
    ctypes.CDLL(f"{libdir}/libscipy_openblas.so", mode=ctypes.RTLD_GLOBAL)
    out = []
    for m, k, n in shapes:

        @T.prim_func
        def gemm(a: T.handle, b: T.handle, c: T.handle):
            T.func_attr({"global_symbol": "gemm", "tir.noalias": True})
            A = T.match_buffer(a, (m, k), "float32")
            B = T.match_buffer(b, (k, n), "float32")
            C = T.match_buffer(c, (m, n), "float32")
            # CblasRowMajor = 101, CblasNoTrans = 111
            T.evaluate(
                T.call_extern(
                    "int32",
                    "scipy_cblas_sgemm",
                    101,
                    111,
                    111,
                    m,
                    n,
                    k,
                    T.float32(1),
                    A.data,
                    k,
                    B.data,
                    n,
                    T.float32(0),
                    C.data,
                    n,
                )
            )

        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/gemm.so"
            tvm.compile(tvm.IRModule({"gemm": gemm}), target="llvm").export_library(
                path, options=[f"-L{libdir}", "-lscipy_openblas", f"-Wl,-rpath,{libdir}"]
            )
            fn = tvm.runtime.load_module(path)["gemm"]
            rng = np.random.default_rng(0)
            a, b = rng.standard_normal((m, k)).astype("float32"), rng.standard_normal((k, n)).astype("float32")
            ta, tb, tc = (tvm.runtime.tensor(x) for x in (a, b, np.zeros((m, n), "float32")))
            fn(ta, tb, tc)
            assert np.allclose(tc.numpy(), a @ b, rtol=1e-4, atol=1e-3), "the linked GEMM computes something else"
            out.append(((m, k, n), 2 * m * k * n / best(lambda: fn(ta, tb, tc)) / 1e9))
    return out


def onednn_convs(root: Path, threads: int) -> list[str]:
    lib = next((root / "usr/lib").glob("*-linux-gnu"))
    exe = Path(tempfile.mkdtemp()) / "onednn_conv"
    src = Path(__file__).parent / "kernel_libraries" / "onednn_conv.cpp"
    subprocess.run(
        [
            "g++",
            "-O2",
            "-std=c++17",
            str(src),
            f"-I{root / 'usr/include'}",
            f"-L{lib}",
            "-ldnnl",
            f"-Wl,-rpath-link,{lib}",
            "-o",
            str(exe),
        ],
        check=True,
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib), "OMP_NUM_THREADS": str(threads)}
    return [
        subprocess.run([str(exe), *map(str, c)], env=env, capture_output=True, text=True, check=True).stdout.strip()
        for c in CONVS
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dnnl-root", type=Path, help="an extracted libdnnl-dev + libdnnl2 + ocl-icd-libopencl1 (dpkg-deb -x)")
    args = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    peak = numpy_peak()
    print(f"numpy float32 1024^3 matmul: {peak:.1f} GFLOP/s (the peak the ratios divide by)")
    # each conv as the GEMM of its forward pass: M = out channels, K = in channels * k * k, N = batch * out pixels
    shapes = [(o, c * k * k, b * ((h + 2 * p - k) // s + 1) ** 2) for b, c, h, o, k, s, p in CONVS]
    for (m, k, n), gf in openblas_gemms(shapes):
        print(f"OpenBLAS sgemm via TIR  M{m} K{k} N{n}: {gf:6.1f} GFLOP/s ({gf / peak:.0%} of numpy)")
    if args.dnnl_root:
        for line in onednn_convs(args.dnnl_root, args.threads):
            print("oneDNN", line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
