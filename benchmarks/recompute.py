"""Recomputation: a full update's peak memory and step time, keeping every activation vs `auto`.

    python benchmarks/recompute.py [--batches 8 32] [--threads 2] [--repeats 10]

For the models of `step_vs_pytorch.py` (tests/zoo.py), every layer trained with plain SGD:
compiles the step with `recompute: none` and `recompute: auto` and prints both planned peaks,
both measured peaks (resident-set growth over three steps, each in a fresh process), both step
times (the VM's time evaluator, median of the repeats) and the layers whose inputs `auto` kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from step_vs_pytorch import MODELS, on_threads, peak_growth, planner_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    env = on_threads(args.threads)
    import zoo
    from planner.inputs.model import load_model
    from planner.measurement.latency import time_step
    from planner.runtime.session import TrainingSession

    print(f"every layer trained, plain SGD, {args.threads} threads\n")
    print("| model | batch | planned MiB none → auto | measured MiB none → auto | step ms none → auto | kept (auto) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, (builder, kwargs) in MODELS.items():
            path = zoo.save(getattr(zoo, builder)(**kwargs), Path(tmp) / f"{builder}.onnx")
            layers = [layer.name for layer in load_model(path).layers]
            for batch in args.batches:
                planned, measured, ms, kept = {}, {}, {}, ()
                for recompute in ("none", "auto"):
                    model, compiled = planner_step(path, layers, batch, recompute=recompute)
                    session = TrainingSession(compiled.library, compiled.signature, model.initializers)
                    ms[recompute] = time_step(session, args.repeats, "local").median
                    planned[recompute] = compiled.memory.total / 2**20
                    spec = {"framework": "planner", "model": str(path), "batch": batch, "layers": layers, "recompute": recompute}
                    measured[recompute] = peak_growth(spec, env) / 2**20
                    kept = compiled.signature.kept or kept
                print(
                    f"| {label} | {batch} | {planned['none']:.2f} → {planned['auto']:.2f} "
                    f"({planned['none'] / planned['auto']:.2f}×) | {measured['none']:.2f} → {measured['auto']:.2f} | "
                    f"{ms['none']:.2f} → {ms['auto']:.2f} ({ms['auto'] / ms['none']:.2f}×) | {', '.join(kept) or '—'} |"
                )


if __name__ == "__main__":
    main()
