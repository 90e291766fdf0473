"""MobileNetV2-w0.35 at 128x128, batch 1: full update vs the best plan under 1/8 of its memory.

    pip install -e '.[example]'   # scikit-learn, for its bundled digits
    python benchmarks/mobilenet_v2_eighth.py [--trials 16] [--out bench-out/mbv2]

Accuracy is on the example task at MobileNetV2's resolution: the model is first trained in full
(Adam, batch 16) on the source half of scikit-learn's digits — the half `examples/digits` was
pretrained on —, upscaled to 3x128x128; the downstream task is `examples/digits/digits.npz`, the
other half seen by a different sensor, upscaled the same way. Then full fine-tuning at batch 1 is
measured with `planner measure`, and the `sparse-update` space is searched at batch 1 on a target
whose RAM budget is 1/8 of full fine-tuning's peak.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import optuna
import yaml

import planner
from planner.errors import NoFeasiblePlan
from planner.search.records import records

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "digits"


def _scheme(path: Path, layers: list[str], batch: int, optimizer: dict) -> Path:
    path.write_text(
        yaml.safe_dump({"trainable": [{"layer": n, "mode": "full"} for n in layers], "batch_size": batch, "optimizer": optimizer})
    )
    return path


def _upscale(x: np.ndarray, size: int) -> np.ndarray:
    """[N, 1, 8, 8] digits -> [N, 3, size, size], each pixel a size/8 square, grey in RGB."""
    return np.kron(x, np.ones((size // x.shape[-1],) * 2, np.float32)).repeat(3, axis=1)


def digits_tasks(out: Path, size: int) -> tuple[Path, Path]:
    """Source: the digits `examples/digits/make_example.py` pretrained on (its seed-0 permutation's
    first half); downstream: the example's own dataset, the other half under a sensor shift."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    order = np.random.default_rng(0).permutation(len(x))
    source = order[: len(x) // 2]
    np.savez(out / "source.npz", x=_upscale(x[source], size), y=digits.target[source].astype(np.int64))
    with np.load(EXAMPLE / "digits.npz") as d:
        np.savez(out / "downstream.npz", **{k: _upscale(v, size) if k.startswith("x") else v for k, v in d.items()})
    return out / "source.npz", out / "downstream.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--accuracy-steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("bench-out/mbv2"))
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    random_init = zoo.save(zoo.mobilenet_v2(width=0.35, resolution=128), out / "mobilenet_v2_035_128_init.onnx")
    upstream, downstream = digits_tasks(out, 128)
    layers = [layer.name for layer in planner.inspect(random_init).layers]

    pre_scheme = _scheme(out / "pretrain.yaml", layers, 16, {"name": "adam", "lr": 0.001})
    planner.measure(random_init, scheme=pre_scheme, data=upstream, out=out / "pretrain-plan", accuracy_steps=1, latency_repeats=3)
    pre = planner.run(out / "pretrain-plan", data=upstream, steps=args.pretrain_steps, out=out / "pretrained")
    model = out / "pretrained" / "model.onnx"
    print(
        f"source digits (pretraining, full update, Adam, batch 16, {pre.steps} steps): "
        f"val acc {pre.before['accuracy']:.3f} -> {pre.after['accuracy']:.3f}"
    )

    full = _scheme(out / "full.yaml", layers, 1, {"name": "sgd", "lr": 0.01})
    base = planner.measure(
        model, scheme=full, data=downstream, out=out / "full", accuracy_steps=args.accuracy_steps, latency_repeats=5
    )
    full_peak = base.plan.metrics.peak_memory_bytes.total

    target = out / "eighth.yaml"
    target.write_text(
        yaml.safe_dump(
            {
                "description": "host, 1/8 of full update's peak",
                "tvm_target": {"kind": "llvm"},
                "ram_budget_bytes": full_peak // 8,
                "precisions": ["fp32", "bf16"],
            }
        )
    )
    space = yaml.safe_load((Path(__file__).resolve().parent.parent / "search_spaces" / "sparse-update.yaml").read_text())
    space["batch_size"] = [1]
    (out / "space.yaml").write_text(yaml.safe_dump(space))
    try:
        best = planner.plan(
            model=model,
            data=downstream,
            target=str(target),
            space=str(out / "space.yaml"),
            out=out / "plan",
            storage=planner.default_storage(out / "plan"),
            trials=args.trials,
            accuracy_steps=args.accuracy_steps,
            latency_repeats=5,
        )
    except NoFeasiblePlan:
        study = optuna.load_study(study_name="planner", storage=f"sqlite:///{(out / 'plan' / 'study.db').resolve()}")
        done = sorted((t for t in records(study) if t.complete), key=lambda t: t.memory.total)
        print(
            f"no plan under {full_peak // 8 / 2**20:.2f} MiB (1/8 of full update {full_peak / 2**20:.2f} MiB) in "
            f"{len(done)} trials; the leanest:"
        )
        for t in done[:3]:
            print(
                f"  trial {t.number}: {len(t.candidate.trainable)} layers, peak {t.memory.total / 2**20:.2f} MiB "
                f"(1/{full_peak / t.memory.total:.1f} of full), activations {t.memory.activations / 2**20:.2f} MiB, "
                f"{t.latency.median:.1f} ms, val acc {t.accuracy.after:.3f}"
            )
        return

    def row(name: str, plan) -> str:
        mt = plan.metrics
        mem = mt.peak_memory_bytes
        return (
            f"| {name} | {len(plan.choice.trainable)} | {mem.total / 2**20:.2f} | {mem.activations / 2**20:.2f} | "
            f"{mt.step_latency_ms.median:.1f} | {mt.accuracy.before:.3f} → {mt.accuracy.after:.3f} | "
            f"{plan.choice.precision}, frozen weights {plan.choice.frozen_weights} |"
        )

    print(
        f"budget: {full_peak // 8 / 2**20:.2f} MiB (1/8 of full update); {sum(t.complete for t in best.trials)} trials, "
        f"{sum(t.feasible for t in best.trials)} feasible"
    )
    print("| scheme | layers trained | peak MiB | activations MiB | step ms | downstream val acc | storage |")
    print("|---|---|---|---|---|---|---|")
    print(row("full update", base.plan))
    print(row("best plan under 1/8", best.plan))
    print("chosen:", ", ".join(f"{t.layer}:{t.update_mode}" for t in best.plan.choice.trainable))


if __name__ == "__main__":
    main()
