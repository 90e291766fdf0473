"""Search quality: planner's search (hand-made schemes first, then multivariate TPE) vs random
search at equal trial counts, with TPE alone as the ablation.

    python benchmarks/search_quality.py [--trials 20] [--seeds 0 1 2]

Plans the bundled example with each sampler and seed, then scores each study by the hypervolume
of its feasible Pareto front over (1 - val accuracy, step latency, peak memory), latency and memory
divided by the largest value any run saw, against the reference point (1, 1.1, 1.1). Higher is
better; the ratio of the means is the headline. Accuracy results are cached across runs of the
same seed (both samplers fine-tune a candidate they share identically), which saves time, not
trials.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from optuna._hypervolume import compute_hypervolume

import planner

# name -> (sampler, start from the space's hand-made schemes)
SAMPLERS = {"tpe": ("tpe", True), "tpe-no-anchors": ("tpe", False), "random": ("random", False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--screen-steps", type=int, default=None, help="planner's --screen-steps (default: its own)")
    parser.add_argument("--no-overlap", action="store_true", help="planner's --no-overlap: one trial at a time")
    args = parser.parse_args()
    fronts: dict[tuple[str, int], np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for seed in args.seeds:
            for sampler, (name, anchors) in SAMPLERS.items():
                result = planner.plan(
                    out=Path(tmp) / f"{sampler}-{seed}",
                    trials=args.trials,
                    seed=seed,
                    sampler=name,
                    anchors=anchors,
                    cache_dir=cache,
                    screen_steps=args.screen_steps,
                    overlap=not args.no_overlap,
                )
                fronts[sampler, seed] = np.array(
                    [(1 - t.accuracy.after, t.latency.median, t.memory.total) for t in result.trials if t.feasible]
                )
                print(f"seed {seed} {sampler}: {len(fronts[sampler, seed])} feasible of {len(result.trials)}", flush=True)
    scale = np.max(np.concatenate(list(fronts.values())), axis=0)
    scale[0] = 1.0  # 1 - accuracy is already in [0, 1]
    reference = np.array([1.0, 1.1, 1.1])
    hv = {key: compute_hypervolume(points / scale, reference) if len(points) else 0.0 for key, points in fronts.items()}
    print("\n| sampler | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |")
    print("|---|" + "---|" * (len(args.seeds) + 1))
    means = {}
    for sampler in SAMPLERS:
        values = [hv[sampler, s] for s in args.seeds]
        means[sampler] = float(np.mean(values))
        print(f"| {sampler} | " + " | ".join(f"{v:.4f}" for v in values) + f" | {means[sampler]:.4f} |")
    for sampler in ("tpe", "tpe-no-anchors"):
        print(
            f"\nhypervolume, {sampler} / random: {means[sampler] / means['random']:.2f}x "
            f"({args.trials} trials, {len(args.seeds)} seeds)"
        )


if __name__ == "__main__":
    main()
