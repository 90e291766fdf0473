"""A text transformer's training step in planner (TVM) vs PyTorch eager, side by side, on this host.

    pip install -e '.[test]'          # PyTorch and transformers come with the test extra
    python benchmarks/sequence_step.py [--threads 2] [--batch 8] [--length 128] [--vocab 2000] [--rounds 3] [--profile]

A BERT-style encoder classifier built by Hugging Face transformers from a small config (vocabulary
2,000 or `--vocab`: BERT's own is 30,522, hidden 128, 2 layers of 4 heads, feed-forward 512; random weights, nothing downloaded),
taking `input_ids` and `attention_mask` [batch, length], exported with `torch.onnx.export`
(dynamo=False). Two updates, the same weights, trainable set, plain SGD and thread count in both:

- `full`: every parameter (the embedding tables included);
- `lora`: rank-8 adapters on every block's query and value projections (W frozen, W + B·A), and
  the classifier; in PyTorch each projection is wrapped as `y = x Wᵀ + b + (x Aᵀ) Bᵀ`.

Step time: planner's compiled step (the VM's time evaluator, as a plan measures it) against
PyTorch's (forward, cross-entropy, backward, `optimizer.step()`), in alternating rounds (median
over rounds) so both see the host's drift alike. `--profile` adds planner's kernel profile of
each step (`planner measure -v`): the slowest kernels, the attention and embedding kernels among them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

NUM_CLASSES = 10
VOCAB = 2000
LR = 0.01
RANK = 8


def on_threads(threads: int) -> None:
    """This script re-run with TVM (and OpenMP) on `threads` threads, unless it already is: TVM
    reads TVM_NUM_THREADS once, at start-up."""
    if os.environ.get("TVM_NUM_THREADS") != str(threads):
        env = {**os.environ, "TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def bert(length: int):
    import torch

    import torch_families as tf

    tf.torchvision()  # transformers imports torchvision: its C-op registrations stubbed first
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=length,
        num_labels=NUM_CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    inner = transformers.BertForSequenceClassification(config).eval()

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = inner

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    return Classifier().eval()


def batch_of(batch: int, length: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (batch, length)).astype(np.int64)
    mask = (np.arange(length) < rng.integers(length // 2, length + 1, batch)[:, None]).astype(np.int64)
    return ids, mask, np.arange(batch) % NUM_CLASSES


def export(module, path: Path, length: int) -> Path:
    import torch

    ids, mask, _ = batch_of(2, length)
    names = ["input_ids", "attention_mask"]
    torch.onnx.export(
        module,
        (torch.from_numpy(ids), torch.from_numpy(mask)),
        str(path),
        input_names=names,
        output_names=["logits"],
        dynamo=False,
        dynamic_axes={**{n: {0: "batch"} for n in names}, "logits": {0: "batch"}},
    )
    return path


def lora_layers(layers: list[str]) -> list[str]:
    return [n for n in layers if n.endswith(("attention.self.query", "attention.self.value"))]


# --- PyTorch ----------------------------------------------------------------------------------


def torch_step(module, update: str, batch: int, length: int):
    import torch

    if update == "lora":
        for p in module.parameters():
            p.requires_grad_(False)
        for name in lora_layers([n for n, _ in module.named_modules()]):
            parent, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent), child, LoRALinear(module.get_submodule(name)))
        for p in module.model.classifier.parameters():
            p.requires_grad_(True)
    trained = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR)
    ids, mask, y = (torch.from_numpy(a) for a in batch_of(batch, length))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(module(ids, mask), y).backward()
        opt.step()

    return step


def LoRALinear(linear):  # noqa: N802  (a module factory, named as the module it makes)
    import torch

    class Adapted(torch.nn.Module):
        """y = x Wᵀ + b + (x Aᵀ) Bᵀ, W frozen; B starts at zero, as planner's adapters do."""

        def __init__(self) -> None:
            super().__init__()
            self.base = linear
            self.a = torch.nn.Parameter(torch.randn(RANK, linear.in_features) * 0.01)
            self.b = torch.nn.Parameter(torch.zeros(linear.out_features, RANK))

        def forward(self, x):
            return self.base(x) + (x @ self.a.T) @ self.b.T

    return Adapted()


# --- planner ----------------------------------------------------------------------------------


def planner_session(path: Path, update: str, batch: int):
    import tvm

    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.inputs.model import load_model
    from planner.runtime.session import TrainingSession
    from planner.types import Candidate

    model = load_model(path)
    names = [layer.name for layer in model.layers]
    if update == "full":
        trainable = tuple((n, "full") for n in names)
    else:
        trainable = (*((n, f"lora:{RANK}") for n in lora_layers(names)), (names[-1], "full"))
    compiled = compile_candidate(model, Candidate(trainable, batch, "sgd", LR), BuildOptions(tvm.target.Target({"kind": "llvm"})))
    return compiled, TrainingSession(compiled.library, compiled.signature, model.initializers)


def main() -> None:
    global VOCAB
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds per framework (median taken)")
    parser.add_argument("--profile", action="store_true", help="print planner's slowest kernels of each step")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="the token embedding table's rows")
    args = parser.parse_args()
    on_threads(args.threads)
    VOCAB = args.vocab  # the table `bert` builds and `batch_of` draws from

    import torch

    torch.set_num_threads(args.threads)
    from step_vs_pytorch import time_torch  # the same PyTorch timing as every step-vs-PyTorch row

    from planner.measurement.latency import time_step
    from planner.measurement.profile import profile_step

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = export(bert(args.length), Path(tmp) / "bert.onnx", args.length)
        for update in ("full", "lora"):
            compiled, session = planner_session(path, update, args.batch)
            step = torch_step(bert(args.length), update, args.batch, args.length)
            ours, theirs = [], []
            for _ in range(3):  # PyTorch's first steps allocate: warmed up as planner's time evaluator is
                step()
            for _ in range(args.rounds):
                ours.append(time_step(session, args.repeats, "local").median)
                theirs.append(time_torch(step, args.repeats))
            planner_ms, torch_ms = float(np.median(ours)), float(np.median(theirs))
            rows.append((update, planner_ms, torch_ms, compiled.memory.total))
            if args.profile:
                from planner.inputs.model import load_model

                profile = profile_step(compiled, load_model(path).initializers)
                print(f"\n{update}: planner's slowest kernels per step (ms, GFLOP/s)")
                for k in profile.kernels[:12]:
                    rate = f"{k.gflops:.1f}" if k.gflops else "-"
                    print(f"  {k.name:60s} {k.seconds * 1e3:7.3f} ms  x{k.calls:<3d} {rate:>6s}")
    print(
        f"\nBERT-style encoder (vocabulary {VOCAB}, hidden 128, 2 layers), batch {args.batch}, length {args.length}, {args.threads} threads"
    )
    print("| update | planner ms | PyTorch eager ms | ratio | planner peak MiB |")
    print("|---|---:|---:|---:|---:|")
    for update, ours_ms, torch_ms, peak in rows:
        print(f"| {update} | {ours_ms:.2f} | {torch_ms:.2f} | {ours_ms / torch_ms:.2f}x | {peak / 2**20:.1f} |")


if __name__ == "__main__":
    main()
