"""A GPT-2-small-sized decoder's causal-LM step with LoRA: planner (TVM) vs PyTorch eager, time and peak memory.

    pip install -e '.[test]'          # PyTorch and transformers come with the test extra
    python benchmarks/causal_lm_step.py [--threads 2] [--batch 4] [--length 256] [--rank 8] [--rounds 2]

The decoder is Hugging Face's GPT-2 built from GPT-2-small's config (hidden 768, 12 layers of 12
heads, vocabulary 50,257, its LM head tied to the token embedding; random weights, nothing
downloaded; `--layers`, `--hidden`, `--vocab` make it smaller), exported with `torch.onnx.export`
(dynamo=False) taking `input_ids` and `attention_mask`. Both step the same update: rank-`--rank`
adapters on every block's attention and MLP projections (`attn.c_attn`, `attn.c_proj`,
`mlp.c_fc`, `mlp.c_proj`; W frozen, W + B·A), next-token cross-entropy over every position but
the last, plain SGD, the same thread count. PyTorch computes `[batch, length, vocabulary]`
logits and their loss whole (`F.cross_entropy`); planner's step computes them in chunks of
tokens (`planner.backend.graph.head`).

Each framework runs in a process of its own, in alternating rounds (`--rounds`, median taken):
- time: planner's compiled step (the VM's time evaluator, as a plan measures it) and PyTorch's
  step (forward, loss, backward, `optimizer.step()`), after warm-up steps;
- peak memory: the process's peak resident memory while stepping (`VmHWM`, reset after
  warm-up), less its resident memory before any weight existed: weights, adapters, activations,
  gradients and workspace, what a board must hold for the step. planner's own estimate, the
  figure a plan records, is printed beside it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

LR = 1e-3
PROJECTIONS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def on_threads(threads: int) -> None:
    """This script re-run with TVM (and OpenMP) on `threads` threads, unless it already is: TVM
    reads TVM_NUM_THREADS once, at start-up."""
    if os.environ.get("TVM_NUM_THREADS") != str(threads):
        env = {**os.environ, "TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def resident() -> dict[str, int]:
    """The process's resident memory now and its peak since the last `reset_peak`, in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def reset_peak() -> None:
    """Freed memory returned to the system, then the peak resident memory restarted from now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def gpt2(args: argparse.Namespace):
    import torch

    import torch_families as tf

    tf.torchvision()  # transformers imports torchvision: its C-op registrations stubbed first
    import transformers

    config = transformers.GPT2Config(
        vocab_size=args.vocab,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        n_positions=args.length,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    inner = transformers.GPT2LMHeadModel(config).eval()

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = inner

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    return Decoder().eval()


def batch_of(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids, an all-ones mask, and each position's next token (-100 at the last)."""
    ids = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.length)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((args.batch, 1), -100)], axis=1)
    return ids, np.ones_like(ids), labels


def export(args: argparse.Namespace, path: Path) -> Path:
    import torch

    import torch_families as tf

    ids, mask, _ = batch_of(argparse.Namespace(**{**vars(args), "batch": 1}))
    tf.torch_export(
        gpt2(args),
        (torch.from_numpy(ids), torch.from_numpy(mask)),
        path,
        names=["input_ids", "attention_mask"],
        exporter="legacy",
    )
    return path


# --- PyTorch ----------------------------------------------------------------------------------


def adapted(conv1d, rank: int):
    """GPT-2's Conv1D (y = x W + b, W [in, out]) with y += (x Aᵀ) Bᵀ; B starts at zero, as planner's."""
    import torch

    class Adapted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = conv1d
            n_in, n_out = conv1d.weight.shape
            self.a = torch.nn.Parameter(torch.randn(rank, n_in) * 0.01)
            self.b = torch.nn.Parameter(torch.zeros(n_out, rank))

        def forward(self, x):
            return self.base(x) + (x @ self.a.T) @ self.b.T

    return Adapted()


def run_torch(args: argparse.Namespace) -> dict:
    import torch

    import torch_families as tf

    tf.torchvision()
    import transformers  # noqa: F401  (its import is runtime, not the step's memory)

    torch.set_num_threads(args.threads)
    reset_peak()
    bare = resident()["VmRSS"]
    module = gpt2(args)
    for p in module.parameters():
        p.requires_grad_(False)
    for name, sub in list(module.named_modules()):
        if name.endswith(PROJECTIONS):
            parent, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent), child, adapted(sub, args.rank))
    trained = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR)
    ids, mask, labels = (torch.from_numpy(a) for a in batch_of(args))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = module(ids, mask)
        torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1), ignore_index=-100).backward()
        opt.step()

    for _ in range(2):
        step()
    reset_peak()
    before = resident()["VmRSS"]
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": float(np.median(times)), "peak": resident()["VmHWM"] - bare, "held": before - bare, "adapters": len(trained)}


