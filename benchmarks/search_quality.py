"""Search quality: planner's search (the space's hand-made recipes first, then multivariate TPE)
against random search over the same space, at equal trial counts.

    pip install -e '.[example]'   # scikit-learn, for the transfer tasks' digits
    python benchmarks/search_quality.py --task mobilenet --space sparse-update --seeds 0 1 2 3 4
    python benchmarks/search_quality.py --task vit --space depths --trials 50 --random-trials 100
    python benchmarks/search_quality.py --task example --space depths per-layer --trials 20 --random-trials 20

Tasks (those of `benchmarks/memory_frontier.py`, pretrained on the source digits and adapted to
the example's shifted ones; the pretrained models are kept under `--out` and reused):

- `example`: the bundled example (its CNN and data);
- `mobilenet`: MobileNetV2-w0.35 at 96×96 (tests/zoo.py, BatchNorm kept as layers: 104 of them);
- `vit`: a one-block vision transformer (`vit_block`, 4×4 patches, 32 wide) at 16×16;
- `vit-wide`: two blocks, 128 wide, at 16×16: steps that compute more (0.2-11 ms here).

Each seed runs planner's search for `--trials` trials and random search for `--random-trials`
(`--ablation` adds TPE without the recipes); shorter runs are their prefixes by trial number,
so one 50-trial study gives the 20-trial figure too.

Score: the hypervolume of a run's feasible Pareto front over (1 - val accuracy, step latency,
peak memory). 1 - accuracy is already in [0, 1]; latency and memory are placed on a log scale
between the smallest (0) and the largest (1) value any run of the table saw (every sampler, seed
and trial), and the reference point is (1, 1.1, 1.1): a front's volume is the share of that box
it dominates, and ratios compare within one table only. Why a log scale: on MobileNetV2 the
trials span three orders of magnitude (1 ms to seconds a step), and divided by the largest, every
step under a tenth of the slowest one would sit within 0.1 of zero, so that halving a step's time
or memory there would barely count; on a log scale each halving counts the same. `--linear`
divides by the largest instead (this benchmark's score before MobileNetV2 was added). "Trials to reach random-100" is the first prefix of planner's run
whose hypervolume reaches random search's at `--random-trials`, per seed and on the means.
"Pooled" puts a table's ratios in context: every feasible trial of the table (all searches and
seeds) pooled, its front's hypervolume, and that of the best 1, 3 and 20 of them (chosen
greedily). Where one trial already holds most of the pooled front, as on a ViT's
`sparse-update` (docs/benchmarks.md), a lead at 20 trials is capped by how soon a search draws it.
Accuracy results are cached across the samplers of a seed (they fine-tune a shared candidate
identically), which saves time, not trials.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import optuna
from optuna._hypervolume import compute_hypervolume

import planner
from planner.inputs.model import load_model
from planner.inputs.spaces import load_space
from planner.search.study import AnchoredSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memory_frontier import pretrained  # noqa: E402

import zoo  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "digits"
REFERENCE = np.array([1.0, 1.1, 1.1])
# Adam steps (batch 16, lr 1e-3) each task's model pretrains on the source digits. The ViT learns
# slowly: 400 steps leave it at val acc 0.46, 3000 at 0.67, where it stays (10000: 0.65); the wide
# one reaches 0.633 in 3000.
PRETRAIN = {"mobilenet": 400, "vit": 3000, "vit-wide": 3000}
# each transfer task's model and input size
MODELS = {
    "mobilenet": (lambda: zoo.mobilenet_v2(width=0.35, resolution=96), 96),
    "vit": (lambda: zoo.vit_block(resolution=16, patch=4, dim=32, mlp=64, classes=10), 16),
    "vit-wide": (lambda: zoo.vit_block(resolution=16, patch=4, dim=128, mlp=256, classes=10, blocks=2), 16),
}
# other Optuna samplers (`--samplers`), each started from the space's recipes as planner's TPE is
OTHERS = {
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed, population_size=10),
    "qmc": lambda seed: optuna.samplers.QMCSampler(seed=seed, scramble=True),
    "tpe-univariate": lambda seed: optuna.samplers.TPESampler(seed=seed, n_startup_trials=8),
    "tpe-startup-4": lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=4),
    "tpe-gamma-30": lambda seed: optuna.samplers.TPESampler(
        seed=seed, multivariate=True, n_startup_trials=8, gamma=lambda n: min(int(np.ceil(0.3 * n)), 25)
    ),
    "tpe-group": lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=8),
    "gp": lambda seed: optuna.samplers.GPSampler(seed=seed, n_startup_trials=8),
}


def task(name: str, out: Path, pretrain_steps: int) -> tuple[Path, Path]:
    """The task's model and downstream data, pretrained once and kept under `out`."""
    if name == "example":
        return EXAMPLE / "model.onnx", EXAMPLE / "digits.npz"
    done = out / name / "pretrained" / "model.onnx", out / name / "downstream.npz"
    if all(p.exists() for p in done):
        return done
    make, size = MODELS[name]
    return pretrained(out / name, make(), size, pretrain_steps)


