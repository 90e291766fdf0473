"""The memory estimate a search screens budgets with, against the compiled plan's figure.

    pip install -e '.[test]'   # PyTorch, for the families' exports
    python benchmarks/memory_estimate.py [--exporter dynamo] [--batches 2 8] [--families mobilenet_v2 vit]

For every PyTorch family of tests/torch_families.py, three schemes (every layer in full, every
bias, the last layer) at each batch size: the peak `planner.backend.graph.estimate` tells from the
training graph before compiling, the peak the compiled step plans (`planner.backend.graph.memory`),
and their ratio. Prints a row per case, then the range per family and overall, the figures
behind `LOW`, `HIGH` and `SLACK` in planner/backend/graph/estimate.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import torch_families as tf  # noqa: E402
from planner.backend.graph.estimate import HIGH, LOW, SLACK, estimate  # noqa: E402
from planner.backend.lower.pipeline import BuildOptions, training_module  # noqa: E402
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import load_model  # noqa: E402
from planner.inputs.targets import load_target  # noqa: E402
from planner.types import Candidate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exporter", choices=tf.EXPORTERS, default="dynamo")
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--families", nargs="+", default=list(tf.FAMILIES), choices=list(tf.FAMILIES))
    parser.add_argument("--cache", type=Path, default=None, help="compile cache (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build = BuildOptions.for_target(load_target("host"), cache_dir=args.cache or Path(tmp))
        ratios: dict[str, list[float]] = {}
        outside = 0
        print("| family | scheme | batch | estimated KiB | compiled KiB | compiled / estimated |")
        print("|---|---|---|---|---|---|")
        for family in args.families:
            model = load_model(tf.export(family, args.exporter))
            layers = [layer for layer in model.layers if layer.trainable and (layer.weight or layer.bias)]
            schemes = {
                "full": [(layer.name, "full") for layer in layers],
                "bias": [(layer.name, "bias") for layer in layers if layer.bias],
                "last": [(layers[-1].name, "full")],
            }
            for scheme, trainable in schemes.items():
                for batch in args.batches if trainable else ():
                    candidate = Candidate(trainable=tuple(trainable), batch_size=batch, optimizer="sgd", lr=0.01)
                    mod, sig = training_module(model, candidate)
                    estimated = estimate(mod["train_step"], sig, candidate).memory.total
                    compiled = compile_candidate(model, candidate, build).memory.total
                    ratios.setdefault(family, []).append(compiled / estimated)
                    outside += not LOW * estimated <= compiled <= HIGH * estimated + SLACK
                    print(
                        f"| {family} | {scheme} | {batch} | {estimated / 1024:,.1f} | {compiled / 1024:,.1f} | "
                        f"{compiled / estimated:.3f} |",
                        flush=True,
                    )
    print("\n| family | compiled / estimated |\n|---|---|")
    for family, values in ratios.items():
        print(f"| {family} | {min(values):.3f}-{max(values):.3f} |")
    every = [r for values in ratios.values() for r in values]
    print(
        f"\n{len(every)} cases: compiled / estimated {min(every):.3f}-{max(every):.3f}; "
        f"{outside} outside {LOW} x estimate <= compiled <= {HIGH} x estimate + {SLACK // 1024} KiB"
    )


if __name__ == "__main__":
    main()
