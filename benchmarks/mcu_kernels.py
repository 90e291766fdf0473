"""Instructions per multiply-accumulate of the dense convolution kernels on an emulated Cortex-M.

    python benchmarks/mcu_kernels.py [--target cortex-m4-qemu] [--scheme all-layers]

Builds the bundled example's step for the target (`kernels: portable`: planner's im2col kernels over
its C sgemm) and once more with `kernels: tvm` (TVM's schedules emitted as scalar C), runs a step of
each on qemu with deterministic instruction counting (`-icount shift=0`), and prints a Markdown
table: every dense convolution kernel call of the portable step with its multiply-accumulates,
instructions and instructions per MAC, then both steps' totals. Instruction counts do not depend
on the host's load: one step is the measurement.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from planner.backend import backend_for
from planner.inputs.model import load_model
from planner.inputs.resources import shipped
from planner.inputs.schemes import load_scheme
from planner.inputs.targets import load_target
from planner.measurement.qemu import kernel_instructions
from planner.types import Kernels

DIGITS = shipped("examples") / "digits"


def profile(target_name: str, kernels: Kernels, scheme: str, cache: Path) -> tuple[list[tuple[str, int]], list[int]]:
    model = load_model(DIGITS / "model.onnx")
    target = load_target(target_name).model_copy(update={"kernels": kernels})
    candidate = load_scheme(str(DIGITS / f"{scheme}.yaml")).candidate(model)
    firmware = backend_for(target, cache_dir=cache).build(model, candidate)
    return list(firmware.calls), kernel_instructions(firmware, dict(model.initializers), target.mcu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="cortex-m4-qemu")
    ap.add_argument("--scheme", default="all-layers", help="a scheme of examples/digits")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        calls, counts = profile(args.target, Kernels.PORTABLE, args.scheme, Path(cache))
        _, scalar = profile(args.target, Kernels.TVM, args.scheme, Path(cache))
    print(f"{args.target}, examples/digits {args.scheme}: dense convolution kernels (`kernels: portable`)\n")
    print("| kernel call | MACs | instructions | per MAC |")
    print("|---|---:|---:|---:|")
    dense_macs = dense_instructions = 0
    for (name, flops), count in zip(calls, counts):
        if flops:
            macs = flops // 2
            dense_macs, dense_instructions = dense_macs + macs, dense_instructions + count
            print(f"| {name} | {macs:,} | {count:,} | {count / macs:.2f} |")
    print(f"| all dense convolutions | {dense_macs:,} | {dense_instructions:,} | {dense_instructions / dense_macs:.2f} |")
    print(f"\nwhole step: {sum(counts):,} instructions (portable) vs {sum(scalar):,} (TVM's schedules as scalar C)")


if __name__ == "__main__":
    main()