# --- planner ----------------------------------------------------------------------------------


def candidate(model, rank: int):
    from planner.types import Candidate

    names = [layer.name for layer in model.layers if layer.name.endswith(PROJECTIONS)]
    return Candidate(tuple((n, f"lora:{rank}") for n in names), BATCH, "sgd", LR)


BATCH = 4


def compiled_step(path: Path, args: argparse.Namespace, cache: Path):
    import tvm

    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.inputs.model import load_model
    from planner.tasks import TASKS

    global BATCH
    BATCH = args.batch
    model = load_model(path).with_task(TASKS["causal-lm"])
    return model, compile_candidate(model, candidate(model, args.rank), BuildOptions(tvm.target.Target({"kind": "llvm"}), cache))


def run_planner(args: argparse.Namespace) -> dict:
    from planner.measurement.latency import time_step
    from planner.runtime.session import TrainingSession

    reset_peak()
    bare = resident()["VmRSS"]
    model, compiled = compiled_step(Path(args.model), args, Path(args.cache))
    session = TrainingSession(compiled.library, compiled.signature, model.initializers)
    adapters = len(compiled.signature.trainable)
    estimate = compiled.memory.total
    del model, compiled  # the ONNX file's copy of the weights: the session holds its own
    ids, mask, labels = batch_of(args)
    session.step((ids, mask), labels)
    reset_peak()
    before = resident()["VmRSS"]
    for _ in range(2):
        session.step((ids, mask), labels)
    peak = resident()["VmHWM"] - bare
    ms = time_step(session, args.repeats, "local", repeat_ms=0).median
    return {"ms": ms, "peak": peak, "held": before - bare, "estimate": estimate, "adapters": adapters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per framework (median taken)")
    parser.add_argument("--role", choices=("torch", "planner"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    on_threads(args.threads)
    if args.role:
        print(json.dumps(run_torch(args) if args.role == "torch" else run_planner(args)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        path = export(args, Path(tmp) / "gpt2.onnx")
        t0 = time.perf_counter()
        _, compiled = compiled_step(path, args, Path(tmp) / "cache")
        compile_s = time.perf_counter() - t0
        del compiled
        runs: dict[str, list[dict]] = {"planner": [], "torch": []}
        for _ in range(args.rounds):
            for role in runs:
                argv = [sys.executable, __file__, *sys.argv[1:], "--role", role, "--model", str(path), "--cache", f"{tmp}/cache"]
                out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
                runs[role].append(json.loads(out.strip().splitlines()[-1]))
    ours, theirs = runs["planner"], runs["torch"]
    ms = {k: float(np.median([r["ms"] for r in v])) for k, v in runs.items()}
    peak = {k: float(np.median([r["peak"] for r in v])) / 2**20 for k, v in runs.items()}
    print(
        f"\nGPT-2 decoder (hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}), causal LM, batch {args.batch}, "
        f"length {args.length}, LoRA rank {args.rank} on {ours[0]['adapters'] // 2} projections, {args.threads} threads; "
        f"planner's compile {compile_s:.0f} s"
    )
    print("| | step ms | peak MiB (stepping) | held MiB (between steps) |")
    print("|---|---:|---:|---:|")
    for name, key in (("planner", "planner"), ("PyTorch eager", "torch")):
        held = float(np.median([r["held"] for r in runs[key]])) / 2**20
        print(f"| {name} | {ms[key]:.0f} | {peak[key]:.0f} | {held:.0f} |")
    print(
        f"| planner / PyTorch | {ms['planner'] / ms['torch']:.2f}x | {peak['planner'] / peak['torch']:.2f}x | |\n"
        f"planner's estimate of its step (the plan's figure): {ours[0]['estimate'] / 2**20:.0f} MiB; "
        f"rounds: planner {[round(r['ms']) for r in ours]} ms, PyTorch {[round(r['ms']) for r in theirs]} ms"
    )


if __name__ == "__main__":
    main()
