"""MLPerf Tiny's anomaly-detection autoencoder fine-tuned for a new machine on an emulated Cortex-M4.

    pip install -e '.[test]'          # PyTorch builds and exports the model
    python benchmarks/anomaly_autoencoder.py [--trials 16] [--steps 200] [--out bench-out/anomaly]

The model is MLPerf Tiny's ToyADMOS autoencoder as its reference builds it: 640 log-mel values
(5 frames of 128 bands) -> Linear 128, BatchNorm, ReLU four times -> an 8-wide bottleneck -> four
more -> Linear 640 (264,000 parameters, 1.0 MiB in fp32), exported with `torch.onnx.export(
dynamo=False)`. Its dataset cannot be downloaded here, so a stand-in: "normal" frames of machine A
are a random 6-dimensional subspace of the 640 values plus a little noise, machine B's the same
subspace turned a little, louder by 20 %. The model is pretrained in full on machine A on this
host (`planner measure` a full scheme, then `planner run`), then `planner plan --target
cortex-m4-qemu --budgets 256KiB,512KiB` fine-tunes it for machine B on its normal frames only
(`reconstruction`: no labels; the default space; every candidate built as firmware, its SRAM read from the linked
ELF, its step's instructions counted on qemu's Cortex-M4). Prints per budget the plan chosen,
its SRAM, its instructions per step and its val MSE before and after.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import planner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from mobilenet_v2_eighth import _scheme  # noqa: E402

BUDGETS = ("256KiB", "512KiB")
TARGET = "cortex-m4-qemu"


def autoencoder(path: Path) -> Path:
    import torch
    from torch import nn

    class ToyAdmos(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            sizes = [640, 128, 128, 128, 128, 8, 128, 128, 128, 128, 640]
            self.dense = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
            self.norms = nn.ModuleList(nn.BatchNorm1d(b) for b in sizes[1:-1])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for dense, norm in zip(self.dense, self.norms):
                x = torch.relu(norm(dense(x)))
            return self.dense[-1](x)

    torch.manual_seed(0)
    model = ToyAdmos().eval()
    x = torch.zeros(2, 640)
    torch.onnx.export(
        model, (x,), str(path), dynamo=False, input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}}
    )
    return path


def machines(out: Path) -> tuple[Path, Path]:
    """Normal frames of machine A (the source) and of machine B (the same subspace turned, louder)."""
    rng = np.random.default_rng(0)
    basis = rng.normal(size=(6, 640)) / 4
    turned = basis + 0.3 * rng.normal(size=(6, 640)) / 4
    for name, b, gain in (("a", basis, 1.0), ("b", turned, 1.2)):
        frames = gain * rng.normal(size=(1200, 6)) @ b + 0.05 * rng.normal(size=(1200, 640))
        np.savez(out / f"machine_{name}.npz", x=frames.astype(np.float32))
    return out / "machine_a.npz", out / "machine_b.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps per candidate")
    parser.add_argument("--pretrain-steps", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=Path("bench-out/anomaly"))
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = autoencoder(out / "toyadmos.onnx")
    source, target = machines(out)
    layers = [layer.name for layer in planner.inspect(model).layers if layer.trainable]
    scheme = _scheme(out / "pretrain.yaml", layers, 32, {"name": "adam", "lr": 0.001})
    planner.measure(model, scheme=scheme, data=source, out=out / "pretrain-plan", accuracy_steps=1, latency_repeats=1)
    run = planner.run(out / "pretrain-plan", data=source, steps=args.pretrain_steps, out=out / "pretrained")
    print(f"pretrained {args.pretrain_steps} steps on machine A: val mse {run.before['mse']:.4f} -> {run.after['mse']:.4f}")
    result = planner.plan(
        model=out / "pretrained" / "model.onnx",
        data=target,
        target=TARGET,
        budgets=BUDGETS,
        trials=args.trials,
        accuracy_steps=args.steps,
        out=out / "plan",
    )
    print("| budget | plan trains | SRAM (linked) | instructions / step | val mse before → after |")
    print("|---|---|---|---|---|")
    for budget in result.plan.selection.budgets:
        plan_dir = out / "plan" / budget.directory
        if budget.trial is None:
            print(f"| {budget.budget_bytes // 1024} KiB | no trial fits | | | |")
            continue
        p = json.loads((plan_dir / "plan.json").read_text())
        m = p["metrics"]
        trains = ", ".join(f"{t['layer']}:{t['mode']}" for t in p["choice"]["trainable"])
        print(
            f"| {budget.budget_bytes // 1024} KiB | {trains} (batch {p['choice']['batch_size']}) | "
            f"{m['peak_memory_bytes']['total'] / 1024:.1f} KiB | {m['step_latency_ms']['median'] * 25e3:,.0f} | "
            f"{m['accuracy']['before']:.4f} → {m['accuracy']['after']:.4f} |"
        )


if __name__ == "__main__":
    main()
