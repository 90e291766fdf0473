"""Each edge architecture family through `planner plan --space sparse-update` on a synthetic task.

    python benchmarks/sparse_update_families.py [--trials 8] [--out bench-out]

Prints, per family, the finished/failed trials, the feasible Pareto front's size and the chosen
plan (trainable set, accuracy, step latency, peak memory), all measured on this host. The
accuracies are on `synthetic_task` of tests/zoo.py, a proxy: no real dataset can be downloaded here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import planner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # noqa: E402

FAMILIES = {
    "mobilenet_v2-0.35@32": lambda: zoo.mobilenet_v2(width=0.35, resolution=32),
    "resnet8@32": lambda: zoo.resnet(8, resolution=32),
    "mcunet@32": lambda: zoo.mcunet(resolution=32),
    "vit_block@32": lambda: zoo.vit_block(resolution=32),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--accuracy-steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("bench-out/families"))
    args = parser.parse_args()
    rows = []
    for name, build in FAMILIES.items():
        d = args.out / name
        d.mkdir(parents=True, exist_ok=True)
        model = zoo.save(build(), d / "model.onnx")
        np.savez(d / "data.npz", **zoo.synthetic_task((3, 32, 32), n=400))
        t0 = time.perf_counter()
        result = planner.plan(
            model=model,
            data=d / "data.npz",
            space="sparse-update",
            out=d / "plan",
            trials=args.trials,
            accuracy_steps=args.accuracy_steps,
            latency_repeats=5,
        )
        p, m = result.plan, result.plan.metrics
        rows.append(
            (
                name,
                sum(t.complete for t in result.trials),
                sum(t.state == "FAIL" for t in result.trials),
                len(p.pareto),
                len(p.choice.trainable),
                f"{p.choice.precision}/{p.choice.frozen_weights}",
                m.accuracy.after,
                m.step_latency_ms.median,
                m.peak_memory_bytes.total / 1024,
                time.perf_counter() - t0,
            )
        )
        print(f"{name}: done in {rows[-1][-1]:.0f} s", flush=True)
    print(
        "\n| family | complete | failed | Pareto | layers trained | precision / frozen weights | val acc (proxy) | step ms | peak KiB | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]:.3f} | {r[7]:.2f} | {r[8]:,.0f} | {r[9]:.0f} |")


if __name__ == "__main__":
    main()
