"""int8 against fp32: the same sparse-update schemes fine-tuned both ways on a transfer task.

    python benchmarks/int8_accuracy.py [--model ds-cnn|mobilenet-v2] [--resolution 128] [--steps 200]
                                       [--schemes 1:1,1:1:0.25,4:2,8:4] [--optimizer adam:0.001] [--batch 8]
                                       [--seeds 0,1,2]

The model is pretrained on the source task as benchmarks/mcu_plans.py does it (DS-CNN: zoo's
synthetic keyword task and its "new microphone" half; MobileNetV2-w0.35: the digits transfer
task). Each scheme `bias:weights[:ratio]` — the last `bias` layers with a bias update it, the last
`weights` of them their weights (in full, or the first `ratio` of their output channels), at
`--batch` with `--optimizer` (`sgd:0.05`: what fits a microcontroller's SRAM, no optimizer state) —
is measured by `planner measure` twice, in
fp32 and in int8 (activations per tensor at scales calibrated on the downstream training data,
weights per channel, trained ones stored as int8 codes), on a target that takes the input in 8 bits as the microcontrollers
do but fine-tunes on this host's VM: a plan's accuracy is a host fine-tune on any target.
Prints a Markdown table: val accuracy before and after each fine-tune and int8's difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

import planner
from planner.inputs.model import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcu_plans import transfer  # noqa: E402

TARGET = "tvm_target: {kind: llvm}\nram_budget_bytes: 64MiB\nprecisions: [fp32, int8]\ninput_bits: 8\n"
SCHEMES = "1:1,1:1:0.25,4:2,8:4"  # layers whose bias trains : of them the last ones whose weight does [: ratio]


def scheme(path: Path, layers: list[str], spec: str, precision: str, optimizer: str, batch: int) -> Path:
    """The scheme `spec` (`bias:weights[:ratio]`) as planner's YAML."""
    bias, weights, *rest = map(float, spec.split(":"))
    ratio = rest[0] if rest else None
    bias, weights = int(bias), int(weights)
    name, lr = optimizer.split(":")
    trained: list[dict[str, object]] = [{"layer": n, "mode": "bias"} for n in layers[-bias:-weights]] if bias > weights else []
    mode: dict[str, object] = {"mode": "full"} if ratio is None else {"mode": "ratio", "ratio": ratio}
    trained += [{"layer": n, **mode} for n in layers[-weights:]]
    body = {"trainable": trained, "batch_size": batch, "optimizer": {"name": name, "lr": float(lr)}, "precision": precision}
    path.write_text(yaml.safe_dump(body))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["ds-cnn", "mobilenet-v2"], default="ds-cnn")
    parser.add_argument("--resolution", type=int, default=128, help="MobileNetV2's input side")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=200, help="fine-tune steps per scheme and precision")
    parser.add_argument("--out", type=Path, default=Path("bench-out/int8"))
    parser.add_argument("--schemes", default=SCHEMES, help="bias:weights[:ratio],... (see above)")
    parser.add_argument("--optimizer", default="adam:0.001", help="NAME:LR (sgd, momentum or adam)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seeds", default="0", help="fine-tuning seeds, comma-separated: each scheme's mean over them")
    args = parser.parse_args()
    out = args.out / args.model
    model, downstream = transfer(args.model, args.resolution, out, args.pretrain_steps)
    layers = [layer.name for layer in load_model(model).layers if layer.params_for("bias")]  # those with a bias
    (out / "target.yaml").write_text(TARGET)
    print(f"\n{args.model}, {args.steps} fine-tune steps, batch {args.batch}, {args.optimizer}, 8-bit input:\n")
    print("| trained | fp32: before -> after | int8: before -> after | int8 - fp32 (after) |")
    print("|---|---:|---:|---:|")
    seeds = [int(s) for s in args.seeds.split(",")]
    for spec in args.schemes.split(","):
        before, after, afters = {}, {}, {}
        for precision in ("fp32", "int8"):
            runs = []
            for seed in seeds:
                name = f"{spec.replace(':', '-')}-{args.optimizer.replace(':', '')}-b{args.batch}-{precision}-s{seed}"
                result = planner.measure(
                    model,
                    scheme=scheme(out / f"{name}.yaml", layers, spec, precision, args.optimizer, args.batch),
                    data=downstream,
                    target=str(out / "target.yaml"),
                    out=out / name,
                    accuracy_steps=args.steps,
                    latency_repeats=1,
                    seed=seed,
                )
                assert result.plan is not None, name
                runs.append(result.plan.metrics.accuracy)
            before[precision] = sum(r.before for r in runs) / len(runs)
            after[precision] = sum(r.after for r in runs) / len(runs)
            afters[precision] = [r.after for r in runs]
            if len(runs) > 1:
                print(f"  {spec} {precision}: " + ", ".join(f"{r.after:.3f}" for r in runs))
        print(
            f"| {spec} | {before['fp32']:.3f} -> {after['fp32']:.3f} | {before['int8']:.3f} -> {after['int8']:.3f} | "
            f"{paired(afters['int8'], afters['fp32'])} |"
        )


def paired(int8: list[float], fp32: list[float]) -> str:
    """int8 - fp32 in points, over the seeds both ran with: the mean and, past one seed, its standard
    error (the seed fixes the data order, so the per-seed differences are the honest sample)."""
    diffs = [100 * (a - b) for a, b in zip(int8, fp32, strict=True)]
    mean = sum(diffs) / len(diffs)
    if len(diffs) == 1:
        return f"{mean:+.1f} pts"
    se = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5
    return f"{mean:+.1f} ± {se:.1f} pts (s.e., {len(diffs)} seeds)"


if __name__ == "__main__":
    main()