def points(result: planner.PlanResult) -> list[tuple[int, tuple[float, float, float] | None]]:
    """Each trial by number: its objectives if feasible, else None (it still used a trial). A
    trial the machine cut short (PRUNED: an interrupted run's, queued again) is no trial."""
    return sorted(
        (t.number, (1 - t.accuracy.after, t.latency.median, float(t.memory.total)) if t.feasible else None)
        for t in result.trials
        if t.state != "PRUNED"
    )


def normaliser(points: np.ndarray, linear: bool):
    """Objectives -> the unit box: 1 - accuracy as it is; latency and memory on a log scale between
    the smallest and largest of `points` (`linear`: divided by the largest)."""
    lo, hi = points.min(axis=0), points.max(axis=0)

    def normalise(p: np.ndarray) -> np.ndarray:
        q = p.astype(float).copy()
        for j in (1, 2):
            q[:, j] = p[:, j] / hi[j] if linear else np.log(p[:, j] / lo[j]) / max(np.log(hi[j] / lo[j]), 1e-12)
        return q

    return normalise


def hypervolume(trials: list, n: int, normalise) -> float:
    """The hypervolume of the first `n` trials' feasible front, in `normalise`'s unit box."""
    front = np.array([p for _, p in trials[:n] if p is not None])
    return float(compute_hypervolume(normalise(front), REFERENCE)) if len(front) else 0.0


def best_subsets(front: np.ndarray, sizes: list[int]) -> dict[int, float]:
    """The hypervolume of the `k` points of `front` (normalised) that together dominate the most,
    for each `k` in `sizes`, chosen greedily (within 1 - 1/e of the best `k`-subset): how much of
    a table's best-known front a few lucky trials already hold, which bounds what any search can
    lead random search by at a given trial count."""
    chosen: list[int] = []
    found = {}
    for k in range(1, max(sizes) + 1):
        rest = [i for i in range(len(front)) if i not in chosen]
        if not rest:
            break
        chosen.append(max(rest, key=lambda i: compute_hypervolume(front[[*chosen, i]], REFERENCE)))
        if k in sizes:
            found[k] = float(compute_hypervolume(front[chosen], REFERENCE))
    return found


