"""A training step in planner (TVM) vs PyTorch eager, side by side, on this host.

    pip install -e '.[bench]'
    python benchmarks/step_vs_pytorch.py [--threads 2] [--repeats 10] [--rounds 3] [--models tiny_cnn@28 ...]

For the tiny CNN, MobileNetV2-0.35 at 96x96 and ResNet-8 at 32x32 (tests/zoo.py; PyTorch runs
the same graph with torch ops), and torchvision's resnet18 and mobilenet_v3_small at 64x64
(exported with `torch.onnx.export(dynamo=False)`, which folds BatchNorm into the convolutions;
PyTorch runs the native torchvision module in eval mode, BatchNorm included), at batch 8 and 32,
with every layer trained ("full") and with the last quarter of the layers trained ("sparse"): the
same weights, trainable set, plain SGD and thread count in both. Printed per row:

- step time: planner's compiled step (the VM's time evaluator, as a plan measures it) and
  PyTorch's (forward, cross-entropy, backward, `optimizer.step()`; median of timed repeats),
  measured in alternating rounds (median over rounds) so both see the host's drift alike;
- peak memory: each framework's resident-set growth over its first steps, each in a fresh
  process (planner's own planned peak alongside);
- achieved GFLOP/s (forward plus the backward the trainable set needs, from Conv/Gemm shapes)
  as a share of this host's numpy float32 matmul GFLOP/s, measured in the same run.

BatchNorm runs in inference form (running statistics) in both, as planner trains it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MODELS = {
    "tiny_cnn@28": ("tiny_cnn", {"resolution": 28}),
    "mobilenet_v2-0.35@96": ("mobilenet_v2", {"width": 0.35, "resolution": 96}),
    "resnet8@32": ("resnet", {"depth": 8, "resolution": 32}),
}
TORCHVISION = {"resnet18@64": ("resnet18", 64), "mobilenet_v3_small@64": ("mobilenet_v3_small", 64)}
NUM_CLASSES = 10
BATCHES = (8, 32)
LR = 0.01


def on_threads(threads: int) -> dict[str, str]:
    """This script re-run with TVM (and OpenMP) on `threads` threads, unless it already is:
    TVM reads TVM_NUM_THREADS once, at start-up. Returns the environment, for child processes."""
    env = {**os.environ, "TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    if os.environ.get("TVM_NUM_THREADS") != str(threads):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return env


def trainable_layers(layers: list[str], update: str) -> list[str]:
    return layers if update == "full" else layers[-max(2, len(layers) // 4) :]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the resident-set high-water mark (VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


# --- PyTorch: the ONNX graph interpreted with torch ops, parameters named as in ONNX ----------


def torch_model(proto: onnx.ModelProto):
    import torch
    import torch.nn.functional as F

    class OnnxModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.params = torch.nn.ParameterDict(
                {
                    t.name.replace(".", "/"): torch.nn.Parameter(torch.from_numpy(numpy_helper.to_array(t).copy()))
                    for t in proto.graph.initializer
                }
            )

        def p(self, name: str):
            return self.params[name.replace(".", "/")]

        def forward(self, x):
            env = {proto.graph.input[0].name: x}
            for node in proto.graph.node:
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                ins = [env[i] if i in env else self.p(i) for i in node.input]
                op = node.op_type
                if op == "Constant":
                    out = torch.from_numpy(numpy_helper.to_array(attrs["value"]).copy())
                elif op == "Conv":
                    pads = attrs.get("pads", [0, 0, 0, 0])
                    out = F.conv2d(
                        ins[0],
                        ins[1],
                        ins[2] if len(ins) > 2 else None,
                        attrs.get("strides", [1, 1]),
                        pads[:2],
                        1,
                        attrs.get("group", 1),
                    )
                elif op == "BatchNormalization":
                    out = F.batch_norm(ins[0], ins[3], ins[4], ins[1], ins[2], False, 0.0, attrs.get("epsilon", 1e-5))
                elif op == "Relu":
                    out = F.relu(ins[0])
                elif op == "Clip":
                    out = torch.clamp(ins[0], float(ins[1]), float(ins[2]))
                elif op == "Add":
                    out = ins[0] + ins[1]
                elif op == "GlobalAveragePool":
                    out = ins[0].mean(dim=(2, 3), keepdim=True)
                elif op == "Flatten":
                    out = ins[0].flatten(1)
                elif op == "Gemm":
                    out = F.linear(ins[0], ins[1] if attrs.get("transB") else ins[1].t(), ins[2])
                else:
                    raise NotImplementedError(op)
                env[node.output[0]] = out
            return env[proto.graph.output[0].name]

    return OnnxModule()


def torchvision_module(name: str):
    """torchvision's `name`, 10 classes, seeded weights, eval mode (BatchNorm on running
    statistics, as planner trains it); importable with CPU torch (tests/torch_families.py)."""
    import torch

    import torch_families

    torch.manual_seed(0)
    return getattr(torch_families._torchvision_models(), name)(num_classes=NUM_CLASSES).eval()


def export_torchvision(name: str, resolution: int, path: Path) -> Path:
    import torch

    x = torch.randn(1, 3, resolution, resolution)
    torch.onnx.export(torchvision_module(name), x, str(path), dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    return path


def torchvision_trainable(module, layers: list[str]) -> list:
    """The native module's parameters behind planner's trained layers: each layer is a module
    path (the legacy exporter names nodes by path), and a convolution's BatchNorm (folded into
    it by the export) is the module registered right after it."""
    import torch

    modules = list(module.named_modules())
    wanted = set(layers)
    params = []
    for i, (path, m) in enumerate(modules):
        if path in wanted:
            params += list(m.parameters(recurse=False))
            if isinstance(m, torch.nn.Conv2d) and i + 1 < len(modules) and isinstance(modules[i + 1][1], torch.nn.BatchNorm2d):
                params += list(modules[i + 1][1].parameters(recurse=False))
    return params


def torch_step_setup(proto: onnx.ModelProto, params: list[str], batch: int, native: str | None = None, layers=()):
    import torch

    if native is None:
        model = torch_model(proto).eval()  # BN on running statistics, as planner trains it
        keep = {p.replace(".", "/") for p in params}
        for name, param in model.params.items():
            param.requires_grad_(name in keep)
        trained = [p for n, p in model.params.items() if n in keep]
    else:
        model = torchvision_module(native)
        trained = torchvision_trainable(model, list(layers))
        for param in model.parameters():
            param.requires_grad_(False)
        for param in trained:
            param.requires_grad_(True)
    opt = torch.optim.SGD(trained, lr=LR)
    shape = [batch, *[d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim[1:]]]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    y = torch.arange(batch) % 10

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def time_torch(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        number = 0
        while time.perf_counter() - t0 < 0.02 or number == 0:
            step()
            number += 1
        times.append((time.perf_counter() - t0) / number * 1e3)
    return float(np.median(times))


# --- planner ----------------------------------------------------------------------------------


def planner_step(
    model_path: Path, layers: list[str], batch: int, optimizer: str = "sgd", updates: str = "in-place", recompute: str = "none"
):
    import tvm

    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.inputs.model import load_model
    from planner.types import Candidate

    model = load_model(model_path)
    cand = Candidate(tuple((n, "full") for n in layers), batch, optimizer, LR, updates=updates, recompute=recompute)
    return model, compile_candidate(model, cand, BuildOptions(tvm.target.Target({"kind": "llvm"})))


# --- the child process that measures one framework's memory -----------------------------------


def probe(spec: dict) -> None:
    """Runs in a fresh process: resident-set growth over three steps, after setup."""
    proto = onnx.load(spec["model"])
    if spec["framework"] == "torch":
        import torch

        torch.set_num_threads(spec["threads"])
        step = torch_step_setup(proto, spec["params"], spec["batch"], spec.get("native"), spec.get("layers", ()))
    else:
        from planner.runtime.session import TrainingSession

        model, compiled = planner_step(
            Path(spec["model"]),
            spec["layers"],
            spec["batch"],
            spec.get("optimizer", "sgd"),
            spec.get("updates", "in-place"),
            spec.get("recompute", "none"),
        )
        session = TrainingSession(compiled.library, compiled.signature, model.initializers)
        sig = compiled.signature
        x = np.random.default_rng(0).standard_normal((sig.batch_size, *sig.inputs[0].shape)).astype("float32")
        y = np.arange(sig.batch_size) % sig.n_classes

        def step() -> None:
            session.step(x, y)

    _reset_peak_rss()
    base = _rss()
    for _ in range(3):
        step()
    print(json.dumps({"peak_growth": _peak_rss() - base}))


def peak_growth(spec: dict, env: dict) -> int:
    out = subprocess.run(
        [sys.executable, __file__, "--probe", json.dumps(spec)], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth"]


# --- FLOPs --------------------------------------------------------------------------------------


def layer_flops(proto: onnx.ModelProto, batch: int) -> dict[str, float]:
    """Forward FLOPs (2 x multiply-adds) of each Conv and Gemm node, by node name."""
    inferred = onnx.shape_inference.infer_shapes(proto)
    shapes = {
        v.name: [d.dim_value or batch for d in v.type.tensor_type.shape.dim]
        for v in [*inferred.graph.value_info, *inferred.graph.output]
    }
    inits = {t.name: list(t.dims) for t in proto.graph.initializer}
    flops = {}
    for node in proto.graph.node:
        if node.op_type == "Conv":
            out = shapes[node.output[0]]
            w = inits[node.input[1]]
            flops[node.name] = 2.0 * batch * np.prod(out[1:]) * np.prod(w[1:])
        elif node.op_type == "Gemm":
            w = inits[node.input[1]]
            flops[node.name] = 2.0 * batch * w[0] * w[1]
    return flops


def step_flops(flops: dict[str, float], layers: list[str], trained: list[str]) -> float:
    """Forward everywhere; input gradients back to the deepest trained layer; weight gradients
    of the trained layers."""
    deepest = layers.index(trained[0])
    behind = [n for n in layers[deepest + 1 :] if n in flops]
    return sum(flops.values()) + sum(flops[n] for n in behind) + sum(flops.get(n, 0.0) for n in trained)


def numpy_gflops() -> float:
    a = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    a @ a
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t0)
    return 2 * 1024**3 / float(np.median(times)) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds per framework (median taken)")
    every = [*MODELS, *TORCHVISION]
    parser.add_argument("--models", nargs="+", choices=every, default=every, help="rows to run (default: all)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(json.loads(args.probe))
        return
    env = on_threads(args.threads)
    import torch

    import zoo
    from planner.inputs.model import load_model
    from planner.measurement.latency import time_step
    from planner.runtime.session import TrainingSession

    torch.set_num_threads(args.threads)
    peak_blas = numpy_gflops()
    print(f"host: {args.threads} threads; numpy float32 1024x1024 matmul: {peak_blas:.1f} GFLOP/s\n")
    print(
        "| model | batch | update | planner ms | PyTorch ms | time ratio | planner MiB (planned) | PyTorch MiB "
        "| memory ratio | planner GFLOP/s (÷ numpy) | PyTorch GFLOP/s (÷ numpy) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label in args.models:
            native = None
            if label in TORCHVISION:
                native, resolution = TORCHVISION[label]
                path = export_torchvision(native, resolution, Path(tmp) / f"{native}.onnx")
            else:
                builder, kwargs = MODELS[label]
                path = zoo.save(getattr(zoo, builder)(**kwargs), Path(tmp) / f"{builder}.onnx")
            proto = onnx.load(path)
            layers = [layer.name for layer in load_model(path).layers]
            for batch in BATCHES:
                flops = layer_flops(proto, batch)
                for update in ("full", "sparse"):
                    trained = trainable_layers(layers, update)
                    model, compiled = planner_step(path, trained, batch)
                    session = TrainingSession(compiled.library, compiled.signature, model.initializers)
                    params = list(compiled.signature.trainable)
                    torch_step = torch_step_setup(proto, params, batch, native, trained)
                    for _ in range(3):
                        torch_step()
                    # alternating rounds: the host's speed drifts, and both frameworks should see
                    # the same drift
                    rounds_p, rounds_t = [], []
                    for _ in range(args.rounds):
                        rounds_p.append(time_step(session, args.repeats, "local").median)
                        rounds_t.append(time_torch(torch_step, args.repeats))
                    t_planner, t_torch = float(np.median(rounds_p)), float(np.median(rounds_t))
                    spec = {"model": str(path), "batch": batch, "threads": args.threads}
                    m_planner = peak_growth({**spec, "framework": "planner", "layers": trained}, env)
                    m_torch = peak_growth(
                        {**spec, "framework": "torch", "params": params, "native": native, "layers": trained}, env
                    )
                    work = step_flops(flops, layers, trained) / 1e9
                    g_planner, g_torch = work / (t_planner / 1e3), work / (t_torch / 1e3)
                    print(
                        f"| {label} | {batch} | {update} | {t_planner:.2f} | {t_torch:.2f} | {t_planner / t_torch:.2f}x | "
                        f"{m_planner / 2**20:.2f} ({compiled.memory.total / 2**20:.2f}) | {m_torch / 2**20:.2f} | "
                        f"{m_planner / max(m_torch, 1):.2f}x | {g_planner:.2f} ({g_planner / peak_blas:.1%}) | "
                        f"{g_torch:.2f} ({g_torch / peak_blas:.1%}) |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
