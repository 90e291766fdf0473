"""How fast planner plans, and where the time goes.

    python benchmarks/planner_throughput.py [--trials 20] [--tune-trials 0]
    python benchmarks/planner_throughput.py --model mobilenet_v2-0.35@96 --trials 100 --cold-only
    python benchmarks/planner_throughput.py ... --screen-steps 0   # every candidate fine-tuned fully
    python benchmarks/planner_throughput.py ... --no-overlap       # one trial at a time (no compile beside a fine-tune)

Plans twice over one fresh cache directory: cold (empty compile and accuracy caches), then warm (a
new study with the same seed over the same caches, so every candidate it proposes was compiled
and fine-tuned before and is neither again). Prints trials per hour and the share of wall time
spent compiling, tuning, measuring latency, fine-tuning for accuracy, and the rest (the sampler,
storage, process start). `--model example` is the bundled example with its default space;
`mobilenet_v2-0.35@96` is MobileNetV2-w0.35 at 96x96 (tests/zoo.py) on a synthetic 10-class task
(`zoo.synthetic_task`, 400 images) with the `sparse-update` space.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import planner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # noqa: E402

PARTS = ("compile_s", "tune_s", "measure_s", "accuracy_s")


def workload(name: str, directory: Path) -> dict:
    """`planner.plan` arguments for a named workload."""
    if name == "example":
        return {}
    model = zoo.save(zoo.mobilenet_v2(width=0.35, resolution=96), directory / "mobilenet_v2.onnx")
    np.savez(directory / "task.npz", **zoo.synthetic_task((3, 96, 96), n=400))
    return {"model": model, "data": directory / "task.npz", "space": "sparse-update"}


def run(out: Path, cache: Path, trials: int, inputs: dict) -> tuple[float, dict[str, float], int, int, int]:
    t0 = time.perf_counter()
    result = planner.plan(out=out, trials=trials, cache_dir=cache, **inputs)
    wall = time.perf_counter() - t0
    spent = {p: sum(t.seconds.get(p, 0.0) for t in result.trials) for p in PARTS}
    screened = sum(t.screened_out for t in result.trials)
    return wall, spent, len(result.trials), sum(t.state == "FAIL" for t in result.trials), screened


def main() -> None:
    sys.setswitchinterval(0.0005)  # shorter GIL turns for trials side by side, as `planner plan` sets them
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--tune-trials", type=int, default=0)
    parser.add_argument("--model", choices=["example", "mobilenet_v2-0.35@96"], default="example")
    parser.add_argument("--cold-only", action="store_true", help="skip the warm-cache rerun")
    parser.add_argument("--screen-steps", type=int, default=None, help="planner's --screen-steps (default: its own)")
    parser.add_argument("--no-overlap", action="store_true", help="planner's --no-overlap: one trial at a time")
    args = parser.parse_args()
    print("| run | trials (failed, screened out) | wall s | trials/hour | compile | tune | measure | accuracy | other |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        inputs = workload(args.model, Path(tmp)) | {
            "tune_trials": args.tune_trials,
            "screen_steps": args.screen_steps,
            "overlap": not args.no_overlap,
        }
        for label in ("cold cache",) if args.cold_only else ("cold cache", "warm cache"):
            wall, spent, n, failed, screened = run(Path(tmp) / label.replace(" ", "-"), cache, args.trials, inputs)
            other = max(0.0, wall - sum(spent.values()))
            shares = " | ".join(f"{spent[p]:.1f} s ({spent[p] / wall:.0%})" for p in PARTS)
            print(
                f"| {label} | {n} ({failed}, {screened}) | {wall:.1f} | {n / wall * 3600:,.0f} | {shares} | {other:.1f} s ({other / wall:.0%}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
