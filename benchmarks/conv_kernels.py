"""planner's dense 3×3 convolution kernels, as a step calls them, against numpy's matmul peak.

    pip install -e '.[bench]'
    python benchmarks/conv_kernels.py [--threads 2] [--batches 8 32] [--layers resnet18|resnet8]

For each dense 3×3 convolution of torchvision's resnet18 at 64×64 (the issue-16 yardstick; or of
the CIFAR ResNet-8, whose 16- and 32-channel layers are the thinnest products) and
each batch: the three kernels planner compiles for it with `kernels: openblas` — forward, weight
gradient, input gradient (`planner/backend/sgemm/gemm_kernels.py`) — each timed by TVM's time evaluator
(best of 5 rounds) and given as GFLOP/s and as a share of numpy's float32 1024³ matmul, measured right
before and after each kernel (the higher of the two: this shared host drifts). Printed as a
Markdown table. (The pause after each numpy product matters: numpy's OpenBLAS threads spin
after their work, and a kernel timed right after them ran up to 3x slower.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

# dense 3×3 convolutions: (C, O, input size, stride)
LAYERS = {
    # resnet18@64's, after the stem and max-pool
    "resnet18": [
        (64, 64, 16, 1),
        (64, 128, 16, 2),
        (128, 128, 8, 1),
        (128, 256, 8, 2),
        (256, 256, 4, 1),
        (256, 512, 4, 2),
        (512, 512, 2, 1),
    ],
    # the CIFAR ResNet-8's (tests/zoo.py's resnet): few channels, where the products are thinnest
    "resnet8": [(16, 16, 32, 1), (16, 32, 32, 2), (32, 32, 16, 1), (32, 64, 16, 2), (64, 64, 8, 1)],
}


def numpy_peak() -> float:
    a = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(5))
    # numpy's OpenBLAS threads spin for a while after a product: timed right away, the next
    # kernel ran at a third of its speed beside them
    time.sleep(0.5)
    return 2 * 1024**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--layers", choices=sorted(LAYERS), default="resnet18", help="whose 3×3 convolutions")
    args = parser.parse_args()
    env = {**os.environ, "TVM_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    if os.environ.get("TVM_NUM_THREADS") != str(args.threads):  # TVM reads it once, at start-up
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    import tvm

    from planner.backend.sgemm import gemm_kernels
    from planner.backend.sgemm.im2col import Conv
    from planner.runtime.libraries import load_openblas

    load_openblas()
    target = tvm.target.Target({"kind": "llvm", "num-cores": args.threads})
    print(f"host: {args.threads} threads; numpy float32 1024³ matmul: {numpy_peak():.1f} GFLOP/s\n")
    print("| batch | C→O, size, stride | forward GFLOP/s (÷ numpy) | weight gradient | input gradient |")
    print("|---|---|---|---|---|")
    shares = []
    for n in args.batches:
        for c, o, size, stride in LAYERS[args.layers]:
            out = (size + 2 - 3) // stride + 1
            s = Conv(n, c, size, size, o, 3, 3, out, out, stride, stride, 1, 1)
            cells = []
            for build, shapes in (
                (gemm_kernels.forward_kernel, [(n, c, size, size), (o, c, 3, 3), (n, o, out, out)]),
                (gemm_kernels.weight_grad_kernel, [(n, c, size, size), (n, o, out, out), (o, c, 3, 3)]),
                (gemm_kernels.input_grad_kernel, [(n, o, out, out), (o, c, 3, 3), (n, c, size, size)]),
            ):
                lib = tvm.tirx.build(tvm.IRModule({"k": build(s, args.threads).with_attr("global_symbol", "k")}), target=target)
                tensors = [tvm.runtime.tensor(np.random.rand(*shape).astype(np.float32)) for shape in shapes]
                timer = lib.time_evaluator("k", tvm.cpu(), number=10, repeat=5)
                peak = numpy_peak()
                seconds = min(timer(*tensors).results)
                peak = max(peak, numpy_peak())
                rate = s.flops / seconds / 1e9
                shares.append(rate / peak)
                cells.append(f"{rate:.1f} ({rate / peak:.0%})")
            print(f"| {n} | {c}→{o}, {size}², s{stride} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nmedian share of numpy's peak over every kernel above: {np.median(shares):.0%}")


if __name__ == "__main__":
    main()