def main() -> None:
    sys.setswitchinterval(0.0005)  # shorter GIL turns for trials side by side, as `planner plan` sets them
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["example", *MODELS], default="example")
    parser.add_argument("--space", nargs="+", default=[None], help="shipped spaces or YAML paths (default: planner's)")
    parser.add_argument("--trials", type=int, default=50, help="planner's search, per seed")
    parser.add_argument("--random-trials", type=int, default=100, help="random search, per seed")
    parser.add_argument("--at", type=int, nargs="+", default=[20, 50], help="trial counts to compare at")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--ablation", action="store_true", help="also TPE without the hand-made recipes")
    parser.add_argument("--samplers", nargs="*", default=[], choices=sorted(OTHERS), help="other Optuna samplers to compare")
    parser.add_argument("--accuracy-steps", type=int, default=None, help="planner's --accuracy-steps (default: its own)")
    parser.add_argument("--linear", action="store_true", help="latency and memory divided by the largest, not log-scaled")
    parser.add_argument(
        "--pretrain-steps", type=int, default=None, help=f"pretraining steps on the source digits (default: {PRETRAIN})"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/search-quality"))
    args = parser.parse_args()
    model, data = task(args.task, args.out, args.pretrain_steps or PRETRAIN.get(args.task, 0))
    searches = {"planner": ("tpe", True, args.trials), "random": ("random", False, args.random_trials)}
    if args.ablation:
        searches["tpe-no-anchors"] = ("tpe", False, args.trials)
    searches |= {name: (name, True, args.trials) for name in args.samplers}
    runs = {(name, space): how for space in args.space for name, how in searches.items()}
    trials: dict[tuple, list] = {}
    t0 = time.perf_counter()
    for seed in args.seeds:
        for (name, space), (sampler, anchors, n) in runs.items():
            where = args.out / f"{args.task}-{space or 'default'}"
            out = where / f"{name}-{seed}"
            if sampler in OTHERS:  # an Optuna sampler object, started from the same recipes
                recipes = load_space(space).anchors(load_model(model))
                sampler, anchors = AnchoredSampler(OTHERS[sampler](seed), recipes), False
            # an existing study is resumed: a run interrupted, or extended by seeds, redoes nothing
            result = planner.plan(
                model=model,
                data=data,
                space=space,
                out=out,
                storage=planner.default_storage(out),
                trials=n,
                seed=seed,
                sampler=sampler,
                anchors=anchors,
                cache_dir=where / f"cache-{seed}",
                **({"accuracy_steps": args.accuracy_steps} if args.accuracy_steps else {}),
            )
            trials[name, space, seed] = points(result)[:n]
            feasible = sum(p is not None for _, p in trials[name, space, seed])
            print(
                f"seed {seed} {name} ({space or 'default space'}): {feasible} feasible of {len(result.trials)} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    scale = normaliser(np.array([p for ts in trials.values() for _, p in ts if p is not None]), args.linear)
    counts = {run: [a for a in sorted({*args.at, n}) if a <= n] for run, (_, _, n) in runs.items()}
    columns = sorted({a for c in counts.values() for a in c})
    hv = {(*run, s, a): hypervolume(trials[(*run, s)], a, scale) for run in runs for s in args.seeds for a in counts[run]}
    mean = {(*run, a): float(np.mean([hv[(*run, s, a)] for s in args.seeds])) for run in runs for a in counts[run]}

    how = "latency and memory divided by the largest" if args.linear else "latency and memory log-scaled"
    print(f"\n{args.task}: hypervolume ({how}), mean over seeds {' '.join(map(str, args.seeds))} (min-max)\n")
    print("| search | space | " + " | ".join(f"{a} trials" for a in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for run in runs:
        cells = []
        for a in columns:
            values = [hv[(*run, s, a)] for s in args.seeds] if a in counts[run] else []
            cells.append(f"{mean[(*run, a)]:.4f} ({min(values):.4f}-{max(values):.4f})" if values else "—")
        print(f"| {run[0]} | {run[1] or 'default'} | " + " | ".join(cells) + " |")
    for space in args.space:
        label = space or "default"
        for a in counts["planner", space]:
            if ("random", space, a) in mean:
                print(
                    f"\n{label}: planner / random at {a} trials: **{mean['planner', space, a] / mean['random', space, a]:.2f}x**"
                )
        goal = args.random_trials
        curve = [
            np.mean([hypervolume(trials["planner", space, s], n, scale) for s in args.seeds]) for n in range(1, args.trials + 1)
        ]
        on_means = next((n + 1 for n, v in enumerate(curve) if v >= mean["random", space, goal]), None)
        per_seed = []
        for s in args.seeds:
            ts, target = trials["planner", space, s], hv["random", space, s, goal]
            reach = next((n for n in range(1, args.trials + 1) if hypervolume(ts, n, scale) >= target), None)
            per_seed.append("—" if reach is None else str(reach))
        print(
            f"{label}: trials planner needs to reach random search's {goal}-trial hypervolume: "
            f"{on_means or f'more than {args.trials}'} on the means; per seed {', '.join(per_seed)} "
            f"('—': not within {args.trials})"
        )
        pooled = scale(np.array([p for (_, sp, _), ts in trials.items() if sp == space for _, p in ts if p is not None]))
        front = pooled[[not np.any(np.all(pooled <= q, axis=1) & np.any(pooled < q, axis=1)) for q in pooled]]
        best = best_subsets(front, [1, 3, 20])
        print(
            f"{label}: every trial of this table pooled ({len(pooled)} feasible): hypervolume "
            f"{compute_hypervolume(front, REFERENCE):.4f}; its best "
            + ", ".join(f"{k} trial{'s' * (k > 1)}: {v:.4f}" for k, v in best.items())
        )


if __name__ == "__main__":
    main()
