"""MobileNetV2-w0.35 at 128x128, batch 1: full update vs the best plan under 1/8 of its memory.

    python benchmarks/mobilenet_v2_eighth.py [--trials 12] [--out bench-out/mbv2]

Measures full fine-tuning with `planner measure` (every layer full, batch 1), then searches the
`sparse-update` space at batch 1 on a target whose RAM budget is 1/8 of that peak. Accuracy is on
`planner.zoo.synthetic_task` at 128x128 — a stated proxy: no real dataset can be downloaded here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import optuna
import yaml

from planner import api, zoo
from planner.errors import NoFeasiblePlan
from planner.search import to_record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--accuracy-steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("bench-out/mbv2"))
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = zoo.save(zoo.mobilenet_v2(width=0.35, resolution=128), out / "mobilenet_v2_035_128.onnx")
    np.savez(out / "data.npz", **zoo.synthetic_task((3, 128, 128), n=300))
    m = api.inspect_model(model)

    full = out / "full.yaml"
    full.write_text(yaml.safe_dump({
        "trainable": [{"layer": layer.name, "mode": "full"} for layer in m.layers],
        "batch_size": 1, "optimizer": {"name": "sgd", "lr": 0.01},
    }))
    base = api.measure(model, full, out / "data.npz", out=out / "full", accuracy_steps=args.accuracy_steps, latency_repeats=5)
    full_peak = base.plan.metrics["peak_memory_bytes"]["total"]

    target = out / "eighth.yaml"
    target.write_text(yaml.safe_dump({"description": "host, 1/8 of full update's peak", "tvm_target": {"kind": "llvm"},
                                      "ram_budget_bytes": full_peak // 8}))
    space = yaml.safe_load((Path(__file__).resolve().parent.parent / "search_spaces" / "sparse-update.yaml").read_text())
    space["batch_size"] = [1]
    (out / "space.yaml").write_text(yaml.safe_dump(space))
    try:
        best = api.plan(model=model, data=out / "data.npz", target=str(target), space=str(out / "space.yaml"),
                        out=out / "plan", trials=args.trials, accuracy_steps=args.accuracy_steps, latency_repeats=5)
    except NoFeasiblePlan:
        study = optuna.load_study(study_name="planner", storage=f"sqlite:///{(out / 'plan' / 'study.db').resolve()}")
        done = sorted((to_record(t) for t in study.trials if t.state.name == "COMPLETE"), key=lambda t: t.memory.total)
        print(f"no plan under {full_peak // 8 / 2**20:.2f} MiB (1/8 of full update {full_peak / 2**20:.2f} MiB) in "
              f"{len(done)} trials; the leanest:")
        for t in done[:3]:
            print(f"  trial {t.number}: {len(t.candidate.trainable)} layers, peak {t.memory.total / 2**20:.2f} MiB "
                  f"(1/{full_peak / t.memory.total:.1f} of full), activations {t.memory.activations / 2**20:.2f} MiB, "
                  f"{t.latency.median:.1f} ms, val acc {t.accuracy.after:.3f}")
        return

    def row(name: str, plan) -> str:
        mt = plan.metrics
        mem = mt["peak_memory_bytes"]
        return (f"| {name} | {len(plan.choice.trainable)} | {mem['total'] / 2**20:.2f} | {mem['activations'] / 2**20:.2f} | "
                f"{mt['step_latency_ms']['median']:.1f} | {mt['accuracy']['before']:.3f} → {mt['accuracy']['after']:.3f} |")

    print(f"budget: {full_peak // 8 / 2**20:.2f} MiB (1/8 of full update); {sum(t.complete for t in best.trials)} trials, "
          f"{sum(t.feasible for t in best.trials)} feasible")
    print("| scheme | layers trained | peak MiB | activations MiB | step ms | val acc (proxy) |")
    print("|---|---|---|---|---|---|")
    print(row("full update", base.plan))
    print(row("best plan under 1/8", best.plan))
    print("chosen:", ", ".join(f"{t['layer']}:{t['mode']}{'@' + str(t['ratio']) if 'ratio' in t else ''}" for t in best.plan.choice.trainable))


if __name__ == "__main__":
    main()
