"""In-place updates inside the backward pass vs a functional step that writes new weights.

    python benchmarks/update_memory.py [--batch 8] [--threads 2] [--repeats 10]

For the models of `step_vs_pytorch.py`, every layer trained, with plain SGD and with momentum:
compiles the step with `updates: copy` (new weights and optimizer states in new buffers — the
plain functional step) and `updates: in-place` (each update right after its gradient, written
over the old weight), and prints both planned peaks, both measured peaks (resident-set growth
over three steps, each in a fresh process) and both step times.
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
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    env = on_threads(args.threads)
    import zoo
    from planner.inputs.model import load_model
    from planner.measurement.latency import time_step
    from planner.runtime.session import TrainingSession

    print(f"batch {args.batch}, every layer trained, {args.threads} threads\n")
    print(
        "| model | optimizer | planned MiB copy → in-place | saving | measured MiB copy → in-place | saving "
        "| step ms copy → in-place | updates in place |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, (builder, kwargs) in MODELS.items():
            path = zoo.save(getattr(zoo, builder)(**kwargs), Path(tmp) / f"{builder}.onnx")
            layers = [layer.name for layer in load_model(path).layers]
            for optimizer in ("sgd", "momentum"):
                planned, measured, ms, in_place = {}, {}, {}, 0
                for updates in ("copy", "in-place"):
                    model, compiled = planner_step(path, layers, args.batch, optimizer, updates)
                    session = TrainingSession(compiled.library, compiled.signature, model.initializers)
                    ms[updates] = time_step(session, args.repeats, "local").median
                    planned[updates] = compiled.memory.total / 2**20
                    spec = {
                        "framework": "planner",
                        "model": str(path),
                        "batch": args.batch,
                        "layers": layers,
                        "optimizer": optimizer,
                        "updates": updates,
                        "threads": args.threads,
                    }
                    measured[updates] = peak_growth(spec, env) / 2**20
                    in_place = max(in_place, compiled.in_place_updates)
                n_updated = len(compiled.signature.trainable) + len(compiled.signature.optim_states)
                print(
                    f"| {label} | {optimizer} | {planned['copy']:.2f} → {planned['in-place']:.2f} | "
                    f"{1 - planned['in-place'] / planned['copy']:.0%} | {measured['copy']:.2f} → {measured['in-place']:.2f} | "
                    f"{1 - measured['in-place'] / measured['copy']:.0%} | {ms['copy']:.2f} → {ms['in-place']:.2f} | "
                    f"{in_place} of {n_updated} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
