"""Accuracy against memory: full update, the leanest plan as accurate, and a plan per budget.

    pip install -e '.[example]'   # scikit-learn, for its bundled digits
    python benchmarks/memory_frontier.py [--tasks digits mobilenet vit] [--trials 40]
        [--accuracy-steps 150] [--out bench-out/frontier]

Three transfer tasks, each a model trained on a source task and adapted to a shifted one, as the
bundled example is (the other half of scikit-learn's digits, seen by an inverted-contrast
sensor):

- `digits`: the bundled example itself (its CNN and data);
- `mobilenet`: MobileNetV2-w0.35 at 64×64 pretrained here (full update, Adam) on the source half
  of the digits upscaled to 3×64×64, adapted to the example's data upscaled the same way;
- `vit`: a one-block vision transformer (`vit_block` of tests/zoo.py, 4×4 patches, 32 wide) at
  16×16, pretrained and adapted the same way.

For each, full update (every layer, batch 16, the best of three learning rates) is measured with
`planner measure`; then two studies of `--trials` trials each search the memory-lean spaces, one
without and one with recomputation and LoRA, on a target whose RAM budget is full update's peak,
with `--budgets` at 1/4, 1/10 and 1/20 of it. Printed per task and space: full update's peak and
accuracy, the leanest trial within one point of full update's accuracy (and how many times
smaller it is), and the plan each budget got. Every number comes from the plans and studies
written under `--out`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from mobilenet_v2_eighth import digits_tasks

import planner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "digits"
FULL_BATCH = 16
FULL_LRS = ({"name": "sgd", "lr": 0.05}, {"name": "momentum", "lr": 0.01}, {"name": "adam", "lr": 0.001})
SHARES = (4, 10, 20)  # budgets: full update's peak divided by these
POINT = 0.01

# the lean spaces: sparse depth, per-layer modes, small (micro-)batches, int8 frozen weights; `with` adds
# LoRA adapters and recomputation
LEAN = {
    "strategy": "sparse",
    "modes": ["frozen", "bias", "full", "ratio"],
    "ratios": [0.25, 0.5],
    "batch_size": [1, 2, 4],
    "grad_accum": [1, 2, 4, 8, 16],  # micro-batches per update: the effective batch is the product
    "optimizer": ["sgd", "momentum", "adam"],
    "lr": {"low": 0.001, "high": 0.1, "log": True},
    "frozen_weights": ["fp32", "int8"],
}
SPACES = {
    "without": {**LEAN, "recompute": ["none"]},
    "with recompute + LoRA": {**LEAN, "modes": [*LEAN["modes"], "lora"], "ranks": [2, 4, 8], "recompute": ["none", "auto"]},
}


def _scheme(path: Path, layers: list[str], batch: int, optimizer: dict) -> Path:
    path.write_text(yaml.safe_dump({"trainable": [{"layer": n} for n in layers], "batch_size": batch, "optimizer": optimizer}))
    return path


def pretrained(out: Path, model, size: int, steps: int) -> tuple[Path, Path]:
    """`model` trained in full on the source digits; returns it and the downstream data."""
    out.mkdir(parents=True, exist_ok=True)
    init = zoo.save(model, out / "init.onnx")
    source, downstream = digits_tasks(out, size)
    layers = [layer.name for layer in planner.inspect(init).layers if layer.trainable]
    scheme = _scheme(out / "pretrain.yaml", layers, 16, {"name": "adam", "lr": 0.001})
    planner.measure(init, scheme=scheme, data=source, out=out / "pretrain-plan", accuracy_steps=1, latency_repeats=1)
    pre = planner.run(out / "pretrain-plan", data=source, steps=steps, out=out / "pretrained")
    print(f"  pretrained on the source digits: val acc {pre.before['accuracy']:.3f} -> {pre.after['accuracy']:.3f}")
    return out / "pretrained" / "model.onnx", downstream


def _task(name: str, out: Path, pretrain_steps: int) -> tuple[Path, Path]:
    if name == "digits":
        return EXAMPLE / "model.onnx", EXAMPLE / "digits.npz"
    if name == "mobilenet":
        return pretrained(out, zoo.mobilenet_v2(width=0.35, resolution=64), 64, pretrain_steps)
    return pretrained(out, zoo.vit_block(resolution=16, patch=4, dim=32, mlp=64, classes=10), 16, pretrain_steps)


def _full_update(model: Path, data: Path, out: Path, accuracy_steps: int):
    """Full update at batch 16 with the best of three optimizers/learning rates."""
    out.mkdir(parents=True, exist_ok=True)
    layers = [layer.name for layer in planner.inspect(model).layers if layer.trainable]
    best = None
    for opt in FULL_LRS:
        scheme = _scheme(out / f"full-{opt['name']}.yaml", layers, FULL_BATCH, opt)
        plan = planner.measure(
            model, scheme=scheme, data=data, out=out / f"full-{opt['name']}", accuracy_steps=accuracy_steps, latency_repeats=5
        ).plan
        if best is None or plan.metrics.accuracy.after > best.metrics.accuracy.after:
            best = plan
    assert best is not None
    return best


def _search(model: Path, data: Path, out: Path, space: dict, full_peak: int, args) -> planner.PlanResult:
    out.mkdir(parents=True, exist_ok=True)
    target = out / "target.yaml"
    target.write_text(
        yaml.safe_dump({"description": "host, full update's peak", "tvm_target": {"kind": "llvm"}, "ram_budget_bytes": full_peak})
    )
    (out / "space.yaml").write_text(yaml.safe_dump({"name": out.name, **space}))
    return planner.plan(
        model=model,
        data=data,
        target=str(target),
        space=str(out / "space.yaml"),
        out=out / "plan",
        storage=planner.default_storage(out / "plan"),
        trials=args.trials,
        accuracy_steps=args.accuracy_steps,
        latency_repeats=5,
        budgets=[full_peak // s for s in SHARES] + [full_peak],
    )


def _describe(t) -> str:
    c = t.candidate
    modes = ", ".join(f"{n}:{m}" for n, m in c.trainable)
    batch = f"batch {c.batch_size}" + (f" × {c.grad_accum} micro-batches" if c.grad_accum > 1 else "")
    extra = [batch, str(c.optimizer), f"frozen {c.frozen_weights}"]
    if c.recompute != "none":
        extra.append(f"recompute {c.recompute if isinstance(c.recompute, str) else 'listed'}")
    return f"{modes} ({', '.join(extra)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["digits", "mobilenet", "vit"], choices=["digits", "mobilenet", "vit"])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--accuracy-steps", type=int, default=150)
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("bench-out/frontier"))
    args = parser.parse_args()

    rows = []
    for task in args.tasks:
        out = args.out / task
        print(f"{task}:")
        model, data = _task(task, out / "task", args.pretrain_steps)
        full = _full_update(model, data, out, args.accuracy_steps)
        peak, acc = full.metrics.peak_memory_bytes.total, full.metrics.accuracy.after
        print(f"  full update: {peak / 2**20:.2f} MiB, val acc {acc:.3f} ({full.choice.optimizer.name})")
        for label, space in SPACES.items():
            result = _search(model, data, out / label.split()[0], space, peak, args)
            done = [t for t in result.trials if t.feasible]
            close = [t for t in done if t.accuracy.after >= acc - POINT]
            lean = min(close, key=lambda t: t.memory.total) if close else None
            per_budget = []
            for b in result.plan.selection.budgets[:-1]:
                t = next((t for t in result.trials if t.number == b.trial), None)
                per_budget.append(
                    f"1/{peak // b.budget_bytes}: "
                    + (f"{t.memory.total / 2**20:.2f} MiB, {t.accuracy.after:.3f}" if t else "none fits")
                )
            rows.append(
                f"| {task} | {label} | {peak / 2**20:.2f} MiB, {acc:.3f} | "
                + (
                    f"{lean.memory.total / 2**20:.2f} MiB (**{peak / lean.memory.total:.1f}×** smaller), "
                    f"{lean.accuracy.after:.3f}: {_describe(lean)}"
                    if lean
                    else "none within a point"
                )
                + f" | {'; '.join(per_budget)} | {len(done)} of {len(result.trials)} |"
            )
            print(" ", rows[-1])
    print()
    print(
        "| task | space | full update (peak, val acc) | leanest within 1 point of full update | "
        "plan per budget (peak, val acc) | feasible trials |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
