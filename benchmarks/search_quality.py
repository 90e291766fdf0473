"""Search quality: planner's search (the space's hand-made recipes first, then multivariate TPE)
against random search over the same space, at equal trial counts.

    pip install -e '.[example]'   # scikit-learn, for the transfer tasks' digits
    python benchmarks/search_quality.py --task mobilenet --space sparse-update --seeds 0 1 2 3 4
    python benchmarks/search_quality.py --task vit --space depths --trials 50 --random-trials 100
    python benchmarks/search_quality.py --task example --trials 20 --random-trials 20 --ablation

Tasks (those of `benchmarks/memory_frontier.py`, pretrained on the source digits and adapted to
the example's shifted ones; the pretrained models are kept under `--out` and reused):

- `example`: the bundled example (its CNN and data);
- `mobilenet`: MobileNetV2-w0.35 at 96×96 (tests/zoo.py, BatchNorm kept as layers: 104 of them);
- `vit`: a one-block vision transformer (`vit_block`, 4×4 patches, 32 wide) at 16×16.

Each seed runs planner's search for `--trials` trials and random search for `--random-trials`
(`--ablation` adds TPE without the recipes); shorter runs are their prefixes by trial number,
so one 50-trial study gives the 20-trial figure too.

Score: the hypervolume of a run's feasible Pareto front over (1 - val accuracy, step latency,
peak memory). Latency and memory are divided by the largest value any run of the table saw
(every sampler, seed and trial), 1 - accuracy is already in [0, 1], and the reference point is
(1, 1.1, 1.1): a front's volume is then the share of that box it dominates, and the ratios
compare within one table only. "Trials to reach random-100" is the first prefix of planner's run
whose hypervolume reaches random search's at `--random-trials`, per seed and on the means.
Accuracy results are cached across the samplers of a seed (they fine-tune a shared candidate
identically), which saves time, not trials.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from optuna._hypervolume import compute_hypervolume

import planner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memory_frontier import pretrained  # noqa: E402

import zoo  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "digits"
REFERENCE = np.array([1.0, 1.1, 1.1])


def task(name: str, out: Path, pretrain_steps: int) -> tuple[Path, Path]:
    """The task's model and downstream data, pretrained once and kept under `out`."""
    if name == "example":
        return EXAMPLE / "model.onnx", EXAMPLE / "digits.npz"
    done = out / name / "pretrained" / "model.onnx", out / name / "downstream.npz"
    if all(p.exists() for p in done):
        return done
    if name == "mobilenet":
        return pretrained(out / name, zoo.mobilenet_v2(width=0.35, resolution=96), 96, pretrain_steps)
    return pretrained(out / name, zoo.vit_block(resolution=16, patch=4, dim=32, mlp=64, classes=10), 16, pretrain_steps)


def points(result: planner.PlanResult) -> list[tuple[int, tuple[float, float, float] | None]]:
    """Each trial by number: its objectives if feasible, else None (it still used a trial)."""
    return sorted(
        (t.number, (1 - t.accuracy.after, t.latency.median, float(t.memory.total)) if t.feasible else None) for t in result.trials
    )


def hypervolume(trials: list, n: int, scale: np.ndarray) -> float:
    """The hypervolume of the first `n` trials' feasible front, normalised by `scale`."""
    front = np.array([p for _, p in trials[:n] if p is not None])
    return float(compute_hypervolume(front / scale, REFERENCE)) if len(front) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["example", "mobilenet", "vit"], default="example")
    parser.add_argument("--space", default=None, help="a shipped space or YAML path (default: planner's)")
    parser.add_argument("--trials", type=int, default=50, help="planner's search, per seed")
    parser.add_argument("--random-trials", type=int, default=100, help="random search, per seed")
    parser.add_argument("--at", type=int, nargs="+", default=[20, 50], help="trial counts to compare at")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--ablation", action="store_true", help="also TPE without the hand-made recipes")
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("bench-out/search-quality"))
    args = parser.parse_args()
    model, data = task(args.task, args.out, args.pretrain_steps)
    runs = {"planner": ("tpe", True, args.trials), "random": ("random", False, args.random_trials)}
    if args.ablation:
        runs["tpe-no-anchors"] = ("tpe", False, args.trials)
    label = f"{args.task}-{args.space or 'default'}"
    trials: dict[tuple[str, int], list] = {}
    t0 = time.perf_counter()
    for seed in args.seeds:
        cache = args.out / label / f"cache-{seed}"
        for run, (sampler, anchors, n) in runs.items():
            out = args.out / label / f"{run}-{seed}"
            result = planner.plan(
                model=model,
                data=data,
                space=args.space,
                out=out,
                storage=planner.default_storage(out),
                trials=n,
                seed=seed,
                sampler=sampler,
                anchors=anchors,
                cache_dir=cache,
            )
            trials[run, seed] = points(result)
            feasible = sum(p is not None for _, p in trials[run, seed])
            print(
                f"seed {seed} {run}: {feasible} feasible of {len(result.trials)} ({time.perf_counter() - t0:.0f} s)", flush=True
            )
    every = np.array([p for ts in trials.values() for _, p in ts if p is not None])
    scale = np.max(every, axis=0)
    scale[0] = 1.0  # 1 - accuracy is already in [0, 1]
    counts = {run: [a for a in sorted({*args.at, n}) if a <= n] for run, (_, _, n) in runs.items()}
    hv = {(run, s, a): hypervolume(trials[run, s], a, scale) for run in runs for s in args.seeds for a in counts[run]}
    mean = {(run, a): float(np.mean([hv[run, s, a] for s in args.seeds])) for run in runs for a in counts[run]}

    print(f"\n{label}: hypervolume, mean over seeds {' '.join(map(str, args.seeds))} (min-max)\n")
    print("| search | " + " | ".join(f"{a} trials" for a in sorted({a for c in counts.values() for a in c})) + " |")
    print("|---|" + "---|" * len({a for c in counts.values() for a in c}))
    for run in runs:
        cells = []
        for a in sorted({a for c in counts.values() for a in c}):
            if a not in counts[run]:
                cells.append("—")
                continue
            values = [hv[run, s, a] for s in args.seeds]
            cells.append(f"{mean[run, a]:.4f} ({min(values):.4f}-{max(values):.4f})")
        print(f"| {run} | " + " | ".join(cells) + " |")
    for a in counts["planner"]:
        if ("random", a) in mean:
            print(f"\nplanner / random at {a} trials: **{mean['planner', a] / mean['random', a]:.2f}x**")
    goal = args.random_trials
    per_seed = []
    for s in args.seeds:
        reach = next(
            (n for n in range(1, args.trials + 1) if hypervolume(trials["planner", s], n, scale) >= hv["random", s, goal]), None
        )
        per_seed.append("—" if reach is None else str(reach))
    curve = [np.mean([hypervolume(trials["planner", s], n, scale) for s in args.seeds]) for n in range(1, args.trials + 1)]
    on_means = next((n + 1 for n, v in enumerate(curve) if v >= mean["random", goal]), None)
    print(
        f"\ntrials planner needs to reach random search's {goal}-trial hypervolume: "
        f"{on_means or f'more than {args.trials}'} on the means; per seed {', '.join(per_seed)} ('—': not within {args.trials})"
    )


if __name__ == "__main__":
    main()
