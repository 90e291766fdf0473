"""Plans for a microcontroller: the leanest plan per SRAM budget, measured on an emulated Cortex-M4.

    python benchmarks/mcu_plans.py [--model ds-cnn|mobilenet-v2] [--trials 24] [--out bench-out/mcu]
                                   [--resolution 96] [--target cortex-m4-qemu] [--budgets 256KiB,320KiB,512KiB]
                                   [--batch-sizes 1] [--optimizers sgd]

For MLPerf Tiny's keyword-spotting DS-CNN on [1, 49, 10] MFCC-shaped input (tests/zoo.py; its real
dataset cannot be downloaded here, so a stand-in: zoo's synthetic task, 12 classes, pretrained in
full on this host on one half and fine-tuned on the other half under a feature shift, a "new
microphone"), or MobileNetV2-w0.35 at 96x96 on the digits transfer task of
benchmarks/mobilenet_v2_eighth.py: `planner plan --target cortex-m4-qemu --space sparse-update
--budgets 256KiB,320KiB,512KiB` (every candidate built as firmware, its SRAM and flash read from
the linked ELF, its step's instructions counted on qemu's Cortex-M4; accuracy from a fine-tune on
this host). Prints a Markdown table: per budget, the plan planner picks (the least SRAM within a
point of the best accuracy under that budget) beside the best accuracy any candidate under it
reached.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import yaml

import planner
from planner.errors import NoFeasiblePlan
from planner.inputs.targets import load_target, parse_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from mobilenet_v2_eighth import _scheme, digits_tasks  # noqa: E402

import zoo  # noqa: E402

BUDGETS = ("256KiB", "320KiB", "512KiB")
TARGET = "cortex-m4-qemu"


def kws_tasks(out: Path) -> tuple[Path, Path]:
    """Source and downstream halves of zoo's synthetic [1, 49, 10] task; downstream features
    scaled and offset (another microphone's gain and floor) and split 80/20."""
    task = zoo.synthetic_task((1, 49, 10), classes=12, n=2048, seed=0)
    x, y = task["x"], task["y"]
    np.savez(out / "source.npz", x=x[:1024], y=y[:1024])
    np.savez(out / "downstream.npz", x=(0.8 * x[1024:] + 0.3).astype(np.float32), y=y[1024:])
    return out / "source.npz", out / "downstream.npz"


def pretrained(model: Path, source: Path, out: Path, steps: int) -> Path:
    """`model` trained in full on `source` on this host (Adam, batch 16)."""
    layers = [layer.name for layer in planner.inspect(model).layers]
    scheme = _scheme(out / "pretrain.yaml", layers, 16, {"name": "adam", "lr": 0.001})
    planner.measure(model, scheme=scheme, data=source, out=out / "pretrain-plan", accuracy_steps=1, latency_repeats=1)
    run = planner.run(out / "pretrain-plan", data=source, steps=steps, out=out / "pretrained")
    print(f"pretrained {steps} steps on the source task: val acc {run.before['accuracy']:.3f} -> {run.after['accuracy']:.3f}")
    return out / "pretrained" / "model.onnx"


def transfer(name: str, resolution: int, out: Path, pretrain_steps: int) -> tuple[Path, Path]:
    """(the model pretrained on its source task, its downstream task) in `out`: DS-CNN on zoo's
    keyword task, or MobileNetV2-w0.35 at `resolution` on the digits."""
    out.mkdir(parents=True, exist_ok=True)
    if name == "ds-cnn":
        init = zoo.save(zoo.ds_cnn(), out / "ds_cnn_init.onnx")
        source, downstream = kws_tasks(out)
    else:
        init = zoo.save(zoo.mobilenet_v2(width=0.35, resolution=resolution), out / f"mobilenet_v2_035_{resolution}_init.onnx")
        source, downstream = digits_tasks(out, resolution)
    return pretrained(init, source, out, pretrain_steps), downstream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["ds-cnn", "mobilenet-v2"], default="ds-cnn")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--accuracy-steps", type=int, default=100)
    parser.add_argument("--target", default=TARGET, help="a microcontroller target of hw_targets/")
    parser.add_argument("--budgets", default=",".join(BUDGETS), help="SRAM budgets, comma-separated")
    parser.add_argument("--resolution", type=int, default=96, help="MobileNetV2's input side")
    parser.add_argument("--batch-sizes", default=None, help="the batch sizes searched, comma-separated (default: the space's)")
    parser.add_argument("--optimizers", default=None, help="the optimizers searched, comma-separated (default: the space's)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/mcu"))
    args = parser.parse_args()
    budgets = tuple(args.budgets.split(","))
    out = args.out / args.model
    model, downstream = transfer(args.model, args.resolution, out, args.pretrain_steps)
    space = yaml.safe_load((Path(__file__).resolve().parent.parent / "search_spaces" / "sparse-update.yaml").read_text())
    if args.batch_sizes:  # TinyEngine's reference setup trains at batch 1
        space["batch_size"] = [int(b) for b in args.batch_sizes.split(",")]
    if args.optimizers:  # sgd: no optimizer state, the least SRAM a weight update takes
        space["optimizer"] = args.optimizers.split(",")
        space["lr"] = {k: v for k, v in space["lr"].items() if k in space["optimizer"]}
    (out / "space.yaml").write_text(yaml.safe_dump(space))
    try:
        result = planner.plan(
            model=model,
            data=downstream,
            target=args.target,
            space=str(out / "space.yaml"),
            out=out / "plan",
            storage=planner.default_storage(out / "plan"),
            trials=args.trials,
            accuracy_steps=args.accuracy_steps,
            latency_repeats=3,
            budgets=budgets,
        )
    except NoFeasiblePlan as exc:  # every trial over the target's own SRAM or flash: the table would be empty
        print(f"\n{args.model} on {args.target}: {exc}")
        return
    clock = load_target(args.target).mcu.clock_hz
    done = [t for t in result.trials if t.complete and t.memory is not None and t.accuracy is not None]
    print(f"\n{args.model}, {len(done)} trials on {args.target}:\n")
    print("| SRAM budget | plan: SRAM (ELF) | flash | trained layers | instructions per step | val acc | best under budget |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for label in budgets:
        budget = parse_bytes(label)
        under = [t for t in done if t.memory.total <= budget and not t.over_budget.get("flash_budget", 0) > 0]
        best = max((t.accuracy.after for t in under), default=None)
        path = out / "plan" / label / "plan.json"
        if not path.exists():
            print(f"| {label} | no plan | | | | | {'-' if best is None else f'{best:.3f}'} |")
            continue
        plan = json.loads(path.read_text())
        m = plan["metrics"]
        choice = plan["choice"]
        layers = ", ".join(f"{u['layer']}:{u['mode']}" for u in choice["trainable"])
        instructions = round(m["step_latency_ms"]["median"] * clock / 1e3)  # the target's clock, one per cycle
        print(
            f"| {label} | {m['peak_memory_bytes']['total'] / 1024:.1f} KiB | {m['library_bytes'] / 1024:.1f} KiB | {layers} "
            f"({choice['precision']}, batch {choice['batch_size']}, {choice['optimizer']['name']}) | {instructions:,} | "
            f"{m['accuracy']['before']:.3f} -> {m['accuracy']['after']:.3f} | {best:.3f} |"
        )


if __name__ == "__main__":
    main()
