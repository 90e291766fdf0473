"""MobileNetV2-w0.35 at 128x128, batch 1: full update vs the best plan under 1/8 of its memory.

    python benchmarks/mobilenet_v2_eighth.py [--trials 12] [--out bench-out/mbv2]

No real dataset or pretrained model can be downloaded here, so accuracy is a stated proxy for
transfer learning: the model is first trained in full (batch 16) on `zoo.synthetic_task`
("upstream"); the downstream task is held-out samples of the same classes under a domain shift
(per-channel gain and offset, more noise). Then full fine-tuning at batch 1 is measured with
`planner measure`, and the `sparse-update` space is searched at batch 1 on a target whose RAM
budget is 1/8 of full fine-tuning's peak.
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


def _scheme(path: Path, layers: list[str], batch: int, optimizer: dict) -> Path:
    path.write_text(yaml.safe_dump({"trainable": [{"layer": n, "mode": "full"} for n in layers],
                                    "batch_size": batch, "optimizer": optimizer}))
    return path


def _tasks(out: Path, shape: tuple[int, ...]) -> tuple[Path, Path]:
    """Upstream: 600 samples of the synthetic task; downstream: 300 more under a domain shift."""
    task = zoo.synthetic_task(shape, n=900)
    rng = np.random.default_rng(1)
    x_down = task["x"][600:] * rng.uniform(0.6, 1.4, (1, shape[0], 1, 1)) + rng.normal(0, 0.5, (1, shape[0], 1, 1))
    x_down = x_down + rng.normal(0, 0.5, x_down.shape)
    np.savez(out / "upstream.npz", x=task["x"][:600], y=task["y"][:600])
    np.savez(out / "downstream.npz", x=x_down.astype(np.float32), y=task["y"][600:])
    return out / "upstream.npz", out / "downstream.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--accuracy-steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("bench-out/mbv2"))
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    shape = (3, 128, 128)
    random_init = zoo.save(zoo.mobilenet_v2(width=0.35, resolution=128), out / "mobilenet_v2_035_128_init.onnx")
    upstream, downstream = _tasks(out, shape)
    layers = [layer.name for layer in api.inspect_model(random_init).layers]

    pre_scheme = _scheme(out / "pretrain.yaml", layers, 16, {"name": "momentum", "lr": 0.05})
    api.measure(random_init, pre_scheme, upstream, out=out / "pretrain-plan", accuracy_steps=1, latency_repeats=3)
    pre = api.run_plan(out / "pretrain-plan", data=upstream, steps=args.pretrain_steps, out=out / "pretrained")
    model = out / "pretrained" / "model.onnx"
    print(f"upstream (proxy pretraining, full update, batch 16, {pre.steps} steps): "
          f"val acc {pre.before['accuracy']:.3f} -> {pre.after['accuracy']:.3f}")

    full = _scheme(out / "full.yaml", layers, 1, {"name": "sgd", "lr": 0.01})
    base = api.measure(model, full, downstream, out=out / "full", accuracy_steps=args.accuracy_steps, latency_repeats=5)
    full_peak = base.plan.metrics["peak_memory_bytes"]["total"]

    target = out / "eighth.yaml"
    target.write_text(yaml.safe_dump({"description": "host, 1/8 of full update's peak", "tvm_target": {"kind": "llvm"},
                                      "ram_budget_bytes": full_peak // 8, "precisions": ["fp32", "bf16"]}))
    space = yaml.safe_load((Path(__file__).resolve().parent.parent / "search_spaces" / "sparse-update.yaml").read_text())
    space["batch_size"] = [1]
    (out / "space.yaml").write_text(yaml.safe_dump(space))
    try:
        best = api.plan(model=model, data=downstream, target=str(target), space=str(out / "space.yaml"),
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
                f"{mt['step_latency_ms']['median']:.1f} | {mt['accuracy']['before']:.3f} → {mt['accuracy']['after']:.3f} | "
                f"{plan.choice.precision}, frozen weights {plan.choice.frozen_weights} |")

    print(f"budget: {full_peak // 8 / 2**20:.2f} MiB (1/8 of full update); {sum(t.complete for t in best.trials)} trials, "
          f"{sum(t.feasible for t in best.trials)} feasible")
    print("| scheme | layers trained | peak MiB | activations MiB | step ms | downstream val acc (proxy) | storage |")
    print("|---|---|---|---|---|---|---|")
    print(row("full update", base.plan))
    print(row("best plan under 1/8", best.plan))
    print("chosen:", ", ".join(f"{t['layer']}:{t['mode']}{'@' + str(t['ratio']) if 'ratio' in t else ''}" for t in best.plan.choice.trainable))


if __name__ == "__main__":
    main()
