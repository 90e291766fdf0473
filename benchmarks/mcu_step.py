"""One microcontroller step, taken apart: its SRAM by part (from the linked ELF) and its instructions by
kind of kernel (counted on the emulated core).

    python benchmarks/mcu_step.py [--model mobilenet-v2|ds-cnn] [--resolution 128] [--target stm32f746-disco]
                                  [--trained classifier:bias] [--frozen-weights int8] [--batch 1] [--precision int8] [--recompute auto]

MobileNetV2-w0.35 (tests/zoo.py) at `--resolution`, or MLPerf Tiny's DS-CNN; `--trained` lists
`layer:mode` pairs (`last:N` trains the biases of the last N layers). The SRAM is the ELF's: the
arena (the input batch until its last reader, every activation, gradient and kernel scratch,
placed by lifetime), labels and logits, trainable weights and optimizer state, the stack. Instructions under `qemu -icount`:
deterministic, one run. `--precision int8` quantizes the activations at scales calibrated on random inputs (the scales
change neither SRAM nor instructions).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import numpy as np

from planner.backend import backend_for
from planner.inputs.calibration import calibrate
from planner.inputs.data import load_dataset
from planner.inputs.model import load_model
from planner.inputs.preprocess import Preprocess, parse_text
from planner.inputs.targets import load_target
from planner.measurement.qemu import kernel_instructions
from planner.types import Candidate, Encoding

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # noqa: E402

IMAGENET = Preprocess(parse_text("ToTensor(), Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])"))


def _kind(kernel: str) -> str:
    """A kernel's family, as the table groups them."""
    if kernel.startswith("conv2d_q"):
        return "dense convolutions, int8 activations (conv_q)"
    if kernel.startswith("depthwise_conv2d_q"):
        return "depthwise convolutions, int8 activations (dwconv_q)"
    if "gemm" in kernel:
        return "dense convolutions (im2col + sgemm)"
    if kernel.startswith("depthwise_conv2d_c"):
        return "depthwise convolutions (dwconv.c)"
    if "conv2d" in kernel:
        return "other convolutions (TVM)"
    return "elementwise, pooling, loss, updates (TVM)"


def _random_data(model, path: Path):
    """32 random samples of the model's input (uniform over [-2, 2]) and labels, loaded."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (32, *model.only_input.static)).astype(np.float32)
    np.savez(path, x=x, y=rng.integers(0, model.n_classes, 32))
    return load_dataset(path, model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mobilenet-v2", "ds-cnn"], default="mobilenet-v2")
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--target", default="stm32f746-disco")
    parser.add_argument("--trained", default="classifier:bias", help="layer:mode,... or last:N (the last N layers' biases)")
    parser.add_argument("--frozen-weights", choices=["fp32", "int8"], default="int8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--top", type=int, default=0, help="list the N calls that cost most instructions")
    parser.add_argument("--precision", choices=["fp32", "int8"], default="fp32")
    parser.add_argument("--recompute", choices=["none", "auto"], default="none")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="mcu-step-"))
    proto = zoo.mobilenet_v2(0.35, args.resolution) if args.model == "mobilenet-v2" else zoo.ds_cnn()
    model = load_model(zoo.save(proto, out / "model.onnx"))
    if args.trained.startswith("last:"):
        names = [layer.name for layer in model.layers if layer.trainable]
        trained = tuple((name, "bias") for name in names[-int(args.trained[5:]) :])
    else:
        trained = tuple(tuple(pair.split(":", 1)) for pair in args.trained.split(","))
    candidate = Candidate(
        trained,
        batch_size=args.batch,
        optimizer="sgd",
        lr=0.01,
        frozen_weights=args.frozen_weights,
        precision=args.precision,
        recompute=args.recompute,
    )
    target = load_target(args.target)
    if target.input_bits == 8:  # as `planner plan` takes it on the target: images as pixels, arrays calibrated
        spec = model.only_input
        code = IMAGENET.pixel_encoding(spec.static[0]) if args.model == "mobilenet-v2" else Encoding((0.1,), (-12.8,))
        model = model.encoded({spec.name: code})
    if args.precision == "int8":  # scales from random inputs: what they are changes neither SRAM nor instructions
        model = model.calibrated(calibrate(model, _random_data(model, out / "calibration.npz")))
    firmware = backend_for(target, cache_dir=out / "cache").build(model, candidate)
    counts = kernel_instructions(firmware, dict(model.initializers), target.mcu)
    m = firmware.memory
    sig = firmware.signature
    batch = args.batch * sum(int(np.prod(i.static)) * np.dtype(i.dtype).itemsize for i in sig.inputs)
    print(
        f"{args.model} {args.resolution}, {args.trained}, batch {args.batch}, {args.precision}, frozen weights {candidate.frozen_weights}, "
        f"input {'8-bit codes' if target.input_bits == 8 else 'fp32'}, {target.name}"
    )
    print(
        f"SRAM {m.total / 1024:.1f} KiB: arena, labels and logits {m.activations / 1024:.1f} (the input batch "
        f"{batch / 1024:.1f} of it until its last reader), "
        f"trainable {m.trainable_params / 1024:.1f}, optimizer {m.optimizer_state / 1024:.1f}, stack and C library "
        f"{m.scratch / 1024:.1f}; flash {firmware.flash_bytes / 1024:.1f} KiB"
    )
    by: collections.Counter[str] = collections.Counter()
    macs: collections.Counter[str] = collections.Counter()
    for (kernel, flops), count in zip(firmware.calls, counts):
        by[_kind(kernel)] += count
        macs[_kind(kernel)] += flops // 2
    print(f"instructions per step: {sum(counts) / 1e6:.1f} M")
    for kind, count in by.most_common():
        per = f", {count / macs[kind]:.2f} per multiply-accumulate" if macs[kind] else ""
        print(f"  {kind}: {count / 1e6:.1f} M{per}")
    costliest = sorted(zip(counts, firmware.calls), reverse=True)[: args.top]
    for count, (kernel, flops) in costliest:  # `--top N`: the calls that cost most
        per = f", {2 * count / flops:.2f} per multiply-accumulate" if flops else ""
        print(f"    {kernel}: {count / 1e6:.2f} M{per}")


if __name__ == "__main__":
    main()
