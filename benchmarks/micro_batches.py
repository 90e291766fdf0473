"""Micro-batches: one update of 16 samples in 1, 2, 4, 8 or 16 forward/backward passes.

    python benchmarks/micro_batches.py [--threads 2] [--repeats 5]

MobileNetV2-w0.35 at 64×64 (tests/zoo.py), the layers the memory frontier's leanest accurate plan
trains (`b16.project_bn` and `last` in full, `last_bn` and `classifier` biases; Adam; frozen
weights int8), and for reference every layer in full at batch 16. For each split of the 16
samples (`batch_size` × `grad_accum`): the planned peak and its parts (the running sums count
among the activations), and the step time (the VM's time evaluator, median of the repeats). The weights are random: memory and time do not depend on
them, and the same split of the same batch trains the same (BatchNorm runs on its statistics).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from step_vs_pytorch import on_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

TRAINED = (("b16.project_bn", "full"), ("last", "full"), ("last_bn", "bias"), ("classifier", "bias"))
SPLITS = ((16, 1), (8, 2), (4, 4), (2, 8), (1, 16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    on_threads(args.threads)
    import tvm

    import zoo
    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.inputs.model import load_model
    from planner.measurement.latency import time_step
    from planner.runtime.session import TrainingSession
    from planner.types import Candidate

    build = BuildOptions(tvm.target.Target({"kind": "llvm"}))
    mib = 2**20
    print(f"MobileNetV2-w0.35 @64, Adam, {args.threads} threads\n")
    print(
        "| trained | batch × micro-batches | planned MiB | activations | trained weights | optimizer state | frozen | scratch | step ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(zoo.save(zoo.mobilenet_v2(0.35, 64), Path(tmp) / "mbv2.onnx"))
        every = tuple((layer.name, "full") for layer in model.layers if layer.trainable)
        runs = [("every layer", every, 16, 1, "fp32")] + [("last layers", TRAINED, b, k, "int8") for b, k in SPLITS]
        for label, trained, batch, accum, frozen in runs:
            cand = Candidate(trained, batch, "adam", 0.001, grad_accum=accum, frozen_weights=frozen)
            step = compile_candidate(model, cand, build)
            m = step.memory
            session = TrainingSession(step.library, step.signature, model.initializers)
            ms = time_step(session, args.repeats, "local").median
            print(
                f"| {label} | {batch} × {accum} | {m.total / mib:.2f} | {m.activations / mib:.2f} | "
                f"{(m.trainable_params + m.gradients) / mib:.2f} | {m.optimizer_state / mib:.2f} | "
                f"{m.frozen_params / mib:.2f} | {m.scratch / mib:.2f} | {ms:.1f} |"
            )


if __name__ == "__main__":
    main()
